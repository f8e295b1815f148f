"""Scripted engines: tests that must know what the model "samples".

``ScriptedEngine`` is a ``Generator``, the engine seam of workflow tests (multi-turn,
OpenAI proxy). Each ``generate`` call samples the next scripted ``Step``'s text (plus EOS
when it stops), cut at ``max_new_tokens``, with made-up log-probs and the step's weight
version; every request's input ids and every sampled id list are recorded, so a test can
check that a workflow trains exactly what was sampled. A step whose ``finish`` is
``"abort"`` returns its tokens as a partial output, as an engine aborted by a weight
update does. ``length_first`` checks the length before the stop token, as SGLang does:
EOS on the last allowed token comes back ``length``.

``ScriptedServingEngine`` is what an ``EngineServer`` serves (the server's tests of tool
calls): each request samples the next scripted text, one token per cumulative output,
so a stream cuts the text at every token boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.engines.base import FinishReason, GenerateOutput, GenerateRequest, refuse_grammar
from asyncrl.engines.sglang_wire import GenerateResult
from asyncrl.rollout.base import parse_sampling


@dataclass
class Step:
    """One scripted engine call: the text it samples, how it ends, the weights' version."""

    text: str
    finish: str = "stop"
    version: int = 0
    matched: str | None = None  # a stop string it ends on (its text holds it; no EOS)


class ScriptedEngine:
    """Samples the scripted steps in order; records every request's input ids."""

    def __init__(self, tokenizer: Any, steps: list[Step], *, length_first: bool = False) -> None:
        self.tokenizer, self.steps, self.length_first = tokenizer, list(steps), length_first
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
        cap = parse_sampling(sampling_params or {}).max_new_tokens
        if len(ids) > cap or (self.length_first and len(ids) == cap):
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


class ScriptedServingEngine:
    """An engine for ``EngineServer`` that samples ``texts`` in order, then EOS.

    The server's warm-up probe gets one token; every other request takes the next text
    (``max_new_tokens`` cuts it, finish ``length``). Nothing is validated or aborted.
    """

    def __init__(self, tokenizer: Any, texts: Sequence[str] = ()) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)
        self.model_path = "scripted"
        self.version = 0
        self.version_names: dict[int, str] = {}

    async def run(self) -> None:
        await asyncio.Event().wait()  # the server cancels it when it stops

    def check(self, request: GenerateRequest) -> None:
        refuse_grammar(request.sampling, "the scripted engine")

    def abort(self, rid: str = "", *, abort_all: bool = False, prefix: bool = False) -> int:
        return 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        self.check(request)
        if request.rid.startswith("HEALTH_CHECK"):
            ids, finish = [0], FinishReason(type="length", length=1)
        else:
            eos = self.tokenizer.eos_token_id
            ids = [*self.tokenizer(self.texts.pop(0), add_special_tokens=False)["input_ids"], eos]
            finish = FinishReason(type="stop", matched=eos)
            cap = request.sampling.max_new_tokens
            if cap is not None and len(ids) > cap:
                ids, finish = ids[:cap], FinishReason(type="length", length=cap)
        for n in range(1, len(ids) + 1):
            await asyncio.sleep(0)
            yield GenerateOutput(
                rid=request.rid, output_ids=ids[:n], logprobs=[-0.5] * n, versions=[0] * n,
                finish_reason=finish if n == len(ids) else None,
                prompt_tokens=len(request.input_ids),
            )  # fmt: skip
