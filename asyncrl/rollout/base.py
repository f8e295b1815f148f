"""The rollout seam: what a workflow gets (``RolloutContext``) and what it is (``Workflow``).

A workflow turns one ``Sample`` (a prompt, possibly with a partial response to resume)
into a finished one: ``async def workflow(ctx, sample) -> Sample | list[Sample]``. The
engine is its only handle on the model; ``ctx.score`` computes the reward. A workflow
that branches returns ``[sample, *branches]``: the other finished samples of the same
trajectory, each trained as a row of its own with ``sample``'s advantage
(``actors/rollout.py::attach_branches``; docs/design.md section 4).
Records and protocols only; ``single_turn.py`` is the reference workflow, the reward scorer
is ``rewards.py``, and ``actors/rollout.py`` runs workflows against engines.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

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
        sampling_params: Mapping[str, Any] | None = None,
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

    ``sampling`` are SGLang sampling params (``max_new_tokens`` is the response budget);
    ``version()`` is the weight version the engine serves now; ``aborts()`` counts the
    aborts of all in-flight work so far (a workflow that makes several engine calls stops
    at its next call when it changed); ``tools`` is the tool registry of multi-turn
    workflows (None for single-turn).
    """

    engine: Generator
    score: RewardFunction
    sampling: dict[str, Any]
    tokenizer: PreTrainedTokenizerBase | None = None
    version: Callable[[], int] = lambda: 0
    aborts: Callable[[], int] = lambda: 0
    tools: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


Workflow = Callable[[RolloutContext, "Sample"], Awaitable["Sample | list[Sample]"]]
"""A workflow object may also define ``resources(ctx)``, returning an async context manager
that the actor enters once its context is built and exits when it stops (the agent
workflow's OpenAI proxy server)."""
