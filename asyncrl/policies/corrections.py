"""Off-policy corrections from behaviour log-probs (the engine's, per sampled token).

In async RL a sample comes from a behaviour policy ``mu`` (possibly several weight
versions, and another numeric stack) while the trainer optimises ``pi_theta``:

- decoupled PPO (AReaL): clip ``pi_theta / pi_prox`` around the *proximal* policy (the
  trainer's weights before the step, recomputed) and weight each token by
  ``w = pi_prox / mu``, dropping tokens whose ``w`` exceeds a cap;
- truncated IS (TIS): the same weight, ``min(w, cap)``;
- masked IS (MIS, ICEPOP-like): tokens (or sequences) with ``w`` outside ``[low, high]``
  are dropped from the loss.

Without any of these, recomputed old log-probs equal the current policy, the ratio is 1
and clipping does nothing for stale samples; ``PolicyConfig`` refuses that in async mode.
"""

from __future__ import annotations

from typing import Literal

import torch

from asyncrl.policies.losses import Metrics, masked_mean

ISLevel = Literal["token", "sequence"]
ISMode = Literal["truncate", "mask"]
# exp() of a summed sequence log-ratio overflows float32 past ~88.
_MAX_LOG_WEIGHT = 80.0


def importance_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "truncate",
    level: str = "token",
    low: float = 0.0,
    high: float = 2.0,
) -> tuple[torch.Tensor, Metrics]:
    """Detached behaviour-to-proximal weights ``w`` for each token; returns ``(w, metrics)``.

    ``log w_t = logp_prox_t - logp_mu_t`` at ``level="token"``; at ``level="sequence"``
    every token of sequence ``i`` gets ``log w_i = sum_t m_it (logp_prox_it - logp_mu_it)``
    (the product of its token ratios).

    - ``mode="truncate"`` (TIS): ``w = clip(w, low, high)``;
    - ``mode="mask"`` (MIS): ``w`` where ``low <= w <= high``, else 0.

    Metrics: ``is_weight`` (mean raw weight), ``is_clipped_frac`` (tokens changed by the
    bound) and ``mismatch_kl`` (mean ``logp_mu - logp_prox``, the train/inference gap).
    """
    m = mask.float()
    log_w = (proximal_logprobs - behaviour_logprobs).detach().float() * m
    if level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(log_w)
    elif level != "token":
        raise ValueError(f"unknown importance-weight level {level!r}; expected token or sequence")
    raw = torch.exp(log_w.clamp(max=_MAX_LOG_WEIGHT))
    inside = (raw >= low) & (raw <= high)
    if mode == "truncate":
        weights = raw.clamp(low, high)
    elif mode == "mask":
        weights = torch.where(inside, raw, 0.0)
    else:
        raise ValueError(f"unknown importance-weight mode {mode!r}; expected truncate or mask")
    metrics = {
        "is_weight": masked_mean(raw, m),
        "is_clipped_frac": masked_mean((~inside).float(), m),
        "mismatch_kl": masked_mean(behaviour_logprobs - proximal_logprobs, m),
    }
    return weights * m, metrics
