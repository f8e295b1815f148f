"""The rollout seam: what a workflow gets (``RolloutContext``) and what it is (``Workflow``).

A workflow turns one ``Sample`` (a prompt, possibly with a partial response to resume)
into a finished one: ``async def workflow(ctx, sample) -> Sample | list[Sample]``. The
engine is its only handle on the model; ``ctx.score`` computes the reward. A workflow
that branches returns ``[sample, *branches]``, each trained as a row of its own with
``sample``'s advantage (docs/design.md section 4).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from asyncrl.engines.base import FinishReason, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncrl.engines.sglang_wire import GenerateResult
    from asyncrl.types import Sample

Reward = float | dict[str, float]


class Generator(Protocol):
    """What a workflow calls to generate: ``SGLangClient`` for engines reached over HTTP,
    ``InProcessGenerator`` for embedded engines in the actor's own process."""

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        rid: str | None = None,
    ) -> GenerateResult:
        """Tokens in, tokens with behaviour log-probs and weight versions out."""
        ...


class RewardFunction(Protocol):
    """Scores a finished sample; raising (or timing out) marks that sample failed."""

    async def __call__(self, sample: Sample) -> Reward:
        """The reward of ``sample`` (a float, or named floats for multi-objective runs)."""
        ...


@dataclass(slots=True)
class RolloutContext:
    """Everything a workflow may use; built once per rollout actor.

    ``sampling`` are SGLang sampling params, typed (a mapping is parsed here, once);
    ``budget`` is their ``max_new_tokens``, the response's token budget;
    ``version()`` is the weight version the engine serves now; ``aborts()`` counts the
    aborts of all in-flight work so far (a workflow that makes several engine calls stops
    at its next call when it changed); ``tools`` is the tool registry of multi-turn
    workflows (None for single-turn).
    """

    engine: Generator
    score: RewardFunction
    sampling: SamplingParams
    tokenizer: PreTrainedTokenizerBase | None = None
    version: Callable[[], int] = lambda: 0
    aborts: Callable[[], int] = lambda: 0
    tools: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    eos: frozenset[int] = field(init=False)  # the model's end tokens (``end_ids``)

    def __post_init__(self) -> None:
        # The one parse of the rollout's sampling params: typed from here to the engine.
        if not isinstance(self.sampling, SamplingParams):
            self.sampling = parse_sampling(self.sampling)
        self.eos = end_ids(self.tokenizer)

    def finish(self, result: GenerateResult, params: SamplingParams) -> FinishReason | None:
        """``result``'s finish reason, with a reply that its last token ended read as stopped.

        SGLang checks the length before its stop conditions (older vLLM releases too), so
        a reply whose end token, or the token that completes a stop string, is the last
        one allowed comes back ``length``; it ended, as asyncrl's engine and vLLM 0.32
        (stop first) say. What ends it is ``_ended_by_last``.
        """
        reason = result.finish_reason
        if reason is None or reason.type != "length" or not result.output_ids:
            return reason
        matched = self._ended_by_last(result.output_ids, params)
        return reason if matched is None else FinishReason(type="stop", matched=matched)

    def _ended_by_last(self, ids: list[int], params: SamplingParams) -> int | str | None:
        """The stop the last of ``ids`` met: a ``stop_token_ids`` or ``eos`` id (neither
        under ``ignore_eos``, as SGLang), else a stop string or regex that it completed
        (its text matches with the last token and not without); None if none."""
        if not params.ignore_eos and ids[-1] in {*(params.stop_token_ids or ()), *self.eos}:
            return ids[-1]
        if self.tokenizer is None or not (params.stop_strings or params.stop_regexes):
            return None
        text, before = (str(self.tokenizer.decode(part)) for part in (ids, ids[:-1]))
        for stop in params.stop_strings:
            if stop in text and stop not in before:
                return stop
        for pattern in params.stop_regexes:
            if re.search(pattern, text) and not re.search(pattern, before):
                return pattern
        return None

    @property
    def budget(self) -> int:
        """The response's token budget: ``max_new_tokens`` (SGLang's 128 when null)."""
        cap = self.sampling.max_new_tokens
        return 128 if cap is None else cap

    def sampling_with(self, **changes: Any) -> SamplingParams:
        """The rollout's sampling params with ``changes`` (a turn's token limit, an
        agent's stop strings), checked as the originals were."""
        changed = msgspec.structs.replace(self.sampling, **changes)
        changed.verify()
        return changed


def end_ids(tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """The end-of-sequence ids the tokenizer names, and the generation config and config
    of its model (a local folder or the local Hugging Face cache): the ids engines stop on."""
    if tokenizer is None:
        return frozenset()
    ids = {tokenizer.eos_token_id} - {None}
    path = getattr(tokenizer, "name_or_path", None)
    if not isinstance(path, str) or not path:  # built in memory: the tokenizer's alone
        return frozenset(ids)
    from transformers.utils import cached_file

    for name in ("generation_config.json", "config.json"):
        try:
            found = cached_file(
                path, name, local_files_only=True, _raise_exceptions_for_missing_entries=False
            )
            eos = json.loads(Path(found).read_text()).get("eos_token_id") if found else None
        except (OSError, ValueError, AttributeError):
            continue
        ids |= {i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)}
    return frozenset(ids)


def parse_sampling(value: SamplingParams | Mapping[str, Any]) -> SamplingParams:
    """SGLang sampling params from a mapping (typed ones as they are); ``ValueError``
    naming the bad key."""
    if isinstance(value, SamplingParams):
        return value
    try:
        params = msgspec.convert(dict(value), SamplingParams)
        params.verify()
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"invalid sampling params: {exc}") from None
    return params


Workflow = Callable[[RolloutContext, "Sample"], Awaitable["Sample | list[Sample]"]]
"""A workflow object may also define ``resources(ctx)``, returning an async context manager
that the actor enters once its context is built and exits when it stops (the agent
workflow's OpenAI proxy server)."""
