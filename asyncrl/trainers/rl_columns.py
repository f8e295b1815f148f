"""What both backends' RL steps share: the step's ``[B + 1, T]`` columns and metrics.

A step scores its rows once before any gradient (``step_columns``). When a step is one
optimizer update, every training forward runs at the weights the step starts from, so the
old (proximal) log-probs are that forward's own: ``logp_old = stopgrad(logp_theta)``
(``old_logprobs``), with no separate forward. A reference model (its KL ``old - ref``
enters the advantages) or several updates (``update_plan``) score them up front; with
``use_rollout_logprobs`` they are the engine's. Row ``B`` is the all-zero stand-in
(``EMPTY_SEQUENCE``) that fills a rank's missing micro-batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch

from asyncrl.policies import PolicyConfig, approx_kl, compute_advantages, masked_mean
from asyncrl.trainers.base import StepResult
from asyncrl.trainers.rollout_tensors import RolloutTensors

Columns = dict[str, torch.Tensor]
Scored = Literal["policy", "ref", "critic"]
#: One context token, one prediction, loss mask 0: stands in for a missing micro-batch.
EMPTY_SEQUENCE = np.zeros(2, dtype=np.int64)
#: Metrics that are a micro-batch's share of a step total (summed); the rest are masked
#: means over the micro-batch, averaged over the step weighted by loss tokens.
SHARES = frozenset({"loss", "pg_loss", "kl_loss", "value_loss"})


def pad_row(x_BT: torch.Tensor) -> torch.Tensor:
    """Append the empty stand-in's all-zero row."""
    return torch.cat([x_BT, x_BT.new_zeros(1, x_BT.shape[1])])


def step_columns(
    algo: PolicyConfig,
    rows: RolloutTensors,
    device: torch.device,
    score: Callable[[Scored], torch.Tensor],
    *,
    ref: bool,
    critic: bool,
    score_old: bool = False,
) -> Columns:
    """``mask``, ``behaviour``, ``old`` (unless the training forward gives it, see the
    module docstring; ``score_old`` scores it anyway), ``ref``/``kl`` (with ``ref``),
    ``values`` (with ``critic``), ``advantages`` and ``returns``, each ``[B + 1, T]``;
    ``score(model)`` gives that model's ``[B + 1, T]`` log-probs (values for the critic)
    on every rank."""
    cols = {
        "mask": pad_row(rows.mask.to(device)),
        "behaviour": pad_row(rows.behaviour.to(device)),
    }
    if not algo.recompute_old_logprobs:
        cols["old"] = cols["behaviour"]
    elif ref or score_old:
        cols["old"] = score("policy")
    kl = None
    if ref:
        cols["ref"] = score("ref")
        kl = approx_kl(cols["old"], cols["ref"], algo.kl_loss_type) * cols["mask"]
        cols["kl"] = kl
    if critic:
        cols["values"] = score("critic")
    advantages, returns = compute_advantages(
        algo,
        rows.scores_GN.to(device),
        rows.mask.to(device),
        values_BT=cols["values"][:-1] if "values" in cols else None,
        kl_BT=kl[:-1] if kl is not None else None,
        branch_roots=torch.tensor(rows.branch_roots, dtype=torch.long, device=device),
    )
    cols["advantages"] = pad_row(advantages)
    if returns is not None:
        cols["returns"] = pad_row(returns)
    return cols


