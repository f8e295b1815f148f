"""The rollout seam: what a workflow gets (``RolloutContext``) and what it is (``Workflow``).

A workflow turns one ``Sample`` (a prompt, possibly with a partial response to resume)
into a finished one: ``async def workflow(ctx, sample) -> Sample | list[Sample]``. The
engine is its only handle on the model; ``ctx.score`` computes the reward. A workflow
that branches returns ``[sample, *branches]``, each trained as a row of its own with
``sample``'s advantage (docs/design.md section 4).
"""

from __future__ import annotations

import json
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
        """``result``'s finish reason, with a reply that ends on an end token stopped.

        SGLang checks the length before the stop tokens (older vLLM releases too), so a
        reply whose end token is the last one allowed comes back ``length``; it ended, as
        asyncrl's engine and vLLM 0.32 (stop first) say. End tokens:
        ``params.stop_token_ids``, and ``eos`` unless ``ignore_eos``.
        """
        reason = result.finish_reason
        if reason is None or reason.type != "length" or not result.output_ids:
            return reason
        last = result.output_ids[-1]
        ends = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else self.eos)
        return FinishReason(type="stop", matched=last) if last in ends else reason

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
    """The end-of-sequence ids the tokenizer, and the generation config and config beside
    it (a local model folder), name: the ids an engine stops on."""
    if tokenizer is None:
        return frozenset()
    ids = {tokenizer.eos_token_id} - {None}
    path = getattr(tokenizer, "name_or_path", None)
    if not isinstance(path, str) or not path:  # built in memory: the tokenizer's alone
        return frozenset(ids)
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((Path(path) / name).read_text()).get("eos_token_id")
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
