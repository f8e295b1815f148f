"""Policy-gradient, value and SFT losses, and how token losses are reduced to a scalar.

All tensors are ``[B, T]`` over response tokens (right padded) with a float loss mask.
A step is usually cut into micro-batches (and spread over data-parallel ranks); pass a
:class:`LossScale` holding the step's totals so that the micro-batch losses *sum* to the
loss of the whole step, which makes gradient accumulation exact. Without a scale the
denominators come from the tensors given (one micro-batch is the whole step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from asyncrl.policies.config import Aggregation

AGGREGATIONS: tuple[str, ...] = Aggregation.__args__  # type: ignore[attr-defined]
LossKind = Literal["ppo", "gspo", "cispo"]
Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class LossScale:
    """Step-global denominators: totals over every micro-batch and every DP rank.

    ``num_tokens`` is the sum of the loss mask, ``num_seqs`` the number of sequences with
    at least one loss token, ``max_len`` the constant of ``seq-mean-token-sum-norm`` (the
    longest response allowed, as Dr. GRPO prescribes).
    """

    num_tokens: float
    num_seqs: float
    max_len: int

    @classmethod
    def of(cls, mask_BT: torch.Tensor, max_len: int | None = None) -> LossScale:
        """The scale of one batch given whole."""
        mask = mask_BT.float()
        return cls(
            num_tokens=float(mask.sum()),
            num_seqs=float((mask.sum(dim=1) > 0).sum()),
            max_len=int(max_len if max_len is not None else mask.shape[1]),
        )


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    aggregation: str = "token-mean",
    scale: LossScale | None = None,
) -> torch.Tensor:
    """Reduce token losses ``l`` with mask ``m`` to this batch's share of the step loss.

    - ``token-mean``: ``sum(l * m) / N_tok``;
    - ``seq-mean-token-mean``: ``sum_i [sum_t l_it m_it / sum_t m_it] / N_seq``;
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): ``sum(l * m) / (L_max * N_seq)``.

    ``N_tok``, ``N_seq`` and ``L_max`` come from ``scale`` (default: this batch).
    """
    mask = mask_BT.float()
    scale = scale or LossScale.of(mask)
    masked = loss_BT * mask
    if aggregation == "token-mean":
        return masked.sum() / max(scale.num_tokens, 1.0)
    if aggregation == "seq-mean-token-mean":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq.sum() / max(scale.num_seqs, 1.0)
    if aggregation == "seq-mean-token-sum-norm":
        return masked.sum() / (max(scale.max_len, 1) * max(scale.num_seqs, 1.0))
    raise ValueError(
        f"unknown aggregation {aggregation!r}; expected one of {', '.join(AGGREGATIONS)}"
    )


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over masked entries (a detached metric; 0 when nothing is masked in)."""
    mask = mask_BT.float()
    return ((x_BT.detach().float() * mask).sum() / mask.sum().clamp(min=1.0)).detach()


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str = "ppo",
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    weights: torch.Tensor | None = None,
    scale: LossScale | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped surrogate loss; returns ``(loss, metrics)``.

    With ``r_t = exp(logp_t - old_logp_t)``, ``lo = 1 - eps_clip``, ``hi = 1 + eps_clip_high``
    (clip-higher; defaults to ``eps_clip``) and advantage ``A_t``:

    - ``ppo``: ``l_t = max(-A_t r_t, -A_t clip(r_t, lo, hi))``; with dual clip ``c > 1``,
      for ``A_t < 0``: ``l_t = min(l_t, -c A_t)`` (bounds the loss of a huge ratio).
    - ``gspo``: the sequence ratio ``s_i = exp(mean_t(logp - old_logp))`` replaces ``r_t``,
      spread over tokens as ``s_it = sg(s_i) * exp(logp_t - sg(logp_t))`` so that
      ``grad s_it = s_i grad logp_t``; clipping (with the same ``lo``/``hi``, which GSPO sets
      around 3e-4 / 4e-4) keeps or drops whole sequences. Use ``seq-mean-token-mean`` for the
      paper's objective.
    - ``cispo`` (MiniMax-M1): ``l_t = -sg(clip(r_t, lo, hi)) * A_t * logp_t``; the clipped
      weight is a constant, so gradient flows through ``logp_t`` for every token, clipped or
      not.

    ``weights`` (detached; off-policy importance weights) multiply ``l_t``. Metrics:
    ``clip_frac`` (tokens whose clipped term was chosen), ``dual_clip_frac``, ``ratio``,
    ``ppo_kl`` (mean ``old_logp - logp``).
    """
    hi = eps_clip if eps_clip_high is None else eps_clip_high
    log_ratio = logprobs - old_logprobs
    if kind == "gspo":
        loss_BT, clipped = _gspo_terms(logprobs, log_ratio, advantages, mask, eps_clip, hi)
        ratio = torch.exp(log_ratio.detach())
    elif kind == "cispo":
        ratio = torch.exp(log_ratio.detach())
        bounded = ratio.clamp(1.0 - eps_clip, 1.0 + hi)
        loss_BT = -bounded * advantages * logprobs
        clipped = (bounded != ratio).float()
    elif kind == "ppo":
        ratio = torch.exp(log_ratio)
        loss_BT, clipped = _ppo_terms(ratio, advantages, eps_clip, hi)
    else:
        raise ValueError(f"unknown policy loss {kind!r}; expected ppo, gspo or cispo")
    metrics: Metrics = {}
    if dual_clip is not None:
        loss_BT, metrics["dual_clip_frac"] = _dual_clip(loss_BT, advantages, dual_clip, mask)
    if weights is not None:
        loss_BT = loss_BT * weights.detach()
    metrics |= {
        "clip_frac": masked_mean(clipped, mask),
        "ratio": masked_mean(ratio, mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }
    return aggregate(loss_BT, mask, aggregation, scale), metrics


def _ppo_terms(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_clip: float, hi: float
) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + hi)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def _gspo_terms(
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    hi: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    m = mask.float()
    seq_log_ratio = (log_ratio * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(
        min=1.0
    )
    token_ratio = torch.exp(seq_log_ratio.detach() + logprobs - logprobs.detach())
    return _ppo_terms(token_ratio, advantages, eps_clip, hi)


def _dual_clip(
    loss_BT: torch.Tensor, advantages: torch.Tensor, c: float, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if c <= 1.0:
        raise ValueError(f"dual clip constant must be > 1, got {c}")
    cap = -c * advantages
    capped = (advantages < 0) & (loss_BT > cap)
    return torch.where(capped, cap, loss_BT), masked_mean(capped.float(), mask)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.2,
    aggregation: str = "token-mean",
    scale: LossScale | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped value loss of PPO's critic.

    ``v_clip = old_v + clip(v - old_v, -c, c)``;
    ``l_t = 0.5 * max((v - R)^2, (v_clip - R)^2)`` (no clipping when ``clip`` is None).
    Metric ``value_clip_frac``: tokens where the clipped error was larger.
    """
    err = (values - returns).square()
    if clip is None:
        loss_BT, clipped = 0.5 * err, torch.zeros_like(err)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (v_clip - returns).square()
        loss_BT, clipped = 0.5 * torch.maximum(err, err_clip), (err_clip > err).float()
    metrics = {"value_clip_frac": masked_mean(clipped, mask), "values": masked_mean(values, mask)}
    return aggregate(loss_BT, mask, aggregation, scale), metrics


def sft_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: str = "token-mean",
    scale: LossScale | None = None,
) -> torch.Tensor:
    """Negative log-likelihood of the masked tokens: ``aggregate(-logp, mask)``."""
    return aggregate(-logprobs, mask, aggregation, scale)
