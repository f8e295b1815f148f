"""``LatencyModel``: how long a simulated engine takes, in modelled seconds.

Apart from the engine so the config tree (``rollout.engine.sim``) reads it without torch.
A decode step of ``running`` requests, with ``admitted`` prompt tokens joining it, takes::

    step_s = decode_base_s + decode_s_per_seq * running + prefill_s_per_token * admitted

Response lengths: with median ``m`` and ``r = p99 / m``, ``log L ~ N(log m, s)``,
``s = log r / 2.326`` (the standard normal's 99th percentile), cut at ``length_max``.

With ``token_stride`` k > 1 one token id stands for k modelled tokens, so long responses
run through the real control plane without sending every token: ``ceil(L / k)`` ids for
``L`` modelled tokens, ``k * step_s`` a step. Lengths, caps and times are in modelled
tokens; the ids, ``max_new_tokens`` and token counts on the wire are in strides.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

_Z99 = 2.326


class LatencyModel(BaseModel):
    """How long a simulated engine takes (module docstring); times in modelled seconds."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    decode_base_s: float = Field(0.02, ge=0, description="a decode step of one request")
    decode_s_per_seq: float = Field(1e-4, ge=0, description="added per running request")
    prefill_s_per_token: float = Field(2e-5, ge=0, description="per admitted prompt token")
    weight_update_s: float = Field(1.0, ge=0, description="loading a weight version")
    length_median: int = Field(512, ge=1, description="median response length (tokens)")
    length_p99_ratio: float = Field(
        8.0, ge=1, description="p99 / median of the response length (1: every one the median)"
    )
    length_max: int = Field(16384, ge=1, description="longest response (tokens)")
    time_scale: float = Field(1.0, gt=0, description="modelled seconds per wall second")
    token_stride: int = Field(
        1, ge=1, description="modelled tokens per token id on the wire (module docstring)"
    )
    switch_s: float = Field(
        0.0, ge=0, description="colocated: releasing plus resuming the engine's memory"
    )

    def step_seconds(self, running: int, admitted_tokens: int) -> float:
        """One step on the wire: ``k * (decode_base_s + decode_s_per_seq * running +
        prefill_s_per_token * admitted)`` with ``k = token_stride``."""
        return self.token_stride * (
            self.decode_base_s
            + self.decode_s_per_seq * running
            + self.prefill_s_per_token * admitted_tokens
        )

    def wire_length(self, rng: np.random.Generator) -> int:
        """A response length in token ids: ``ceil(sample_length / token_stride)``."""
        return -(-self.sample_length(rng) // self.token_stride)

    def sample_length(self, rng: np.random.Generator) -> int:
        """A response length: lognormal (median, p99 ratio), in ``[1, length_max]``."""
        sigma = math.log(self.length_p99_ratio) / _Z99
        length = rng.lognormal(math.log(self.length_median), sigma)
        return int(min(max(1, round(length)), self.length_max))
