"""Data parallelism for the torch trainer: DDP or FSDP2 over an initialised process group.

With no group, or a world of one, every method is a no-op. Each rank's loss has
step-global denominators, so the ranks' losses sum to the step loss; DDP and FSDP
*average* gradients, so each rank backpropagates ``world_size * loss``:
``mean_r(W * grad L_r) = sum_r grad L_r``. FSDP all-gathers parameters in every forward,
so every rank must run the same number of forwards (the trainer pads shorter ranks with an
empty micro-batch).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

Mode = Literal["ddp", "fsdp"]


@dataclass(frozen=True, slots=True)
class DataParallel:
    """This process's place in the data-parallel group and how models are wrapped."""

    rank: int = 0
    world_size: int = 1
    mode: Mode = "ddp"

    @classmethod
    def detect(cls, mode: Mode = "ddp") -> DataParallel:
        """From the default process group, if one is initialised (the launcher's: gloo on
        CPU, nccl on CUDA)."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), mode)
        return cls(0, 1, mode)

    @property
    def enabled(self) -> bool:
        """True when there is more than one rank."""
        return self.world_size > 1

    @property
    def sharded(self) -> bool:
        """True when parameters are sharded (FSDP over more than one rank)."""
        return self.enabled and self.mode == "fsdp"

    def device(self, kind: str) -> torch.device:
        """``cpu``, or this rank's GPU for ``cuda`` (``LOCAL_RANK``, else rank mod GPUs)."""
        if kind != "cuda":
            return torch.device(kind)
        count = max(torch.cuda.device_count(), 1)
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.rank % count)))

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        """The module to run training forwards through (DDP wrapper, or sharded in place).

        FSDP shards each block named in the model's ``_no_split_modules`` (the decoder
        layers of HF models), then the root, which holds the embeddings and the head.
        """
        if not self.enabled:
            return model
        if self.mode == "ddp":
            ids = [device.index] if device.type == "cuda" else None
            return nn.parallel.DistributedDataParallel(model, device_ids=ids)
        from torch.distributed.fsdp import fully_shard

        blocks = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module)
        fully_shard(model)
        return model

    def shard_frozen(self, model: nn.Module) -> nn.Module:
        """A model that is only evaluated: sharded under FSDP (memory), else as is."""
        if self.sharded:
            return self.wrap(model, torch.device("cpu"))
        return model

    @contextmanager
    def gradient_sync(self, wrapped: nn.Module, enabled: bool) -> Iterator[None]:
        """Inside, backward reduces gradients over ranks only when ``enabled``.

        Gradient accumulation syncs on the last micro-batch alone.
        """
        if self.enabled and self.mode == "ddp" and not enabled:
            with wrapped.no_sync():  # type: ignore[operator]
                yield
            return
        if self.sharded:
            wrapped.set_requires_gradient_sync(enabled)  # type: ignore[operator]
        yield

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it (identity with one rank)."""
        if self.enabled:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def barrier(self) -> None:
        """Wait for every rank (no-op with one rank)."""
        if self.enabled:
            dist.barrier()

    # -- state dicts ------------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, unsharded, as CPU copies (rank 0 only under FSDP).

        Tied parameters appear under each of their names.
        """
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_model_state_dict(model, options=opts)
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def load_full_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Copy a full state dict (every name, same on every rank) into ``model``."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )

            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
            return
        model.load_state_dict(state, strict=True)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """The optimizer's state, unsharded (rank 0 only under FSDP)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_optimizer_state_dict(model, optimizer, options=opts)
        return optimizer.state_dict()

    def load_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: Any
    ) -> None:
        """Restore ``optimizer_state``'s output (the same full state on every rank)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=opts)
            return
        optimizer.load_state_dict(state)
