"""A ``TrainBatch`` (or SFT examples) as the trainer's tensors, rows in sample order.

Rows are the samples of the kept groups, group by group (``G * n``), then their branches
in the same order (``branch_roots`` gives each one's sample row); response columns are
right padded to the longest response ``T``. A group is dropped whole (and counted) when
any sample is not ``USABLE`` or has no finite score: a partial group would bias the group
baselines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncrl.trainers.base import UntrainableBatch
from asyncrl.types import Group, Sample, SampleStatus, TrainBatch

USABLE = frozenset({SampleStatus.COMPLETED, SampleStatus.TRUNCATED})


@dataclass(frozen=True, slots=True)
class RolloutTensors:
    """The rows of one step.

    ``sequences[i]`` is prompt + response token ids, the response from ``prompt_lens[i]``.
    ``[B, T]`` columns: ``mask`` (float loss mask, 0 on padding), ``behaviour`` (engine
    log-probs), ``versions`` (weight version of each token, int64). ``scores_GN`` holds
    the scalar rewards, one row per group. ``temperatures[i]`` is the temperature row
    ``i`` was sampled at: its log-probs are recomputed under ``softmax(z / T)``.
    """

    sequences: list[np.ndarray]
    prompt_lens: list[int]
    mask: torch.Tensor
    behaviour: torch.Tensor
    versions: torch.Tensor
    scores_GN: torch.Tensor
    temperatures: list[float]
    num_dropped_groups: int = 0
    #: Share of the rows cut at the length limit (status truncated).
    truncated_share: float = 0.0
    #: Mean over the rows of each other entry of dict rewards (reward terms), by name.
    reward_terms: dict[str, float] = field(default_factory=dict)
    #: The rows after the ``G * n`` samples are their branches (``Sample.branches``):
    #: ``branch_roots[j]`` is the row of branch row ``G * n + j``'s sample.
    branch_roots: list[int] = field(default_factory=list)

    def row_groups(self) -> list[int]:
        """The group of every row (a branch's is its sample's)."""
        n = max(1, int(self.scores_GN.shape[1])) if self.scores_GN.numel() else 1
        roots = range(self.num_rows - len(self.branch_roots))
        return [r // n for r in roots] + [r // n for r in self.branch_roots]

    @property
    def num_rows(self) -> int:
        """``B``."""
        return len(self.sequences)

    @property
    def width(self) -> int:
        """``T``, at least 1."""
        return int(self.mask.shape[1])


def _term_means(samples: list[Sample], key: str) -> dict[str, float]:
    """The mean of each entry of the samples' dict rewards but ``key`` (over the samples
    that have it)."""
    values: dict[str, list[float]] = {}
    for s in samples:
        if isinstance(s.reward, dict):
            for name, value in s.reward.items():
                if name != key:
                    values.setdefault(name, []).append(float(value))
    return {name: float(np.mean(v)) for name, v in values.items()}


def sample_score(reward: float | dict[str, float] | None, key: str) -> float:
    """The scalar reward: a float as is, ``reward[key]`` of a dict, NaN when missing."""
    if reward is None:
        return math.nan
    if isinstance(reward, dict):
        return float(reward.get(key, math.nan))
    return float(reward)


def _trainable(group: Group, key: str) -> bool:
    return all(
        s.status in USABLE
        and math.isfinite(sample_score(s.reward, key))
        and all(b.status in USABLE for b in s.branches)
        for s in group.samples
    )


def rollout_tensors(batch: TrainBatch, reward_key: str = "score") -> RolloutTensors:
    """The step's tensors from ``batch``; raises ``UntrainableBatch`` when nothing is.

    Kept groups must all have the same number of samples (``[G, n]`` scores).
    """
    groups = [g for g in batch.groups if g.samples and _trainable(g, reward_key)]
    if not groups:
        raise UntrainableBatch(
            f"batch {batch.batch_id}: no trainable group (each has a sample that is not "
            f"completed/truncated or has no {reward_key!r} reward)"
        )
    sizes = sorted({len(g.samples) for g in groups})
    if len(sizes) > 1:
        raise ValueError(f"batch {batch.batch_id}: groups of different sizes {sizes}")
    roots = [s for g in groups for s in g.samples]
    branch_roots = [i for i, s in enumerate(roots) for _ in s.branches]
    samples = roots + [b for s in roots for b in s.branches]
    temperatures: list[float] = []
    for s in samples:
        if len(s.prompt_tokens) == 0:
            raise ValueError(f"sample {s.uid}: empty prompt, its first token has no context")
        if s.temperature is None or not (math.isfinite(s.temperature) and s.temperature > 0):
            raise ValueError(
                f"sample {s.uid}: temperature {s.temperature} (the log-probs are "
                "log_softmax(z / T): T must be set, finite and > 0; greedy samples carry 1)"
            )
        temperatures.append(s.temperature)
    scores = [[sample_score(s.reward, reward_key) for s in g.samples] for g in groups]
    columns = _columns(samples)
    return RolloutTensors(
        sequences=[np.concatenate([s.prompt_tokens, s.response_tokens]) for s in samples],
        prompt_lens=[len(s.prompt_tokens) for s in samples],
        mask=columns[0].float(),
        behaviour=columns[1].float(),
        versions=columns[2].long(),
        scores_GN=torch.tensor(scores, dtype=torch.float32),
        temperatures=temperatures,
        num_dropped_groups=len(batch.groups) - len(groups),
        reward_terms=_term_means(roots, reward_key),
        truncated_share=sum(s.status is SampleStatus.TRUNCATED for s in samples) / len(samples),
        branch_roots=branch_roots,
    )


def _columns(samples: Sequence[Sample]) -> list[torch.Tensor]:
    """Right-padded ``[B, T]`` loss mask, behaviour log-probs and versions."""
    width = max(1, max(s.response_length for s in samples))
    out = np.zeros((3, len(samples), width), dtype=np.float64)
    for i, s in enumerate(samples):
        n = s.response_length
        out[0, i, :n] = s.loss_mask
        out[1, i, :n] = s.logprobs
        out[2, i, :n] = s.token_versions
    return [torch.from_numpy(column) for column in out]


def sft_tensors(tokens: Sequence[np.ndarray], loss_masks: Sequence[np.ndarray]) -> RolloutTensors:
    """SFT sequences as rows: every token after the first is a "response" token.

    Token ``t`` is trained when ``loss_masks[t]`` (token 0 has no context and never is).
    """
    seqs = [np.asarray(t, dtype=np.int64) for t in tokens]
    width = max(1, max(len(s) - 1 for s in seqs))
    mask = torch.zeros(len(seqs), width)
    for i, (seq, m) in enumerate(zip(seqs, loss_masks, strict=True)):
        if len(seq) == 0 or len(m) != len(seq):
            raise ValueError(f"example {i}: {len(seq)} tokens but {len(m)} mask entries")
        mask[i, : len(seq) - 1] = torch.as_tensor(np.asarray(m[1:], dtype=np.float32))
    zeros = torch.zeros_like(mask)
    return RolloutTensors(
        sequences=seqs,
        prompt_lens=[1] * len(seqs),
        mask=mask,
        behaviour=zeros,
        versions=zeros.long(),
        scores_GN=torch.zeros(0, 0),
        temperatures=[1.0] * len(seqs),
    )
