"""``ContextBound``: a generator that keeps every request within the model's context.

SGLang answers 400 to a request whose ``input + max_new_tokens`` passes the context
instead of shortening it, while workflows ask for the rollout's budget whatever their
prompt and want a response cut at the context, as a model that runs out of room ends.
So ``generate`` asks for

    max_new_tokens = min(asked, context_length - len(input_ids))

and, with no room left, returns a ``length`` finish with no tokens without a call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from asyncrl.engines.base import FinishReason, SamplingParams
from asyncrl.engines.sglang_wire import GenerateResult


class ContextBound:
    """Wraps a ``Generator`` (module docstring)."""

    def __init__(self, inner: Any, context_length: int) -> None:
        self.inner, self.context_length = inner, context_length

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        rid: str | None = None,
    ) -> GenerateResult:
        params = sampling_params or {}
        typed = isinstance(params, SamplingParams)
        room = self.context_length - len(input_ids)
        asked = params.max_new_tokens if typed else params.get("max_new_tokens")
        if asked is not None and asked > room:
            if room <= 0:  # nothing fits: the response ends here, as at the context
                finish = FinishReason(type="length", length=0)
                return GenerateResult(
                    rid=rid or "", output_ids=[], logprobs=[], versions=[], finish_reason=finish
                )
            params = (
                msgspec.structs.replace(params, max_new_tokens=room)
                if typed
                else {**params, "max_new_tokens": room}
            )
        return await self.inner.generate(input_ids, params, rid=rid)

    def __getattr__(self, name: str) -> Any:  # the inner generator's other calls
        return getattr(self.inner, name)
