"""The parts of an RL step both backends share: a rank's micro-batches, the mini-batch
order, the policy loss of one micro-batch, and the step's metrics from its updates.
The backends differ in how they run a forward and a backward, not in what they compute."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from asyncrl.policies import LossInputs, LossScale, PolicyConfig, rl_loss
from asyncrl.trainers.config import TrainerConfig
from asyncrl.trainers.packing import (
    MicroBatch,
    build_microbatch,
    plan_ranks,
    prompt_units,
    shares_prompts,
    to_rows,
    unit_tokens,
)
from asyncrl.trainers.rl_columns import EMPTY_SEQUENCE, Columns, old_logprobs
from asyncrl.trainers.rollout_tensors import RolloutTensors


def rank_microbatches(
    rows: RolloutTensors,
    part: Sequence[int] | None,
    *,
    max_tokens: int,
    world: int,
    rank: int,
    equal_counts: bool,
    share_prompts: bool = False,
    **build: Any,
) -> list[MicroBatch]:
    """Rank ``rank``'s token-budget micro-batches of the rows of ``part`` (default all)
    that have loss tokens. Row ``B`` (one past the last) is the empty stand-in: it fills
    a rank with no rows, and with ``equal_counts`` pads every rank to the busiest rank's
    count (gradients sync on the last micro-batch, so all ranks must run as many).
    ``share_prompts``: rows with one prompt are planned and packed together, the prompt
    once (``packing.prompt_units``), where the layout and attention can take it (else
    it is ignored). ``build`` goes to ``build_microbatch``."""
    n = rows.num_rows
    active = [i for i in (range(n) if part is None else part) if bool(rows.mask[i].any())]
    seqs, starts = [*rows.sequences, EMPTY_SEQUENCE], [*rows.prompt_lens, 1]
    layout, attn = build.get("layout", "packed"), build.get("attn_implementation", "sdpa")
    if share_prompts and shares_prompts(layout, attn):
        units = prompt_units(
            seqs, starts, active, _unit_cap(seqs, starts, active, max_tokens, world)
        )
    else:
        units = [[i] for i in active]
    costs = [unit_tokens(seqs, starts, u) for u in units]
    plans = plan_ranks(costs, max_tokens, world)
    mine = [[r for j in b for r in units[j]] for b in plans[rank]]
    count = max(1, *(len(p) for p in plans)) if equal_counts else 1
    mine += [[n]] * (count - len(mine))
    temperatures = [*rows.temperatures, 1.0]
    return [
        build_microbatch(
            seqs,
            starts,
            m,
            rows.width,
            temperatures=temperatures,
            share_prompts=share_prompts,
            **build,
        )
        for m in mine
    ]


def _unit_cap(
    seqs: list[np.ndarray], starts: list[int], active: list[int], max_tokens: int, world: int
) -> int:
    """Where a prompt's rows are cut into units: the token budget, and on ``world`` ranks at
    most a rank's share of the step's tokens, so that one big group still spreads over all
    ranks instead of leaving some with only the empty stand-in."""
    if world == 1:
        return max_tokens
    whole = prompt_units(seqs, starts, active)
    total = sum(unit_tokens(seqs, starts, u) for u in whole)
    return max(1, min(max_tokens, -(-total // world)))


def shuffle_seed(config: TrainerConfig, version: int) -> int | None:
    """A step's mini-batch order: from the seed and the version (a rerun replays it and
    every rank draws the same), or None (``shuffle_minibatches`` off)."""
    if not config.shuffle_minibatches:
        return None
    return config.seed * 1_000_003 + version


def policy_loss(
    algo: PolicyConfig,
    cols: Columns,
    mb: MicroBatch,
    logp_N: torch.Tensor,
    entropy_N: torch.Tensor,
    scale: LossScale,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``rl_loss`` of micro-batch ``mb`` from its training forward's token log-probs and
    entropies (``[N]``, ``token_stats``) and the step's ``[B + 1, T]`` columns."""
    c = {k: v[mb.rows] for k, v in cols.items()}
    logprobs = to_rows(logp_N, mb)
    x = LossInputs(
        logprobs=logprobs,
        old_logprobs=old_logprobs(c, logprobs),
        behaviour_logprobs=c["behaviour"],
        advantages=c["advantages"],
        mask=c["mask"],
        # A metric only (no gradient) unless there is an entropy bonus.
        entropy=to_rows(entropy_N if algo.entropy_coef > 0 else entropy_N.detach(), mb),
        ref_logprobs=c.get("ref"),
    )
    loss, metrics = rl_loss(algo, x, scale)
    metrics["loss"] = loss.detach()
    return loss, metrics


def mean_of_updates(updates: Sequence[dict[str, float]]) -> dict[str, float]:
    """A step's metrics: the mean over its optimizer updates of each metric."""
    return {k: float(np.mean([u[k] for u in updates])) for k in updates[0]}
