"""Held-out evaluation: run a set's prompts through a workflow and score pass@k.

``evaluate_set`` samples ``n`` responses for every prompt with the rollout workflow, so
evaluation sees exactly what training sees; a sample is correct when its reward is at
least ``correct``. ``pass@k`` is the mean over prompts of the unbiased estimator
``1 - C(n - c, k) / C(n, k)`` (``c`` correct of ``n``), so ``pass@1`` is the mean accuracy
of a single sample.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from asyncrl.policies.metrics import pass_at_k
from asyncrl.types import Prompt, Sample, SampleStatus

if TYPE_CHECKING:
    from asyncrl.rollout.base import RolloutContext, Workflow
    from asyncrl.rollout.config import EvalSetConfig


async def evaluate_set(
    ctx: RolloutContext,
    workflow: Workflow,
    prompts: list[Prompt],
    cfg: EvalSetConfig,
    *,
    correct: float,
    max_concurrency: int,
    tag: str = "eval",
    failures: Counter[str] | None = None,
) -> dict[str, float]:
    """Metrics of ``cfg``'s set (``score_samples``, and its ``seconds``); ``tag`` prefixes
    request ids. ``failures`` counts the failed samples' reasons."""
    start = time.perf_counter()
    gate = asyncio.Semaphore(max_concurrency)
    samples = [
        Sample.for_prompt(p, group_id=f"{tag}/{cfg.name}/{p.uid}", index=i, version=0)
        for p in prompts
        for i in range(cfg.n_samples)
    ]
    async with asyncio.TaskGroup() as tg:
        for s in samples:
            tg.create_task(_run(ctx, workflow, s, gate))
    if failures is not None:
        failures.update(s.error or "no reason" for s in samples if s.status is SampleStatus.FAILED)
    metrics = score_samples(samples, cfg, correct=correct)
    metrics["seconds"] = time.perf_counter() - start
    return metrics


async def _run(
    ctx: RolloutContext, workflow: Workflow, sample: Sample, gate: asyncio.Semaphore
) -> None:
    async with gate:
        sample.attempts += 1
        try:
            await workflow(ctx, sample)
        except Exception as exc:  # a raising reward or engine call fails this sample only
            sample.status, sample.error = SampleStatus.FAILED, f"{type(exc).__name__}: {exc}"


def score_samples(samples: list[Sample], cfg: EvalSetConfig, *, correct: float) -> dict[str, float]:
    """Metrics of finished ``samples`` (n per prompt): ``pass@k`` for each k (and 1);
    ``reward``, the mean reward (none counts 0); ``failed``, samples whose
    workflow or reward raised (wrong); ``truncated``, the share that hit the budget;
    ``response_len``, mean response tokens; ``tool_calls``, mean calls per sample
    (tool use only); with ``group_by``, ``pass@1/<value>`` per value of that key."""
    by_prompt: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_prompt[s.prompt_id].append(s)
    hits = {pid: sum(_is_correct(s, correct) for s in group) for pid, group in by_prompt.items()}
    n = cfg.n_samples
    out: dict[str, float] = {"prompts": float(len(by_prompt)), "samples": float(len(samples))}
    for k in sorted(set(cfg.pass_k) | {1}):
        out[f"pass@{k}"] = _mean([pass_at_k(n, c, k) for c in hits.values()])
    out["reward"] = _mean([_scalar(s.reward) for s in samples])
    out["failed"] = float(sum(s.status is SampleStatus.FAILED for s in samples))
    out["truncated"] = _mean([float(s.status is SampleStatus.TRUNCATED) for s in samples])
    out["response_len"] = _mean([float(s.response_length) for s in samples])
    if any("tool_calls" in s.metadata for s in samples):  # multi-turn tool use
        out["tool_calls"] = _mean([float(len(s.metadata.get("tool_calls", []))) for s in samples])
    if cfg.group_by:
        out.update(_breakdown(by_prompt, hits, n, cfg.group_by))
    return out


def _breakdown(
    by_prompt: dict[str, list[Sample]], hits: dict[str, int], n: int, key: str
) -> dict[str, float]:
    groups: dict[str, list[float]] = defaultdict(list)
    for pid, group in by_prompt.items():
        value = str(group[0].metadata.get(key, "none"))
        groups[value].append(pass_at_k(n, hits[pid], 1))
    return {f"pass@1/{value}": _mean(scores) for value, scores in sorted(groups.items())}


def _is_correct(sample: Sample, correct: float) -> bool:
    if sample.status is SampleStatus.FAILED or sample.reward is None:
        return False
    return _scalar(sample.reward) >= correct


def _scalar(reward: Any) -> float:
    """A dict reward's ``score`` entry (its first one when it has none); None is 0."""
    if reward is None:
        return 0.0
    if isinstance(reward, dict):
        return float(reward.get("score", next(iter(reward.values()), 0.0)))
    return float(reward)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
