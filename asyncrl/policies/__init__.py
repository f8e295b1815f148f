"""RL algorithms as pure torch functions: estimators, surrogate losses, KL, corrections.

Every function's docstring states its formula. Trainers call ``compute_advantages`` once
per step and ``rl_loss`` per micro-batch, both driven by a ``PolicyConfig``; the building
blocks are exported for users who write their own objective. Names resolve lazily (PEP
562): the config tree imports ``PolicyConfig`` without torch, so ``asyncrl --help`` stays
fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "advantages": (
        "discounted_returns",
        "gae",
        "group_advantages",
        "last_token_rewards",
        "masked_whiten",
    ),
    "config": ("PolicyConfig",),
    "corrections": ("importance_weights",),
    "kl": ("approx_kl",),
    "losses": (
        "LossScale",
        "aggregate",
        "masked_mean",
        "policy_loss",
        "sft_loss",
        "value_loss",
    ),
    "metrics": ("pass_at_k",),
    "objective": ("LossInputs", "compute_advantages", "rl_loss"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [
    "LossInputs",
    "LossScale",
    "PolicyConfig",
    "aggregate",
    "approx_kl",
    "compute_advantages",
    "discounted_returns",
    "gae",
    "group_advantages",
    "importance_weights",
    "last_token_rewards",
    "masked_mean",
    "masked_whiten",
    "pass_at_k",
    "policy_loss",
    "rl_loss",
    "sft_loss",
    "value_loss",
]

if TYPE_CHECKING:
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
    from asyncrl.policies.losses import (
        LossScale,
        aggregate,
        masked_mean,
        policy_loss,
        sft_loss,
        value_loss,
    )
    from asyncrl.policies.metrics import pass_at_k
    from asyncrl.policies.objective import LossInputs, compute_advantages, rl_loss


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncrl.policies' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"asyncrl.policies.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
