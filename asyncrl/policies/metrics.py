"""Evaluation metrics over sampled answers (used by eval and by the trainers' logs)."""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al., 2021).

    ``pass@k = 1 - C(n - c, k) / C(n, k)``, evaluated as the stable product
    ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``; it is 1 when ``n - c < k``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss
