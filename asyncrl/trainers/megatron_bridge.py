"""Hugging Face Qwen2/Llama <-> megatron-core GPTModel: the config and the weights.

Full (unsharded) state dicts convert exactly, both ways, and split into a rank's TP shards
and PP stage: the trainer loads HF weights this way and publishes its own under HF names.
Layout per decoder layer ``i`` (``h`` heads, ``g`` KV groups, head dim ``d``, ``r = h / g``
query heads per group)::

    model.layers.i.self_attn.{q,k,v}_proj  ->  decoder.layers.i.self_attention.linear_qkv
        packed per KV group: for j in 0..g-1: [q heads j*r..(j+1)*r-1 (r*d rows), k_j (d), v_j (d)]
    model.layers.i.self_attn.o_proj        ->  ...self_attention.linear_proj
    model.layers.i.mlp.{gate,up}_proj      ->  ...mlp.linear_fc1 = cat(gate, up) (rows)
    model.layers.i.mlp.down_proj           ->  ...mlp.linear_fc2
    model.layers.i.input_layernorm         ->  ...input_layernorm        (local spec)
    model.layers.i.post_attention_layernorm -> ...pre_mlp_layernorm      (local spec)
    model.embed_tokens / model.norm / lm_head -> embedding.word_embeddings /
        decoder.final_layernorm / output_layer (absent when embeddings are tied)

With the TransformerEngine spec (``te=True``) the two norms live inside the linear layers,
as ``linear_qkv.layer_norm_weight`` and ``linear_fc1.layer_norm_weight``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

#: HF ``model_type``s whose decoder is the Qwen2/Llama shape this bridge converts.
SUPPORTED = ("qwen2", "llama")


class UnsupportedModel(ValueError):
    """The HF config describes a model this bridge does not convert."""


def _check(hf: Any) -> None:
    if hf.model_type not in SUPPORTED:
        raise UnsupportedModel(
            f"megatron backend: model_type {hf.model_type!r} is not one of {SUPPORTED}"
        )
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"megatron backend: hidden_act {hf.hidden_act!r}, want silu")
    rope = rope_parameters(hf)
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedModel(
            f"megatron backend: rope_type {rope['rope_type']!r} is not converted yet"
        )


def rope_parameters(hf: Any) -> dict[str, Any]:
    """RoPE settings: ``rope_parameters`` (transformers 5) or ``rope_scaling`` plus
    ``rope_theta`` (older configs)."""
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(hf, "rope_theta", None) or 10000.0)
    return rope


def head_dim(hf: Any) -> int:
    return int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)


def qkv_bias(hf: Any) -> bool:
    """Qwen2 always has q/k/v biases; Llama has them when ``attention_bias``."""
    return hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))


def transformer_config(hf: Any, **overrides: Any) -> TransformerConfig:
    """megatron's ``TransformerConfig`` for the HF config ``hf``; ``overrides`` sets the
    parallel sizes, dtypes and the like (``tensor_model_parallel_size=2``, ...)."""
    from megatron.core.transformer import TransformerConfig

    _check(hf)
    fields: dict[str, Any] = {
        "num_layers": hf.num_hidden_layers,
        "hidden_size": hf.hidden_size,
        "ffn_hidden_size": hf.intermediate_size,
        "num_attention_heads": hf.num_attention_heads,
        "num_query_groups": hf.num_key_value_heads,
        "kv_channels": head_dim(hf),
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": qkv_bias(hf),
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "apply_rope_fusion": False,
    }
    fields.update(overrides)
    return TransformerConfig(**fields)


def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def gpt_model(
    hf: Any,
    cfg: TransformerConfig,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    te: bool | None = None,
) -> GPTModel:
    """The ``GPTModel`` for ``hf`` under ``cfg`` (this rank's stage when ``pre_process``
    or ``post_process`` is False). ``te``: the TransformerEngine layer spec (default:
    when installed)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    te = has_transformer_engine() if te is None else te
    if te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=int(rope_parameters(hf)["rope_theta"]),
    )


def _layer_names(i: int, te: bool) -> dict[str, str]:
    """HF -> megatron names of layer ``i``'s tensors that map one to one."""
    hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
    qkv_norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
    return {
        hf + "self_attn.o_proj.weight": mc + "self_attention.linear_proj.weight",
        hf + "mlp.down_proj.weight": mc + "mlp.linear_fc2.weight",
        hf + "input_layernorm.weight": mc + qkv_norm,
        hf + "post_attention_layernorm.weight": mc + mlp_norm,
    }


