"""``BroadcastGroup``: a torch.distributed group of its own for weight broadcast.

The trainer (rank 0) and every subscriber (ranks 1..N) rendezvous on a ``TCPStore`` at an
address both know from the config, and build a ``ProcessGroupGloo`` (CPU tensors) or
``ProcessGroupNCCL`` (CUDA tensors) directly on it. No default process group is created,
so a DDP trainer's own group is untouched and several groups can coexist in a process.

Blocking calls: run them in a worker thread (``asyncio.to_thread``). A broadcast waits for
every rank, so a subscriber must take every version it is announced; one that never comes
fails the others' broadcast after ``timeout_s`` (gloo's collective timeout) instead of
hanging them. A version goes in buckets (``weight_buckets.py``): ``send_buckets`` on rank
0, ``receive_buckets`` elsewhere. Used by ``weight_sync`` for the ``dist`` transport.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping

import torch
import torch.distributed as dist

from asyncrl.trainers.config import GroupConfig
from asyncrl.trainers.weight_buckets import BucketBuffers, Sink, flatten, manifest_buckets, views
from asyncrl.wire.messages import BlobManifest


class BroadcastGroup:
    """``world_size`` processes that broadcast tensors from rank 0."""

    def __init__(self, group: dist.ProcessGroup, store: dist.TCPStore, rank: int, size: int):
        self.group, self._store, self.rank, self.world_size = group, store, rank, size
        self.buffers = BucketBuffers()  # one bucket per dtype, reused every version

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
        return cls.join(
            cfg.address, cfg.rank, cfg.world_size, backend=cfg.backend, timeout_s=cfg.timeout_s
        )

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast each tensor from rank 0 in list order (in place on other ranks)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for t in tensors:
            self.group.broadcast([t], opts).wait()

    def send_buckets(self, manifest: BlobManifest, tensors: Mapping[str, torch.Tensor]) -> None:
        """Rank 0: each bucket of ``manifest`` flattened, one broadcast per bucket."""
        for bucket in manifest_buckets(manifest):
            flat = flatten(bucket, manifest.entries, tensors, out=self.buffers.get(bucket))
            self.broadcast([flat])

    def receive_buckets(
        self, manifest: BlobManifest, sink: Sink, device: torch.device | str = "cpu"
    ) -> None:
        """Other ranks: each bucket into one buffer, then ``sink(name, view)`` per tensor."""
        if self.buffers.device != device:
            self.buffers = BucketBuffers(device)
        for bucket in manifest_buckets(manifest):
            flat = self.buffers.get(bucket)
            self.broadcast([flat])
            for name, view in views(bucket, manifest.entries, flat):
                sink(name, view)