def update_plan(
    rows: RolloutTensors,
    global_batch_size: int | None,
    epochs: int,
    shuffle_seed: int | None = None,
) -> list[list[int]]:
    """The rows of each optimizer update of a step, in order: ``epochs`` passes over the
    batch's mini-batches of ``global_batch_size // N`` whole groups each (``N`` samples a
    group; the last may hold fewer groups), or over the whole batch as one (``None``).
    With ``shuffle_seed`` each pass takes the groups in a permutation drawn from it (every
    rank draws the same); without, in the batch's order.

    A step is one weight version however many updates it makes: staleness and admission
    count versions, the LR schedule counts updates."""
    groups, n = rows.scores_GN.shape
    if groups == 0:
        return [list(range(rows.num_rows))] * epochs
    per = groups if global_batch_size is None else max(1, global_batch_size // max(n, 1))
    draw = None if shuffle_seed is None else np.random.default_rng(shuffle_seed)
    row_groups = rows.row_groups()  # a group's branches go with it
    plan = []
    for _ in range(epochs):
        order = list(range(groups)) if draw is None else draw.permutation(groups).tolist()
        for start in range(0, groups, per):
            chosen = set(order[start : start + per])
            plan.append([r for r, g in enumerate(row_groups) if g in chosen])
    return plan


def old_logprobs(cols: Columns, logprobs: torch.Tensor) -> torch.Tensor:
    """A micro-batch's old log-probs: its ``old`` column, else its training forward's own
    ``logprobs``, detached (the proximal policy is the weights that forward runs at)."""
    return cols["old"] if "old" in cols else logprobs.detach()


def batch_metrics(rows: RolloutTensors, cols: Columns, version: int) -> dict[str, float]:
    """Staleness (``version - token_version`` over loss tokens), reward (and each term of
    dict rewards, ``reward/<name>``), dropped groups, and the mean KL when there is a
    reference model."""
    mask = rows.mask.bool()
    stale = (version - rows.versions)[mask].float()
    # Terms first: a term named "mean" does not hide the trained reward's mean.
    metrics = {f"reward/{name}": value for name, value in rows.reward_terms.items()}
    metrics |= {
        "staleness/mean": float(stale.mean()) if stale.numel() else 0.0,
        "staleness/max": float(stale.max()) if stale.numel() else 0.0,
        "reward/mean": float(rows.scores_GN.mean()),
        "response_len/mean": float(rows.mask.sum(dim=1).mean()),
        "response/truncated": rows.truncated_share,
        "batch/dropped_groups": float(rows.num_dropped_groups),
    }
    if "kl" in cols:
        metrics["kl"] = float(masked_mean(cols["kl"], cols["mask"]))
    return metrics


def step_result(
    version: int, rows: RolloutTensors, metrics: dict[str, float], start: float
) -> StepResult:
    """A finished step's ``StepResult``: ``metrics`` plus ``num_tokens`` (loss tokens),
    ``tokens`` (forwarded, rows with loss tokens), ``tokens_per_s`` and ``time/step``
    (since ``start``, a ``perf_counter`` reading)."""
    active = [i for i in range(rows.num_rows) if bool(rows.mask[i].any())]
    tokens = sum(len(rows.sequences[i]) for i in active)
    elapsed = time.perf_counter() - start
    num_tokens = int(rows.mask.sum())
    metrics = metrics | {
        "num_tokens": float(num_tokens),
        "tokens": float(tokens),
        "tokens_per_s": tokens / max(elapsed, 1e-9),
        "time/step": elapsed,
    }
    return StepResult(version, metrics, num_tokens=num_tokens, num_samples=len(active))


class Tally:
    """Step metrics from micro-batch metrics: shares summed, means weighted by tokens."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weight = 0.0

    def add(self, metrics: dict[str, torch.Tensor], weight: float) -> None:
        """One micro-batch's metrics; ``weight`` is its loss tokens."""
        for key, value in metrics.items():
            share = float(value) if key in SHARES else float(value) * weight
            self.sums[key] = self.sums.get(key, 0.0) + share
        self.weight += weight

    def reduce(
        self, keys: list[str], all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict[str, float]:
        """Totals over ranks of ``keys`` (a rank that ran no loss adds zeros)."""
        values = [self.sums.get(k, 0.0) for k in keys] + [self.weight]
        total = all_reduce_sum(torch.tensor(values, dtype=torch.float64))
        weight = max(float(total[-1]), 1e-12)
        return {
            k: float(total[i]) if k in SHARES else float(total[i]) / weight
            for i, k in enumerate(keys)
        }
