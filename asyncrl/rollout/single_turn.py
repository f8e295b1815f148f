"""The reference workflow: one generation per sample, then the reward.

Resumable: a sample that comes back with a partial response (APRIL over-provisioning, an
abort on weight update, a requeue) continues from ``prompt + response`` with the token
budget reduced by what it already has, so the trained tokens are exactly the sampled
ones and each keeps the version that produced it.
"""

from __future__ import annotations

import numpy as np

from asyncrl.engines.base import SamplingParams
from asyncrl.engines.sglang_wire import GenerateResult
from asyncrl.rollout.base import RolloutContext
from asyncrl.types import Sample, SampleStatus

_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED}


async def single_turn(ctx: RolloutContext, sample: Sample) -> Sample:
    """Generate the rest of ``sample``'s response and score it.

    The sample ends ``completed`` (the model stopped), ``truncated`` (budget used up),
    ``aborted`` (cut off: resumable) or ``failed`` (with the reason in ``error``).
    """
    budget = ctx.budget - sample.response_length
    if budget > 0:
        params = ctx.sampling_with(max_new_tokens=budget)
        result = await ctx.engine.generate(
            np.concatenate([sample.prompt_tokens, sample.response_tokens]).tolist(),
            params,
            # The closing "#" keeps a prefix-matched abort of attempt 1 off attempt 10.
            rid=f"{sample.uid}#{sample.attempts}#",
        )
        _append(ctx, sample, result, params)
    else:
        sample.status, sample.finish_reason = SampleStatus.TRUNCATED, "length"
    if sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
        sample.reward = await ctx.score(sample)
    return sample


def _append(
    ctx: RolloutContext, sample: Sample, result: GenerateResult, params: SamplingParams
) -> None:
    if result.output_ids:
        if result.logprobs is None:
            raise ValueError("the engine returned no log-probs (return_logprob is required)")
        sample.append_response(result.output_ids, result.logprobs, result.versions)
        _set_text(ctx, sample, result)
    reason = ctx.finish(result, params)
    kind = reason.type if reason is not None else "abort"
    sample.finish_reason = kind
    sample.status = _STATUS.get(kind, SampleStatus.ABORTED)


def _set_text(ctx: RolloutContext, sample: Sample, result: GenerateResult) -> None:
    # Decoding the whole response, not the new segment alone, keeps a character whose
    # bytes an abort split across two segments whole (no U+FFFD in the reward's text).
    if ctx.tokenizer is None:
        sample.response_text += result.text
        return
    ids = sample.response_tokens.tolist()
    sample.response_text = str(ctx.tokenizer.decode(ids, skip_special_tokens=True))
