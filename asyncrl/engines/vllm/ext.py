"""asyncrl's weight-transfer backend inside a vLLM server (runs in vLLM's own virtualenv).

vLLM's RL routes hand each call to the weight-transfer engine ``--weight-transfer-config``
names, in every worker. vLLM's own ``nccl`` engine needs CUDA and vLLM's classes in the
trainer; this one, ``asyncrl``, joins the trainer's weight group as an SGLang server does
(``weights.loading.join_as_sglang``: gloo on CPU, NCCL on GPU), so the trainer broadcasts
to vLLM exactly as to SGLang, and loads what arrives through vLLM's layerwise reload.
Importing this module (vLLM does, in each worker, as the worker extension) registers the
engine; it imports only torch, vLLM and asyncrl's torch-only ``weights`` modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from asyncrl.weights.loading import join_as_sglang, read_safetensors, receive_broadcasts
from asyncrl.weights.payload import bucket_layout, piece

#: The name ``--weight-transfer-config '{"backend": "asyncrl"}'`` selects.
BACKEND = "asyncrl"


@dataclass
class GroupInit(WeightTransferInitInfo):
    """Where the trainer's group meets, and this worker's rank in it."""

    master_address: str
    master_port: int
    rank: int
    world_size: int
    group_name: str
    backend: str = "gloo"


@dataclass
class Bucket(WeightTransferUpdateInfo):
    """One announced bucket: its tensors' names, dtypes and shapes, in broadcast order
    (one broadcast per tensor, or with ``flattened`` one of all their bytes, SGLang's
    ``flattened_bucket``); or ``path``, a directory of safetensors files to read instead."""

    group_name: str = ""
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    flattened: bool = False
    path: str | None = None
    _entries: list[tuple[str, str, list[int]]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        self._entries = list(zip(self.names, self.dtypes, self.shapes, strict=True))


class GroupTransfer(WeightTransferEngine[GroupInit, Bucket]):
    """Receives broadcast buckets from asyncrl's trainer and loads them (module docstring)."""

    init_info_cls = GroupInit
    update_info_cls = Bucket
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups: dict[str, dist.ProcessGroup] = {}

    def init_transfer_engine(self, init_info: GroupInit) -> None:
        if init_info.group_name in self.groups:
            raise ValueError(f"a weights update group named {init_info.group_name!r} exists")
        self.groups[init_info.group_name] = join_as_sglang(
            init_info.master_address,
            init_info.master_port,
            init_info.rank,
            init_info.world_size,
            init_info.group_name,
            init_info.backend,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_tied_heads(self.model)

    def receive_weights(self, update_info: Bucket) -> None:
        if update_info.path is not None:
            self.model.load_weights(list(read_safetensors(update_info.path).items()))
            return
        group = self.groups.get(update_info.group_name)
        if group is None:
            raise ValueError(f"no weights update group named {update_info.group_name!r}")
        tensors = {
            name: torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            for name, dtype, shape in update_info._entries
        }
        if not update_info.flattened:
            receive_broadcasts(group, list(tensors.values()))
            self.model.load_weights(list(tensors.items()))
            return
        layout = bucket_layout(tensors.items())
        flat = torch.empty(
            layout[-1].end_idx if layout else 0, dtype=torch.uint8, device=self.device
        )
        receive_broadcasts(group, [flat])
        self.model.load_weights([(meta.name, piece(flat, meta)) for meta in layout])

    def shutdown(self) -> None:
        """Leave every group (vLLM's shutdown route names none)."""
        groups, self.groups = self.groups, {}
        for group in groups.values():
            dist.destroy_process_group(group)


def repack_tied_heads(model: torch.nn.Module) -> None:
    """Process a tied output head again after its embedding was reloaded.

    vLLM's CPU platform multiplies by the head through a packed copy of its weight, made
    when the head is processed after loading. A head tied to the input embedding loads
    nothing of its own, so a reload refreshes the embedding and leaves the head's packed
    copy old (vLLM's layerwise reload says as much: a tied parameter reflects the
    processing of one parent only). Sampling would then use the old head."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    modules = list(model.modules())
    embedded = {
        m.weight.data_ptr()
        for m in modules
        if type(m) is VocabParallelEmbedding and m.weight.numel()
    }
    for head in modules:
        if isinstance(head, ParallelLMHead) and head.weight.data_ptr() in embedded:
            head.quant_method.process_weights_after_loading(head)


class WorkerExtension:
    """Mixed into vLLM's worker class. Naming it as the worker extension imports this
    module in each worker before the model loads, which registers ``GroupTransfer``."""

    vllm_config: Any
    device: torch.device

    def asyncrl_settings(self) -> dict[str, Any]:
        """What asyncrl checks before it uses the server, and the capacity it reports
        (``/collective_rpc``)."""
        config = self.vllm_config
        transfer = config.weight_transfer_config
        cache = config.cache_config
        return {
            "logprobs_mode": str(config.model_config.logprobs_mode),
            "weight_transfer": str(transfer.backend) if transfer is not None else "",
            "device": str(self.device),
            "max_num_seqs": int(config.scheduler_config.max_num_seqs),
            "kv_tokens": int((cache.num_gpu_blocks or 0) * cache.block_size),
            "world_size": int(config.parallel_config.world_size),
        }

    def asyncrl_abandon_update(self) -> bool:
        """End an update session that never finished (its finish failed, or its client
        died between start and finish), so the next ``start_weight_update`` is accepted;
        True if one was open. Layers it left unloaded are loaded by the next update."""
        worker: Any = self
        if not getattr(worker, "_weight_update_active", False):
            return False
        worker._weight_update_active = False
        if worker.weight_transfer_engine is not None:
            worker.weight_transfer_engine.reset_weight_update_target()
        return True


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, GroupTransfer)
