"""The engine's forward for Llama-family models, without transformers' per-module Python.

Beside the linears, a decode step at few sequences is mostly small ops and the Python of
transformers' modules around them (hooks, kwargs, mask building, a call per projection).
This forward computes the same thing for models whose layers are plainly Llama's
(``llama``, and ``qwen2`` without a sliding window), straight from their modules' weights:

    x = embed(ids)
    per layer:  h = rms(x)                    q, k, v = h @ [Wq; Wk; Wv]^T (+ bias)
                q, k = rope(q), rope(k)        k, v = cache.update(k, v)
                x = x + o_proj(sdpa(q, k, v, mask, enable_gqa))
                h = rms(x)                     g, u = h @ [Wg; Wu]^T
                x = x + down(silu(g) * u)
    logits = lm_head(rms(x))[kept positions]

``rms(x) = w * (x / sqrt(mean(x^2) + eps))`` in fp32, cast back before the weight, as
transformers does; rope is the model's own rotary module (its scaling included). The
q/k/v and gate/up projections run fused (``cpu_linear.FusedLinear``): one matmul each.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.engines.torch.cpu_linear import DecodeLinear, FusedLinear
from asyncrl.observe.logs import get_logger

log = get_logger("asyncrl.engine")

_TYPES = ("llama", "qwen2")


class LeanForward:
    """``__call__(ids, mask, positions, cache, keep) -> logits`` for a Llama-family
    model (module docstring). ``invalidate`` drops the fused weights' copies."""

    def __init__(self, model: torch.nn.Module, *, packed: bool = True) -> None:
        inner = model.model
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.lm_head = model.lm_head
        self.layers = [_Layer(layer, packed) for layer in inner.layers]

    def __call__(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        keep: int = 1,
    ) -> torch.Tensor:
        """Logits ``[b, keep or t, V]`` of ``ids [b, t]`` whose KV goes into ``cache``;
        ``mask [b, L]`` marks the real positions of the cache after this step and
        ``positions [b, t]`` are the new tokens' position ids. ``keep`` 0: every position."""
        x = self.embed(ids)
        rope = self.rotary(x, positions)
        attend = _attention_mask(mask.bool(), ids.shape[1])
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, attend, cache, i)
        x = x[:, -keep:] if keep else x
        return self.lm_head(_rms(x, self.norm.weight, self.norm.variance_epsilon))

    def invalidate(self) -> None:
        for layer in self.layers:
            layer.qkv.invalidate()
            layer.gate_up.invalidate()


class _Layer:
    """One decoder layer's weights, by reference to its modules."""

    def __init__(self, layer: torch.nn.Module, packed: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj], packed=packed)
        self.o_proj, self.down = attn.o_proj, mlp.down_proj
        self.gate_up = FusedLinear([mlp.gate_proj, mlp.up_proj], packed=packed)
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.heads = attn.q_proj.out_features // self.head_dim
        self.kv_heads = attn.k_proj.out_features // self.head_dim

    def __call__(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attend: torch.Tensor,
        cache: Any,
        index: int,
    ) -> torch.Tensor:
        x = x + self._attention(
            _rms(x, self.ln1.weight, self.ln1.variance_epsilon), rope, attend, cache, index
        )
        g, u = self.gate_up(_rms(x, self.ln2.weight, self.ln2.variance_epsilon))
        return x + self.down(F.silu(g) * u)

    def _attention(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attend: torch.Tensor,
        cache: Any,
        index: int,
    ) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = (y.view(b, t, -1, self.head_dim).transpose(1, 2) for y in self.qkv(h))
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        k, v = cache.update(k, v, index)
        if t == 1 and self.heads != self.kv_heads and not _gqa_is_faster(q):
            # A decode step: the query heads that share a KV head go in as that head's
            # positions (``[b, kv_heads, groups, d]``), as transformers does. sdpa's
            # enable_gqa is far slower in bf16 on the CPU (docs/benchmarks.md); on CUDA a
            # masked GQA call falls back to the math kernel.
            folded = q.reshape(b, self.kv_heads, -1, self.head_dim)
            o = F.scaled_dot_product_attention(folded, k, v, attn_mask=attend, scale=self.scaling)
            o = o.reshape(b, self.heads, 1, self.head_dim)
        else:
            o = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attend,
                scale=self.scaling,
                enable_gqa=self.heads != self.kv_heads,
            )
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


def _gqa_is_faster(q: torch.Tensor) -> bool:
    """fp32 on the CPU: enable_gqa is faster than folding (docs/benchmarks.md)."""
    return q.device.type == "cpu" and q.dtype == torch.float32


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalised in fp32, cast back, then scaled."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` over ``[b, heads, t, d]`` (cos/sin ``[b, t, d]``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _attention_mask(real: torch.Tensor, t: int) -> torch.Tensor:
    """``[b, 1, t, L]``: the last ``t`` columns' queries see real keys up to themselves;
    a query that would see none (a padding position) sees every column instead: torch's
    CPU kernels give such a row zeros, and this keeps it finite on any backend (its output
    is never read)."""
    length = real.shape[1]
    rows = torch.arange(length - t, length, device=real.device)[:, None]
    causal = torch.arange(length, device=real.device)[None, :] <= rows
    attend = causal[None] & real[:, None, :]
    blind = ~attend.any(-1, keepdim=True)
    return (attend | blind)[:, None]


def lean_forward(model: torch.nn.Module, *, packed: bool = True) -> LeanForward | None:
    """The lean forward for ``model``, or None (the reason logged) if it does not cover it:
    such a model runs through transformers."""
    reason = _uncovered(model)
    if reason is not None:
        log.info("engine forward through transformers", reason=reason)
        return None
    return LeanForward(model, packed=packed)


def _uncovered(model: torch.nn.Module) -> str | None:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in _TYPES:
        return f"model type {kind!r} (covered: {', '.join(_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "use_sliding_window", False) or getattr(config, "pretraining_tp", 1) > 1:
        return "sliding-window attention or tensor-parallel pretraining layout"
    layers = model.model.layers
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "forward hooks"
    if type(layers[0].self_attn.q_proj) not in _LINEARS:
        return f"projection type {type(layers[0].self_attn.q_proj).__name__}"
    return None


_LINEARS = (torch.nn.Linear, DecodeLinear)
