"""Per-token log-probs and entropy of the sampling distribution, in bounded memory.

A sample's tokens were drawn from ``softmax(z / T)``, ``T`` its temperature. For each
predicted position with logits ``z`` (``[V]``, possibly a TP rank's slice of them) and
inverse temperature ``s = 1 / T``::

    u       = s * z
    log Z   = logsumexp_v u_v                          (joined over TP ranks)
    log p_y = u_y - log Z
    H       = log Z - sum_v p_v u_v                    (entropy of softmax(u))

and the gradients the backward pass writes, per logit::

    d log p_y / d z_v = s * ([v = y] - p_v)
    d H / d z_v       = -s * p_v * (u_v - sum_w p_w u_w)

Positions go in chunks of about ``CHUNK_ELEMENTS`` logits: forward keeps only ``log Z`` and
``sum p u`` per position, backward recomputes each chunk's softmax, so no fp32 ``[N, V]``
tensor exists beyond one chunk. Under TP the joins are all-reduces taken in forward only
(``vocab_parallel.py`` says why).
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.trainers.vocab_parallel import VocabShard

#: fp32 logits a chunk holds (64 MiB): with V = 49,152 that is 341 positions.
CHUNK_ELEMENTS = 1 << 24


def token_stats(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    inv_temperature_N: torch.Tensor | None = None,
    shard: VocabShard | None = None,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p_y, H)``, each fp32 ``[N]``, of ``softmax(z / T)`` (module docstring).

    ``inv_temperature_N`` is ``1 / T`` per position (None: 1); ``shard`` is this rank's
    vocab slice (None: the whole vocabulary). Both outputs are differentiable in the
    logits; an unused one costs a few elementwise passes, never memory.
    """
    shard = shard or VocabShard.whole(logits_NV.shape[-1])
    if inv_temperature_N is None:
        inv_temperature_N = torch.ones(logits_NV.shape[0], device=logits_NV.device)
    rows = max(1, chunk_elements // max(1, logits_NV.shape[-1]))
    return _TokenStats.apply(logits_NV, targets_N, inv_temperature_N.float(), shard, rows)


def token_logprobs(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    inv_temperature_N: torch.Tensor | None = None,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """``log p_y`` of ``softmax(z / T)``, fp32 ``[N]``."""
    return token_stats(logits_NV, targets_N, inv_temperature_N, shard)[0]


def _scaled(z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``u = s * z`` in fp32, in one pass (the multiply promotes bf16 logits itself)."""
    return torch.mul(z, s[:, None], out=torch.empty(z.shape, device=z.device))


def _chunk_forward(
    z: torch.Tensor, targets: torch.Tensor, s: torch.Tensor, shard: VocabShard
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log p_y, log Z, sum p u)`` of one chunk of positions (joined over the shard).

    Works on ``u - m`` in place (``m`` the row max): ``sum p u = m + sum p (u - m)``, and
    the sum of ``e * (u - m)`` is a batched dot product, with no ``[n, V]`` product kept.
    A 49k vocabulary makes each pass over the chunk cost as much as a small matmul."""
    shifted = _scaled(z, s)
    m = shard.reduce_max(shifted.max(dim=-1).values.clone())
    shifted.sub_(m[:, None])
    e = torch.exp(shifted)
    total = shard.reduce(e.sum(dim=-1))
    log_z = m + torch.log(total)
    dot = torch.bmm(e[:, None, :], shifted[:, :, None]).view(-1)
    mean_u = m + shard.reduce(dot) / total
    local = targets - shard.start
    owned = (local >= 0) & (local < shard.size)
    picked = shifted.gather(-1, local.clamp(0, shard.size - 1)[:, None]).squeeze(-1) + m
    u_y = shard.reduce(torch.where(owned, picked, torch.zeros_like(picked)))
    return u_y - log_z, log_z, mean_u


class _TokenStats(torch.autograd.Function):
    """Chunked ``(log p_y, H)`` with a hand-written backward (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        s: torch.Tensor,
        shard: VocabShard,
        rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        logp = torch.empty(n, device=logits.device)
        log_z = torch.empty_like(logp)
        mean_u = torch.empty_like(logp)
        for lo in range(0, n, rows):
            c = slice(lo, lo + rows)
            logp[c], log_z[c], mean_u[c] = _chunk_forward(logits[c], targets[c], s[c], shard)
        ctx.save_for_backward(logits, targets, s, log_z, mean_u)
        ctx.shard, ctx.rows = shard, rows
        ctx.set_materialize_grads(False)  # an output the loss ignores costs no pass
        return logp, log_z - mean_u

    @staticmethod
    def backward(
        ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        logits, targets, s, log_z, mean_u = ctx.saved_tensors
        shard: VocabShard = ctx.shard
        grad = torch.empty_like(logits)
        for lo in range(0, logits.shape[0], ctx.rows):
            c = slice(lo, lo + ctx.rows)
            grad[c] = _chunk_backward(
                logits[c],
                targets[c],
                s[c],
                log_z[c],
                mean_u[c],
                _part(grad_logp, c),
                _part(grad_entropy, c),
                shard,
            )
        return grad, None, None, None, None


def _part(grad: torch.Tensor | None, c: slice) -> torch.Tensor | None:
    return None if grad is None else grad[c]


def _chunk_backward(
    z: torch.Tensor,
    targets: torch.Tensor,
    s: torch.Tensor,
    log_z: torch.Tensor,
    mean_u: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    shard: VocabShard,
) -> torch.Tensor:
    """One chunk's ``d loss / d z`` (module docstring), fp32 ``[n, V]``, with in-place
    passes: ``g = -s p (a + b (u - sum p u))`` plus ``s a`` at the target, where ``a``
    and ``b`` are the upstream gradients of ``log p_y`` and ``H`` (0 when unused)."""
    u = _scaled(z, s)
    if grad_entropy is None:  # the usual case: p overwrites u
        g = u.sub_(log_z[:, None]).exp_()
        g.mul_(-(s * grad_logp)[:, None] if grad_logp is not None else 0.0)
    else:
        p = torch.exp(u - log_z[:, None])
        g = u.sub_(mean_u[:, None]).mul_(grad_entropy[:, None])
        if grad_logp is not None:
            g.add_(grad_logp[:, None])
        g.mul_(p).mul_(-s[:, None])
    if grad_logp is not None:
        local = targets - shard.start
        owned = (local >= 0) & (local < shard.size)
        rows = torch.arange(len(local), device=g.device)[owned]
        g[rows, local[owned]] += (s * grad_logp)[owned]
    return g
