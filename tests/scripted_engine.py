"""A scripted ``Generator``: the engine seam of workflow tests (multi-turn, OpenAI proxy).

Each ``generate`` call samples the next scripted ``Step``'s text (plus EOS when it stops),
cut at ``max_new_tokens``, with made-up log-probs and the step's weight version; every
request's input ids and every sampled id list are recorded, so a test can check that a
workflow trains exactly what was sampled. A step whose ``finish`` is ``"abort"`` returns
its tokens as a partial output, as an engine aborted by a weight update does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.engines.base import FinishReason
from asyncrl.engines.sglang_wire import GenerateResult


@dataclass
class Step:
    """One scripted engine call: the text it samples, how it ends, the weights' version."""

    text: str
    finish: str = "stop"
    version: int = 0
    matched: str | None = None  # a stop string it ends on (its text holds it; no EOS)


class ScriptedEngine:
    """Samples the scripted steps in order; records every request's input ids."""

    def __init__(self, tokenizer: Any, steps: list[Step]) -> None:
        self.tokenizer, self.steps = tokenizer, list(steps)
        self.inputs: list[list[int]] = []
        self.sampled: list[list[int]] = []

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        rid: str | None = None,
    ) -> GenerateResult:
        step = self.steps.pop(0)
        self.inputs.append(list(input_ids))
        ids = self.tokenizer(step.text, add_special_tokens=False)["input_ids"]
        if step.finish == "stop" and step.matched is None:
            ids.append(self.tokenizer.eos_token_id)
        finish = step.finish
        cap = int((sampling_params or {})["max_new_tokens"])
        if len(ids) > cap:
            ids, finish = ids[:cap], "length"
        self.sampled.append(ids)
        logprobs = [-0.25 - 0.01 * i for i in range(len(ids))]
        return GenerateResult(
            rid=rid or "",
            output_ids=ids,
            logprobs=logprobs,
            versions=[step.version] * len(ids),
            finish_reason=FinishReason(type=finish, matched=step.matched),  # type: ignore[arg-type]
        )
