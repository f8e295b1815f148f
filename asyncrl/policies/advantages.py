"""Advantage estimators: group baselines, GAE and discounted returns.

Pure torch functions called by the trainers (through ``objective.compute_advantages``) and
usable on their own. Shape suffixes: ``G`` groups, ``N`` samples per group, ``B`` sequences,
``T`` response tokens (right padded; ``mask_BT`` is 1 on tokens that count).
"""

from __future__ import annotations

from typing import Literal

import torch

GroupEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "gspo", "cispo"]
GROUP_ESTIMATORS: tuple[str, ...] = GroupEstimator.__args__  # type: ignore[attr-defined]


def group_advantages(
    rewards_GN: torch.Tensor, estimator: str, *, eps: float = 1e-6
) -> torch.Tensor:
    """One advantage per sample from its group's rewards, ``[G, N] -> [G, N]``.

    With ``mu`` the group mean and ``sigma`` the group standard deviation (Bessel-corrected,
    as ``torch.std``):

    - ``grpo``, ``gspo``, ``cispo``: ``A_i = (r_i - mu) / (sigma + eps)``; a group of one
      sample has no spread, so its advantage is ``r_i - mu = 0``.
    - ``dr_grpo`` (Dr. GRPO): ``A_i = r_i - mu``, no division by ``sigma``.
    - ``rloo``: leave-one-out baseline, ``A_i = r_i - (sum_j r_j - r_i) / (N - 1)
      = N / (N - 1) * (r_i - mu)``; needs ``N >= 2``.
    - ``reinforce_pp_baseline`` (REINFORCE++-baseline): ``A_i = r_i - mu``, then whitened
      over the whole batch, ``(A - mean(A)) / (std(A) + eps)``.

    Token-level estimators (``ppo``, ``reinforce_pp``) use :func:`gae` and
    :func:`discounted_returns` instead.
    """
    if rewards_GN.dim() != 2:
        raise ValueError(
            f"rewards must be shaped [groups, group_size], got {list(rewards_GN.shape)}"
        )
    rewards_GN = rewards_GN.float()
    n = rewards_GN.shape[1]
    centred = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    if estimator in ("grpo", "gspo", "cispo"):
        if n == 1:
            return centred
        return centred / (rewards_GN.std(dim=1, keepdim=True) + eps)
    if estimator == "dr_grpo":
        return centred
    if estimator == "rloo":
        if n < 2:
            raise ValueError("rloo needs at least 2 samples per prompt (--n-samples-per-prompt)")
        return centred * (n / (n - 1))
    if estimator == "reinforce_pp_baseline":
        flat = centred.flatten()
        spread = flat.std() if flat.numel() > 1 else flat.new_tensor(0.0)
        return (centred - flat.mean()) / (spread + eps)
    raise ValueError(
        f"unknown group estimator {estimator!r}; expected one of {', '.join(GROUP_ESTIMATORS)} "
        "(ppo and reinforce_pp are token-level: use gae or discounted_returns)"
    )


def gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the masked tokens; returns ``(A, R)``.

    Walking back over the tokens where ``mask = 1`` (masked tokens, such as tool output or
    padding, are skipped: they carry neither reward nor value and the recursion passes
    through them)::

        delta_t = r_t + gamma * V_next - V_t        (V_next = 0 after the last token)
        A_t     = delta_t + gamma * lam * A_next
        R_t     = A_t + V_t

    Both outputs are 0 on masked tokens.
    """
    mask = mask_BT.bool()
    advantages = torch.zeros_like(values_BT, dtype=torch.float32)
    next_value = values_BT.new_zeros(values_BT.shape[0], dtype=torch.float32)
    next_adv = torch.zeros_like(next_value)
    for t in range(values_BT.shape[1] - 1, -1, -1):
        v_t, m_t = values_BT[:, t].float(), mask[:, t]
        delta = rewards_BT[:, t].float() + gamma * next_value - v_t
        adv_t = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(m_t, adv_t, 0.0)
        next_value = torch.where(m_t, v_t, next_value)
        next_adv = torch.where(m_t, adv_t, next_adv)
    returns = (advantages + values_BT.float()) * mask
    return advantages, returns


def discounted_returns(
    rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Discounted return-to-go over the masked tokens (REINFORCE++).

    ``G_t = r_t + gamma * G_next`` walking back over tokens with ``mask = 1``; masked tokens
    are skipped (they get 0 and pass ``G_next`` through).
    """
    mask = mask_BT.bool()
    returns = torch.zeros_like(rewards_BT, dtype=torch.float32)
    running = rewards_BT.new_zeros(rewards_BT.shape[0], dtype=torch.float32)
    for t in range(rewards_BT.shape[1] - 1, -1, -1):
        value = rewards_BT[:, t].float() + gamma * running
        returns[:, t] = torch.where(mask[:, t], value, 0.0)
        running = torch.where(mask[:, t], value, running)
    return returns


def masked_whiten(x_BT: torch.Tensor, mask_BT: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and (biased) variance over masked entries.

    Masked-out entries come back as 0.
    """
    mask = mask_BT.float()
    count = mask.sum().clamp(min=1.0)
    mean = (x_BT * mask).sum() / count
    var = (((x_BT - mean) * mask) ** 2).sum() / count
    return (x_BT - mean) * torch.rsqrt(var + eps) * mask


def last_token_rewards(scores_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar score on its last masked token, ``[B] -> [B, T]``.

    A sequence with no masked token gets no reward anywhere.
    """
    mask = mask_BT.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).max(dim=1).values
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has_token = last >= 0
    rows = torch.nonzero(has_token).squeeze(1)
    rewards[rows, last[has_token]] = scores_B[has_token].float()
    return rewards
