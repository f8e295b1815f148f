"""A few trained samples per step, as text: what a run's numbers are made of.

``sample_rows`` picks samples of a trained batch alternating the highest and the lowest
reward (the extremes say most about what is being reinforced), one JSON-able row each
(``COLUMNS``). The trainer writes ``train.log_samples`` of them a step to
``RUN_DIR/samples.jsonl``; the controller forwards them to TensorBoard and W&B.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: observe is below types in the package order
    from asyncrl.types import Sample, TrainBatch

#: The columns of a samples table, in order.
COLUMNS = (
    "step",
    "group",
    "prompt",
    "response",
    "reward",
    "status",
    "response_tokens",
    "staleness",
)


def sample_rows(batch: TrainBatch, version: int, n: int, reward_key: str) -> list[dict[str, Any]]:
    """``n`` rows of ``batch`` (trained into ``version``): highest, lowest, next highest...
    A row's ``staleness`` is ``version - 1 - min(token versions)``: the versions between the
    sample's oldest token and the weights the step trained."""
    if n <= 0:
        return []
    samples = [(g.uid, s) for g in batch.groups for s in g.samples]
    ranked = sorted(samples, key=lambda gs: _score(gs[1], reward_key))
    picked: list[tuple[str, Sample]] = []
    while ranked and len(picked) < n:
        picked.append(ranked.pop())  # the highest left
        if ranked and len(picked) < n:
            picked.append(ranked.pop(0))  # the lowest left
    return [_row(group, s, version) for group, s in picked]


def _score(sample: Sample, key: str) -> float:
    reward = sample.reward
    value = reward.get(key) if isinstance(reward, dict) else reward
    return float(value) if isinstance(value, int | float) else float("-inf")


def _row(group: str, s: Sample, version: int) -> dict[str, Any]:
    versions = [int(v) for v in s.token_versions]
    return {
        "step": version,
        "group": group,
        "prompt": _prompt_text(s.prompt),
        "response": s.response_text,
        "reward": s.reward,
        "status": str(s.status),
        "response_tokens": len(s.response_tokens),
        "staleness": version - 1 - min(versions) if versions else 0,
    }


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt)
