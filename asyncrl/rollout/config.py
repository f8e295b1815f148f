"""Rollout settings that the config tree composes (no torch, no HTTP imports here).

``EngineConfig`` (which engines a rollout actor uses, ``rollout.engine``) and
``RolloutConfig`` (the ``rollout`` section: actors, engines, sampling, workflow, reward).
Read by ``actors/rollout.py`` and ``rollout/engines.py``; composed by ``asyncrl.config``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class EngineConfig(BaseModel):
    """Which engines a rollout actor uses and how they take new weights."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    type: Literal["torch", "sglang"] = Field("torch", description="embedded torch or SGLang")
    model_path: str | None = Field(None, description="HF model directory (torch engine).")
    device: str = Field("cpu", description="torch device of the embedded engine.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weights")
    max_running: int = Field(64, ge=1, description="Requests decoded together (torch engine).")
    urls: list[str] = Field(default_factory=list, description="SGLang server URLs (sglang).")
    router: bool = Field(False, description="The one URL is an sglang-router.")
    on_update: Literal["continue", "abort"] = Field(
        "continue", description="In-flight requests on a weight update: continue or abort."
    )

    @model_validator(mode="after")
    def _complete(self) -> EngineConfig:
        if self.type == "torch" and not self.model_path:
            raise ValueError("the torch engine needs model_path (an HF model directory)")
        if self.type == "sglang" and not self.urls:
            raise ValueError("the sglang engine type needs urls (server or router addresses)")
        return self


class RewardConfig(BaseModel):
    """The reward hub (``rollout/rewards.py``): which reward, and its limits.

    ``type``: ``exact`` / ``numeric`` / ``math`` / ``f1`` compare the answer in the
    response with the sample's label; ``custom`` calls ``path`` (``module:function``,
    slime's ``--custom-rm-path``); ``remote`` POSTs to ``url``.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    type: Literal["exact", "numeric", "math", "f1", "custom", "remote"] = Field(
        "exact", description="which reward", json_schema_extra={"flag": "rm-type"}
    )
    path: str | None = Field(
        None,
        description="custom reward 'module:function' (sync or async, fn(sample))",
        json_schema_extra={"flag": "custom-rm-path"},
    )
    url: str | None = Field(None, description="remote reward model URL (POST JSON)")
    timeout_s: float = Field(10.0, gt=0, description="a reward slower than this fails")
    answer_pattern: str | None = Field(
        None,
        description="regex whose one group (or whole match) is the answer; its last match counts",
    )
    numeric_tolerance: float = Field(1e-6, ge=0, description="numeric: allowed difference")
    correct: float = Field(1.0, description="reward of a correct answer")
    incorrect: float = Field(0.0, description="reward of a wrong answer")

    @field_validator("answer_pattern")
    @classmethod
    def _valid_pattern(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            groups = re.compile(value).groups
        except re.error as exc:
            raise ValueError(f"answer_pattern {value!r} is not a regex: {exc}") from None
        if groups > 1:
            raise ValueError(
                f"answer_pattern {value!r} has {groups} groups; use one (?:...) for the others"
            )
        return value

    @model_validator(mode="after")
    def _complete(self) -> RewardConfig:
        if self.type == "custom" and not self.path:
            raise ValueError("the custom reward needs path (--custom-rm-path module:function)")
        if self.type == "remote" and not self.url:
            raise ValueError("the remote reward needs url")
        return self


class RolloutConfig(BaseModel):
    """Rollout actors: how many, their engines, sampling, workflow and reward."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    num_actors: int = Field(2, ge=1, description="number of rollout actors")
    engine: EngineConfig | None = Field(
        None, description="engines of each actor; default: embedded torch on the trainer's model"
    )
    sampling: dict[str, Any] = Field(
        default_factory=lambda: {"temperature": 1.0, "max_new_tokens": 64},
        description="SGLang sampling params of training rollouts (max_new_tokens: budget)",
    )
    max_groups: int = Field(8, ge=1, description="groups in flight per rollout actor")
    workflow: str | None = Field(
        None,
        description="custom workflow 'module:function' (default single-turn)",
        json_schema_extra={"flag": "custom-generate-function-path"},
    )
    reward: RewardConfig = Field(
        default_factory=lambda: RewardConfig(), description="the reward hub's settings"
    )

    @field_validator("sampling")
    @classmethod
    def _valid_sampling(cls, value: dict[str, Any]) -> dict[str, Any]:
        import msgspec

        from asyncrl.engines.base import SamplingParams

        try:
            msgspec.convert(value, SamplingParams).verify()
        except (msgspec.ValidationError, ValueError) as exc:
            raise ValueError(f"invalid sampling params: {exc}") from None
        return value
