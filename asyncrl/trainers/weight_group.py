"""``BroadcastGroup``: a torch.distributed group of its own for weight broadcast.

The trainer (rank 0) and every subscriber (ranks 1..N) rendezvous on a ``TCPStore`` at an
address both know from the config, and build a ``ProcessGroupGloo`` (CPU tensors) or
``ProcessGroupNCCL`` (CUDA tensors) directly on it. No default process group is created,
so a DDP trainer's own group is untouched and several groups can coexist in a process.

Blocking calls: run them in a worker thread (``asyncio.to_thread``). A broadcast waits for
every rank, so a subscriber must take every version it is announced; used by
``weight_sync`` for the ``dist`` transport.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from asyncrl.trainers.config import GroupConfig


class BroadcastGroup:
    """``world_size`` processes that broadcast tensors from rank 0."""

    def __init__(self, group: dist.ProcessGroup, store: dist.TCPStore, rank: int, size: int):
        self.group, self._store, self.rank, self.world_size = group, store, rank, size

    @classmethod
    def join(
        cls,
        address: str,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> BroadcastGroup:
        """Rendezvous at ``address`` ("host:port"; rank 0 serves the store). Blocks until
        all ``world_size`` ranks arrive or ``timeout_s`` passes."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"weight group address must be host:port, got {address!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=timeout)
        if backend == "gloo":
            group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        elif backend == "nccl":
            group = dist.ProcessGroupNCCL(store, rank, world_size)
        else:
            raise ValueError(f"weight group backend must be gloo or nccl, got {backend!r}")
        return cls(group, store, rank, world_size)

    @classmethod
    def join_config(cls, cfg: GroupConfig) -> BroadcastGroup:
        """``join`` with a ``GroupConfig``."""
        return cls.join(cfg.address, cfg.rank, cfg.world_size, backend=cfg.backend)

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast each tensor from rank 0 in list order (in place on other ranks)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for t in tensors:
            self.group.broadcast([t], opts).wait()
