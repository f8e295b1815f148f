"""Attention for packed rows without an ``L x L`` mask: each sequence attends on its own.

A packed micro-batch puts ``k`` sequences in one row of ``L = sum(len_i)`` tokens. With
sdpa and a block-diagonal boolean mask, every layer computes (and, for backward, keeps)
all ``L x L`` scores, of which only ``sum(len_i^2) / 2`` are wanted; with 4,096 tokens,
9 heads and 30 layers that is 18 GB of fp32 scores on SmolLM2-135M. This attention
function takes the sequence lengths instead (``packed_segments``, passed to the model's
forward as a keyword that transformers hands down to every attention call) and runs
``scaled_dot_product_attention(..., is_causal=True)`` per sequence, which lets torch pick
its fused kernels (flash on CPU and GPU) with O(len) memory.

Registered with transformers as ``ATTENTION`` (``"asyncrl_packed"``) with sdpa's mask
function, so the mask transformers builds is sdpa's (one boolean mask per forward, not
scores per layer). Without ``packed_segments`` (a padded batch, generation) it is sdpa with
that mask, so a model loaded with it works anywhere; lengths that do not add up to the
row are an error, never a silent attention across sequences.
Used by ``TorchTrainer`` for packed micro-batches unless ``trainer.attn_implementation``
names another; ``packing.build_microbatch`` gives the lengths.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.sdpa_kernels import varying_shapes

ATTENTION = "asyncrl_packed"


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_segments: tuple[int, ...] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each of ``packed_segments`` (lengths along the one row).

    ``query`` is ``[1, H, L, D]``, ``key``/``value`` ``[1, H_kv, L, D]``; returns
    ``[1, L, H, D]`` as transformers' attention functions do.
    """
    if packed_segments is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1 or query.shape[2] != sum(packed_segments):
        raise ValueError(
            f"packed_segments {list(packed_segments)} (sum {sum(packed_segments)}) do not "
            f"cover the packed row of shape {tuple(query.shape)}"
        )
    dtype, fp32 = value.dtype, _in_fp32(query, key, value)
    if fp32:
        query, key, value = query.float(), key.float(), value.float()
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each KV head serves ``groups`` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    p = dropout if module.training else 0.0
    # One split per tensor, not a slice per sequence: a slice's backward writes its
    # gradient into a zeroed tensor of the whole row, so k sequences cost k full-row fills
    # and adds per layer (128 sequences of 16 tokens: 20 of a step's 40 s of CPU and
    # 20 GB); the split's backward is one concatenation.
    pieces = zip(*(x.split(list(packed_segments), dim=2) for x in (query, key, value)), strict=True)
    # Under autocast sdpa would cast fp32 inputs back to bf16. Every sequence has its own
    # length: no cuDNN (a plan built per shape, sdpa_kernels.py).
    autocast = torch.autocast(query.device.type, enabled=False) if fp32 else nullcontext()
    with autocast, varying_shapes(query.device):
        outs = [
            F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scaling)
            for q, k, v in pieces
        ]
    return torch.cat(outs, dim=2).to(dtype).transpose(1, 2).contiguous(), None


def _in_fp32(*qkv: torch.Tensor) -> bool:
    """bf16 on the CPU: attend in fp32. torch's CPU flash kernel ran forward and backward
    of a 1,024-token micro-batch of SmolLM2 (7 sequences, 30 layers) in 665 ms in bf16 and
    468 ms with the inputs cast to fp32 (casts included); the scores are then also exact
    to fp32. Under bf16 autocast the rotary embedding has already promoted the queries
    and keys to fp32, and only the values are bf16. On CUDA bf16 is the fast path."""
    return qkv[0].device.type == "cpu" and any(x.dtype == torch.bfloat16 for x in qkv)


def register() -> str:
    """Register ``ATTENTION`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION
