"""A TP rank's vocab slice (``VocabShard``) and the SFT loss from vocab-sharded logits.

Rank ``t`` of ``T`` holds the logits of vocab slice ``[t*V/T, (t+1)*V/T)``. Rather than
gather ``[N, V]`` on every rank, each quantity is built from per-rank partial sums joined
by ``reduce`` (all-reduce forward, identity backward). That backward is exact only when
each partial sum depends on its own rank's logits alone and everything after the join is
computed alike on every rank, so no joined value may feed back into a partial sum
(``p_v = exp(z_v - log Z)`` summed per rank would get only its rank's share of
``dL/d log Z``). With ``m = max_v z_v`` (joined by MAX, no gradient) and
``e_v = exp(z_v - m)``::

    S       = sum_v e_v                                 log Z = m + log S
    log p_y = z_y - log Z                               (z_y from the rank that owns y)
    H       = log Z - (sum_v e_v z_v) / S               (= log Z - sum_v p_v z_v)
    mean_v log p_v = (sum_v z_v) / V - log Z            (label smoothing's uniform term)

With ``T = 1`` every join is the identity and ``smoothed_logprobs`` equals
``packing.smoothed_logprobs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Join = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class VocabShard:
    """This rank's vocab slice ``[start, start + size)`` of ``vocab`` and the joins
    over the TP group (``reduce``: differentiable sum; ``reduce_max``: max, in place)."""

    start: int
    size: int
    vocab: int
    reduce: Join
    reduce_max: Join

    @classmethod
    def whole(cls, vocab: int) -> VocabShard:
        """No tensor parallelism: the whole vocabulary, identity joins."""
        return cls(0, vocab, vocab, lambda x: x, lambda x: x)

    @classmethod
    def megatron(cls, vocab: int) -> VocabShard:
        """This rank's slice of megatron's TP group (vocab divisible by the TP size)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        size, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        if size == 1:
            return cls.whole(vocab)
        group = ps.get_tensor_model_parallel_group()

        def reduce_max(x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
            return x

        part = vocab // size
        return cls(rank * part, part, vocab, reduce_from_tensor_model_parallel_region, reduce_max)


def _exp_sums(z: torch.Tensor, shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, e)``: the row maxima and ``e_v = exp(z_v - m)`` of this rank's slice."""
    m = shard.reduce_max(z.detach().max(dim=-1).values.clone())
    return m, torch.exp(z - m[:, None])


def _log_z(z: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    m, e = _exp_sums(z, shard)
    return m + torch.log(shard.reduce(e.sum(dim=-1)))


def _target_logit(z: torch.Tensor, targets: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    local = targets - shard.start
    owned = (local >= 0) & (local < shard.size)
    picked = z.gather(-1, local.clamp(0, shard.size - 1)[:, None]).squeeze(-1)
    return shard.reduce(torch.where(owned, picked, torch.zeros_like(picked)))


def smoothed_logprobs(
    logits_NV: torch.Tensor, targets_N: torch.Tensor, eps: float, shard: VocabShard
) -> torch.Tensor:
    """``(1 - eps) * log p_y + eps * mean_v log p_v`` (minus the smoothed cross-entropy)."""
    z = logits_NV.float()
    log_z = _log_z(z, shard)
    picked = _target_logit(z, targets_N, shard) - log_z
    if eps == 0.0:
        return picked
    mean_logp = shard.reduce(z.sum(dim=-1)) / shard.vocab - log_z
    return (1.0 - eps) * picked + eps * mean_logp
