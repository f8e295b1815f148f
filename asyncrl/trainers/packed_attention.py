"""Attention for packed rows without an ``L x L`` mask: each sequence attends on its own.

A packed row of ``L = sum(len_i)`` tokens with a block-diagonal mask computes and keeps all
``L x L`` scores per layer. This function takes the lengths instead (``packed_segments``,
a forward keyword transformers hands to every attention call) and runs causal sdpa per
sequence, with O(len) memory. A segment may also be a prompt shared by several responses
(``packing.Segment``): each response attends to the prompt and itself. Registered as
``ATTENTION`` with sdpa's mask function, so without ``packed_segments`` (a padded batch,
generation) it is plain sdpa; inside ``packed_rows()`` no mask is built, as none is read
(transformers would build an ``L x L`` one from the packed positions: 256 MB at 16k tokens).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from asyncrl.errors import InputError
from asyncrl.sdpa_kernels import varying_shapes

ATTENTION = "asyncrl_packed"

_PACKED_ROWS: ContextVar[bool] = ContextVar("asyncrl_packed_rows", default=False)


@contextmanager
def packed_rows() -> Iterator[None]:
    """A forward of packed rows given their ``packed_segments``: the mask is skipped."""
    token = _PACKED_ROWS.set(True)
    try:
        yield
    finally:
        _PACKED_ROWS.reset(token)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_segments: tuple[int | tuple[int, ...], ...] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each of ``packed_segments`` (units along the one row: a
    sequence's length, or a shared prompt's ``(P, r_1, ..., r_k)``, see ``_attend``).

    ``query`` is ``[1, H, L, D]``, ``key``/``value`` ``[1, H_kv, L, D]``; returns
    ``[1, L, H, D]`` as transformers' attention functions do. Raises ``ValueError`` when
    the lengths do not cover the row (never a silent attention across sequences).
    """
    if packed_segments is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    sizes = [s if isinstance(s, int) else sum(s) for s in packed_segments]
    if query.shape[0] != 1 or query.shape[2] != sum(sizes):
        raise ValueError(
            f"packed_segments {list(packed_segments)} (sum {sum(sizes)}) do not "
            f"cover the packed row of shape {tuple(query.shape)}"
        )
    _within_window(packed_segments, kwargs.get("sliding_window"))
    dtype, fp32 = value.dtype, _in_fp32(query, key, value)
    if fp32:
        query, key, value = query.float(), key.float(), value.float()
    elif any(isinstance(s, tuple) for s in packed_segments):
        query, key, value = _one_dtype(query, key, value)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each KV head serves ``groups`` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    p = dropout if module.training else 0.0
    # One split per tensor, not a slice per sequence: a slice's backward writes its
    # gradient into a zeroed tensor of the whole row, so k sequences cost k full-row fills
    # and adds per layer; the split's backward is one concatenation.
    pieces = zip(*(x.split(sizes, dim=2) for x in (query, key, value)), strict=True)
    # Under autocast sdpa would cast fp32 inputs back to bf16. Every sequence has its own
    # length: no cuDNN (a plan built per shape, sdpa_kernels.py).
    autocast = torch.autocast(query.device.type, enabled=False) if fp32 else nullcontext()
    with autocast, varying_shapes(query.device):
        outs = [
            out
            for (q, k, v), seg in zip(pieces, packed_segments, strict=True)
            for out in _attend(q, k, v, seg, p, scaling)
        ]
    return torch.cat(outs, dim=2).to(dtype).transpose(1, 2).contiguous(), None


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment: int | tuple[int, ...],
    dropout: float,
    scale: float | None,
) -> list[torch.Tensor]:
    """One unit's attention, in parts along the row: causal for a sequence; for
    ``(P, r_1, ..., r_k)`` the prompt causally, then each response over ``prompt + itself``
    (causal, aligned to the end), so the responses never see each other and no
    ``unit x unit`` mask is built."""
    if isinstance(segment, int):
        return [
            F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale)
        ]
    qs, ks, vs = (x.split(list(segment), dim=2) for x in (q, k, v))
    outs = [
        F.scaled_dot_product_attention(
            qs[0], ks[0], vs[0], dropout_p=dropout, is_causal=True, scale=scale
        )
    ]
    prompt = segment[0]
    for j, r in enumerate(segment[1:], start=1):
        outs.append(
            F.scaled_dot_product_attention(
                qs[j],
                torch.cat([ks[0], ks[j]], dim=2),
                torch.cat([vs[0], vs[j]], dim=2),
                attn_mask=causal_lower_right(r, prompt + r),
                dropout_p=dropout,
                scale=scale,
            )
        )
    return outs


def _within_window(segments: tuple[int | tuple[int, ...], ...], window: int | None) -> None:
    """Refuse a sequence longer than a sliding-window layer's window: each sequence here
    attends causally over all of itself, which equals the window only within it."""
    if window is None:
        return
    longest = max(s if isinstance(s, int) else s[0] + max(s[1:], default=0) for s in segments)
    if longest > window:  # the same model and data: a restart would fail again
        raise InputError(
            f"a packed sequence of {longest} tokens is longer than the model's sliding "
            f"window ({window}), which packed attention does not apply: set "
            "trainer.packing false (padded micro-batches)"
        )


def _one_dtype(*qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in one dtype: autocast's where it is on (the rotary embedding leaves q and k
    in fp32 beside bf16 values, and sdpa with a ``CausalBias`` is not cast by autocast),
    else the values'."""
    device = qkv[0].device.type
    on = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if on else qkv[-1].dtype
    return tuple(x.to(dtype) for x in qkv)


def _in_fp32(*qkv: torch.Tensor) -> bool:
    """bf16 on the CPU: attend in fp32, where torch's CPU flash kernel is faster (casts
    included; ``docs/benchmarks.md``) and the scores are exact to fp32. Under bf16 autocast
    the rotary embedding has already promoted the queries and keys to fp32, and only the
    values are bf16. On CUDA bf16 is the fast path."""
    return qkv[0].device.type == "cpu" and any(x.dtype == torch.bfloat16 for x in qkv)


def register() -> str:
    """Register ``ATTENTION`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, _mask)
    return ATTENTION


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """sdpa's mask, or None inside ``packed_rows()``, where the segments replace it."""
    from transformers.masking_utils import sdpa_mask

    return None if _PACKED_ROWS.get() else sdpa_mask(*args, **kwargs)