def _global_names(hf: Any) -> dict[str, str]:
    names = {
        "model.embed_tokens.weight": "embedding.word_embeddings.weight",
        "model.norm.weight": "decoder.final_layernorm.weight",
    }
    if not hf.tie_word_embeddings:
        names["lm_head.weight"] = "output_layer.weight"
    return names


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """``[q_0 k_0 v_0 q_1 k_1 v_1 ...]`` per KV group along dim 0 (weights or biases)."""
    qs, ks, vs = q.chunk(groups), k.chunk(groups), v.chunk(groups)
    return torch.cat([t for j in range(groups) for t in (qs[j], ks[j], vs[j])])


def unpack_qkv(
    qkv: torch.Tensor, groups: int, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_qkv``: each group is ``r*d + d + d`` rows."""
    per = qkv.shape[0] // groups
    blocks = qkv.split(per)
    q = torch.cat([b[: per - 2 * d] for b in blocks])
    k = torch.cat([b[per - 2 * d : per - d] for b in blocks])
    v = torch.cat([b[per - d :] for b in blocks])
    return q, k, v


def hf_to_megatron(
    hf: Any, state: dict[str, torch.Tensor], *, te: bool = False
) -> dict[str, torch.Tensor]:
    """The full megatron state dict of the HF ``state`` (names as in the module
    docstring). Raises ``KeyError`` naming a missing HF tensor."""
    _check(hf)
    out = {mc: state[name] for name, mc in _global_names(hf).items()}
    groups = hf.num_key_value_heads
    for i in range(hf.num_hidden_layers):
        out.update({mc: state[name] for name, mc in _layer_names(i, te).items()})
        attn, mc = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        kinds = ("weight", "bias") if qkv_bias(hf) else ("weight",)
        for kind in kinds:
            q, k, v = (state[f"{attn}{p}_proj.{kind}"] for p in "qkv")
            out[f"{mc}self_attention.linear_qkv.{kind}"] = pack_qkv(q, k, v, groups)
        mlp = f"model.layers.{i}.mlp."
        gate, up = state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]
        out[mc + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
    return out


def megatron_to_hf(
    hf: Any, state: dict[str, torch.Tensor], *, te: bool = False
) -> dict[str, torch.Tensor]:
    """Inverse of ``hf_to_megatron``: HF names; megatron's extra state is ignored."""
    _check(hf)
    out = {name: state[mc] for name, mc in _global_names(hf).items()}
    groups, d = hf.num_key_value_heads, head_dim(hf)
    for i in range(hf.num_hidden_layers):
        out.update({name: state[mc] for name, mc in _layer_names(i, te).items()})
        attn, mc = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        kinds = ("weight", "bias") if qkv_bias(hf) else ("weight",)
        for kind in kinds:
            q, k, v = unpack_qkv(state[f"{mc}self_attention.linear_qkv.{kind}"], groups, d)
            out.update({f"{attn}q_proj.{kind}": q, f"{attn}k_proj.{kind}": k})
            out[f"{attn}v_proj.{kind}"] = v
        gate, up = state[mc + "mlp.linear_fc1.weight"].chunk(2)
        out.update({f"model.layers.{i}.mlp.gate_proj.weight": gate})
        out[f"model.layers.{i}.mlp.up_proj.weight"] = up
    return out


_COLUMN = (
    "linear_qkv.weight",
    "linear_qkv.bias",
    "linear_fc1.weight",
    "word_embeddings.weight",
    "output_layer.weight",
)
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def tp_split_dim(name: str) -> int | None:
    """The dim megatron tensor ``name`` splits along across TP ranks; None: replicated."""
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def check_tp(hf: Any, size: int) -> None:
    """Refuse a TP size the model's shapes do not divide, naming the shape."""
    shapes = {
        "num_key_value_heads": hf.num_key_value_heads,
        "vocab_size": hf.vocab_size,
        "intermediate_size": hf.intermediate_size,
    }
    for field, n in shapes.items():
        if n % size:
            raise UnsupportedModel(f"megatron backend: {field} {n} is not divisible by TP {size}")


def tp_shard(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of the full megatron tensor ``name`` under TP ``size``.

    Column-parallel tensors (``linear_qkv``, ``linear_fc1``, the embedding and
    ``output_layer``, by vocab) split along dim 0, row-parallel ones along dim 1, norms stay
    whole. ``linear_qkv`` is packed per KV group, so a contiguous split gives each rank
    ``g / size`` whole groups; ``linear_fc1`` holds ``[gate_t; up_t]`` on rank ``t``, so
    gate and up split separately.
    """
    dim = tp_split_dim(name)
    if dim is None or size == 1:
        return tensor
    if name.endswith("linear_fc1.weight"):
        gate, up = tensor.chunk(2)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    return tensor.chunk(size, dim)[rank]


def tp_gather(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full megatron tensor ``name`` from its TP shards, rank order (inverse of
    ``tp_shard``)."""
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(s.chunk(2) for s in shards), strict=True)
        return torch.cat([*gates, *ups])
    return torch.cat(shards, dim)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def pp_layers(num_layers: int, stage: int, stages: int) -> range:
    """The global indices of the layers on pipeline ``stage`` of ``stages`` (even split)."""
    if num_layers % stages:
        raise UnsupportedModel(
            f"megatron backend: {num_layers} layers do not split evenly into PP {stages}"
        )
    per = num_layers // stages
    return range(stage * per, (stage + 1) * per)


def pp_stage(
    hf: Any, full: dict[str, torch.Tensor], stage: int, stages: int
) -> dict[str, torch.Tensor]:
    """Pipeline ``stage``'s part of the full megatron state dict, its layers renumbered
    from 0. The first stage also holds the embedding, the last the final norm and
    ``output_layer`` (with tied embeddings and several stages, its own copy of the
    embedding)."""
    layers = pp_layers(hf.num_hidden_layers, stage, stages)
    first, last = stage == 0, stage == stages - 1
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        match = _LAYER.match(name)
        if match and int(match[1]) in layers:
            out[f"decoder.layers.{int(match[1]) - layers.start}.{match[2]}"] = tensor
        elif name.startswith("embedding.") and first:
            out[name] = tensor
        elif name.startswith(("decoder.final_layernorm.", "output_layer.")) and last:
            out[name] = tensor
    if last and not first and hf.tie_word_embeddings:
        out["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    return out


def pp_merge(hf: Any, stages: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full megatron state dict from each stage's (inverse of ``pp_stage``; a tied
    last stage's copy of the embedding is dropped)."""
    out: dict[str, torch.Tensor] = {}
    for stage, state in enumerate(stages):
        start = pp_layers(hf.num_hidden_layers, stage, len(stages)).start
        for name, tensor in state.items():
            match = _LAYER.match(name)
            if match:
                out[f"decoder.layers.{int(match[1]) + start}.{match[2]}"] = tensor
            elif not (name == "output_layer.weight" and hf.tie_word_embeddings):
                out[name] = tensor
    return out


def hf_shapes(hf: Any) -> dict[str, torch.Tensor]:
    """The HF state of ``hf`` as meta tensors (names and shapes, no memory), tied
    ``lm_head.weight`` dropped."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    state = model.state_dict()
    if hf.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def load_hf_state(
    model: torch.nn.Module, hf: Any, state: dict[str, torch.Tensor], *, te: bool = False
) -> None:
    """Copy the full HF-named ``state`` into this rank's ``model``: its pipeline stage,
    its TP shards (inverse of ``gather_hf_weights``). Every parameter must be given."""
    from megatron.core import parallel_state as ps

    full = hf_to_megatron(hf, state, te=te)
    stage = pp_stage(
        hf,
        full,
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
    )
    rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    local = {k: tp_shard(k, v, rank, size) for k, v in stage.items()}
    missing, unexpected = model.load_state_dict(local, strict=False)
    wrong = [k for k in missing if not k.endswith("_extra_state")] + list(unexpected)
    if wrong:
        raise ValueError(f"megatron backend: the converted weights do not fit the model: {wrong}")


def gather_hf_weights(
    model: torch.nn.Module, hf: Any, *, te: bool = False
) -> dict[str, torch.Tensor]:
    """The full HF-named weights of this rank's megatron ``model``, on every rank: each
    tensor is all-gathered across the TP group, then each pipeline stage's tensors are
    broadcast over the PP group. Every rank knows every stage's names and shapes from
    the config (``hf_shapes``), so nothing but tensors crosses the wire."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    stage_full: dict[str, torch.Tensor] = {}
    for name, tensor in local.items():
        parts = [torch.empty_like(tensor) for _ in range(tp)]
        dist.all_gather(parts, tensor.contiguous(), group=tp_group)
        stage_full[name] = tp_gather(name, parts)
    pp_group, pp = (
        ps.get_pipeline_model_parallel_group(),
        ps.get_pipeline_model_parallel_world_size(),
    )
    me, owners = ps.get_pipeline_model_parallel_rank(), dist.get_process_group_ranks(pp_group)
    dtype = next(iter(local.values())).dtype
    full_meta = hf_to_megatron(hf, hf_shapes(hf), te=te)
    stages = []
    for stage in range(pp):
        shapes = pp_stage(hf, full_meta, stage, pp)
        tensors = {}
        for name in sorted(shapes):
            buf = stage_full[name] if stage == me else torch.empty(shapes[name].shape, dtype=dtype)
            dist.broadcast(buf, src=owners[stage], group=pp_group)
            tensors[name] = buf
        stages.append(tensors)
    return megatron_to_hf(hf, pp_merge(hf, stages), te=te)
