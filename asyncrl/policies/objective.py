"""The RL objective as the trainers call it: advantages for a batch, loss for a micro-batch.

``compute_advantages`` runs once per step on the whole batch (group baselines need whole
groups); ``rl_loss`` runs per micro-batch and returns that micro-batch's share of the step
loss (see ``losses.LossScale``). Both follow a ``PolicyConfig``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.plugins import PluginError, load_object
from asyncrl.policies.advantages import (
    discounted_returns,
    gae,
    group_advantages,
    last_token_rewards,
    masked_whiten,
)
from asyncrl.policies.config import PolicyConfig
from asyncrl.policies.corrections import importance_weights
from asyncrl.policies.kl import approx_kl
from asyncrl.policies.losses import LossScale, Metrics, aggregate, masked_mean, policy_loss


@dataclass(slots=True)
class LossInputs:
    """One micro-batch, every tensor ``[b, T]`` over response tokens, right padded.

    ``old_logprobs`` is the proximal policy (recomputed before the step) or the behaviour
    policy (``use_rollout_logprobs``); ``behaviour_logprobs`` are the engine's.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


def compute_advantages(
    cfg: PolicyConfig,
    scores_GN: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    values_BT: torch.Tensor | None = None,
    kl_BT: torch.Tensor | None = None,
    branch_roots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token advantages ``[B, T]`` (and returns for the critic) for ``G * N`` samples and,
    with ``branch_roots``, their branches: rows ``G * N + j`` whose sample is row
    ``branch_roots[j]``. A branch is part of its sample's trajectory: it takes the
    sample's advantage, and its tokens' KL counts in the sample's (sequence-level
    estimators only: a per-token return has no value for a branch).

    KL reward shaping with ``k = kl_coef`` and per-token ``kl_t`` (from the reference model):

    - group estimators: the score becomes ``r_i - k * sum_t m_t kl_t`` before the group
      baseline, and the sample's advantage is spread over its tokens; except
      ``reinforce_pp_baseline``, which follows REINFORCE++: ``A_t = A_i - k * kl_t``;
    - ``reinforce_pp``: token rewards ``-k * kl_t`` plus the score on the last token, then
      discounted returns (``gamma``), whitened;
    - ``ppo``: the same token rewards, then GAE over the critic's values.

    With ``normalize_advantages`` the result is whitened over the batch's loss tokens.
    Returns are given for ``ppo`` (the critic's target), else None.

    ``custom_advantage_path`` names ``fn(scores_GN, mask_BT, kl_BT)`` that replaces all of
    the above: it returns ``[G, N]`` (a sample's advantage, spread over its loss tokens
    and its branches') or ``[B, T]`` (per token, masked after; every row, branches too);
    ``kl_BT`` is the per-token KL against the reference model, or None without one.
    ``normalize_advantages`` still applies.
    """
    roots = branch_roots if branch_roots is not None and len(branch_roots) else None
    if cfg.custom_advantage_path:
        return _custom_advantages(cfg, scores_GN, mask_BT, kl_BT, roots), None
    mask = mask_BT.float()
    shaping = cfg.kl_coef > 0
    if shaping and kl_BT is None:
        raise ValueError("kl_coef > 0 needs per-token KL against the reference model (kl_BT)")
    kl = (kl_BT.float() * mask) if shaping and kl_BT is not None else torch.zeros_like(mask)
    scores = scores_GN.float()
    returns = None
    estimator = cfg.advantage_estimator
    if estimator in ("reinforce_pp", "ppo") and roots is not None:
        raise ValueError(
            f"the {estimator} estimator's per-token returns give a branch of a trajectory no "
            "value: a branching workflow needs a sequence-level estimator (grpo, dr_grpo, "
            "rloo, reinforce_pp_baseline, gspo, cispo)"
        )
    if estimator in ("reinforce_pp", "ppo"):
        rewards = last_token_rewards(scores.flatten(), mask) - cfg.kl_coef * kl
        if estimator == "ppo":
            if values_BT is None:
                raise ValueError("the ppo estimator needs the critic's values (values_BT)")
            advantages, returns = gae(rewards, values_BT, mask, cfg.gamma, cfg.lambd)
        else:
            advantages = discounted_returns(rewards, mask, cfg.gamma)
    elif estimator == "reinforce_pp_baseline":
        per_sample = with_branches(group_advantages(scores, estimator).flatten(), roots)
        advantages = (per_sample.reshape(-1, 1) - cfg.kl_coef * kl) * mask
    else:
        seq_kl = trajectory_sums(kl.sum(dim=1), roots).reshape(scores.shape)
        per_sample = group_advantages(scores - cfg.kl_coef * seq_kl, estimator).flatten()
        advantages = with_branches(per_sample, roots).reshape(-1, 1) * mask
    if cfg.normalize_advantages:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def rl_loss(cfg: PolicyConfig, x: LossInputs, scale: LossScale) -> tuple[torch.Tensor, Metrics]:
    """This micro-batch's share of the step loss and its metrics.

    ``loss = PG(w) + c_kl * agg(KL(pi||ref)) - c_ent * agg(H)``: ``PG`` the surrogate of
    ``cfg.loss_kind`` against ``old_logprobs``, ``w`` the configured correction's importance
    weights (``_correction``), ``agg`` the configured aggregation under the step's ``scale``.

    ``custom_loss_path`` names ``fn(x, weights, scale) -> (loss, metrics)`` that replaces
    ``PG`` (``weights``: ``[b, T]``, or None without a correction). Its loss must be this
    micro-batch's share of the step's (``losses.aggregate`` makes one), so micro-batches
    and ranks sum to the whole batch's loss; its metrics are tensors.
    """
    weights, metrics = _correction(cfg, x)
    if cfg.custom_loss_path:
        loss, pg_metrics = _custom_loss(cfg, x, weights, scale)
    else:
        loss, pg_metrics = policy_loss(
            x.logprobs,
            x.old_logprobs,
            x.advantages,
            x.mask,
            kind=cfg.loss_kind,
            eps_clip=cfg.eps_clip,
            eps_clip_high=cfg.eps_clip_high,
            dual_clip=cfg.eps_clip_c,
            aggregation=cfg.loss_aggregation,
            weights=weights,
            scale=scale,
        )
    metrics |= pg_metrics
    metrics["pg_loss"] = loss.detach()
    if cfg.use_kl_loss:
        if x.ref_logprobs is None:
            raise ValueError("use_kl_loss needs reference log-probs (ref_logprobs)")
        kl = approx_kl(x.logprobs, x.ref_logprobs, cfg.kl_loss_type)
        kl_term = aggregate(kl, x.mask, cfg.loss_aggregation, scale)
        loss = loss + cfg.kl_loss_coef * kl_term
        metrics["kl_loss"] = kl_term.detach()
    if x.entropy is not None:
        metrics["entropy"] = masked_mean(x.entropy, x.mask)
        if cfg.entropy_coef > 0:
            entropy_term = aggregate(x.entropy, x.mask, cfg.loss_aggregation, scale)
            loss = loss - cfg.entropy_coef * entropy_term
    elif cfg.entropy_coef > 0:
        raise ValueError("entropy_coef > 0 needs the per-token entropy (LossInputs.entropy)")
    return loss, metrics


def _correction(cfg: PolicyConfig, x: LossInputs) -> tuple[torch.Tensor | None, Metrics]:
    """Importance weights of the configured correction (None when there is none):
    decoupled PPO (AReaL) ``w = pi_prox / mu``, tokens with ``w > is_high`` dropped; TIS
    ``clip(w, is_low, is_high)``; MIS: ``w`` outside ``[is_low, is_high]`` drops the token
    or sequence (``is_level``)."""
    if cfg.off_policy_correction == "none":
        return None, {"mismatch_kl": masked_mean(x.behaviour_logprobs - x.old_logprobs, x.mask)}
    kind = cfg.off_policy_correction
    return importance_weights(
        x.old_logprobs,
        x.behaviour_logprobs,
        x.mask,
        mode="truncate" if kind == "tis" else "mask",
        level=cfg.is_level,
        low=0.0 if kind == "decoupled" else cfg.is_low,
        high=cfg.is_high,
    )


@functools.cache
def _hook(path: str, what: str) -> Callable[..., Any]:
    fn = load_object(path, what=what)
    if not callable(fn):
        raise PluginError(f"{what} path {path!r} names a {type(fn).__name__}, not a function")
    return fn


def load_hooks(cfg: PolicyConfig) -> None:
    """Import the custom advantage and loss functions ``cfg`` names (``PluginError`` if
    one does not load): the preflight's check, and the trainers' before a first step."""
    if cfg.custom_advantage_path:
        _hook(cfg.custom_advantage_path, "custom advantage")
    if cfg.custom_loss_path:
        _hook(cfg.custom_loss_path, "custom loss")


def with_branches(per_sample: torch.Tensor, roots: torch.Tensor | None) -> torch.Tensor:
    """``[G * N]`` per-sample values, then each branch's sample's: ``[B]``."""
    return per_sample if roots is None else torch.cat([per_sample, per_sample[roots]])


def trajectory_sums(per_row: torch.Tensor, roots: torch.Tensor | None) -> torch.Tensor:
    """``[B]`` per-row values summed into their samples' rows: ``[G * N]``."""
    if roots is None:
        return per_row
    n = len(per_row) - len(roots)
    return per_row[:n].index_add(0, roots.to(per_row.device), per_row[n:])


def _custom_advantages(
    cfg: PolicyConfig,
    scores_GN: torch.Tensor,
    mask_BT: torch.Tensor,
    kl_BT: torch.Tensor | None,
    roots: torch.Tensor | None = None,
) -> torch.Tensor:
    assert cfg.custom_advantage_path is not None
    fn = _hook(cfg.custom_advantage_path, "custom advantage")
    mask = mask_BT.float()
    out = torch.as_tensor(fn(scores_GN.float(), mask, kl_BT), dtype=torch.float32)
    out = out.to(mask.device)
    if out.shape == scores_GN.shape:  # per sample: a branch takes its sample's
        out = with_branches(out.flatten(), roots).reshape(-1, 1) * mask
    elif out.shape == mask.shape:
        out = out * mask
    else:
        raise ValueError(
            f"custom advantage {cfg.custom_advantage_path} returned shape {tuple(out.shape)}; "
            f"expected [G, N] {tuple(scores_GN.shape)} or [B, T] {tuple(mask.shape)}"
        )
    if not torch.isfinite(out).all():
        raise ValueError(f"custom advantage {cfg.custom_advantage_path} returned inf or NaN")
    return masked_whiten(out, mask) if cfg.normalize_advantages else out


def _custom_loss(
    cfg: PolicyConfig, x: LossInputs, weights: torch.Tensor | None, scale: LossScale
) -> tuple[torch.Tensor, Metrics]:
    assert cfg.custom_loss_path is not None
    loss, metrics = _hook(cfg.custom_loss_path, "custom loss")(x, weights, scale)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"custom loss {cfg.custom_loss_path} must return a scalar tensor loss")
    return loss, dict(metrics)
