"""Per-token estimators of KL(pi || pi_ref) from sampled tokens' log-probs.

Used as a loss term (``--use-kl-loss``) and as reward shaping (``--kl-coef``). Schulman's
estimators (http://joschu.net/blog/kl-approx.html), with ``d = log pi(y) - log pi_ref(y)``
for a token ``y`` sampled from ``pi``.
"""

from __future__ import annotations

import torch

from asyncrl.policies.config import KLKind

KL_KINDS: tuple[str, ...] = KLKind.__args__  # type: ignore[attr-defined]

# low_var_kl clamps like verl and slime: exp() of a large |d| would dominate the batch.
_LOW_VAR_LOG_CLAMP = 20.0
_LOW_VAR_KL_CLAMP = 10.0


def approx_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Elementwise KL estimate; ``d = logprobs - ref_logprobs``.

    - ``k1 = d`` (unbiased, high variance, can be negative);
    - ``k2 = d**2 / 2`` (biased, low variance, >= 0);
    - ``k3 = exp(-d) - 1 + d`` (unbiased, >= 0);
    - ``low_var_kl = clamp(k3, -10, 10)`` with ``d`` first clamped to +-20.
    """
    d = logprobs.float() - ref_logprobs.float()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return torch.expm1(-d) + d
    if kind == "low_var_kl":
        d = d.clamp(-_LOW_VAR_LOG_CLAMP, _LOW_VAR_LOG_CLAMP)
        return (torch.expm1(-d) + d).clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)
    raise ValueError(f"unknown KL kind {kind!r}; expected one of {', '.join(KL_KINDS)}")
