"""ProbeActor: stands in for a job role in ``asyncrl train --dry-run`` and proves its wiring.

One probe per role of the real topology (``runtime/topology.py``) opens exactly the
channels its role opens and pushes ``config.count`` synthetic messages through each,
checking every payload. It then reports ``probe.done = 1`` and idles until the controller
stops it, which exercises drain and clean shutdown too.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from asyncrl.actors.base import Actor
from asyncrl.actors.config import ProbeActorConfig
from asyncrl.wire.blob import BlobClient, BlobServer
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import Probe, WeightVersion
from asyncrl.wire.pubsub import Publisher, Subscriber
from asyncrl.wire.reliable import ReliableReceiver, ReliableSender
from asyncrl.wire.rpc import RpcClient, RpcServer

if TYPE_CHECKING:
    import torch


def _payload(seq: int) -> np.ndarray:
    return np.arange(seq, seq + 64, dtype=np.int32)


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class ProbeActor(Actor):
    """One role of the dry-run topology; see the module docstring."""

    Config = ProbeActorConfig
    config: ProbeActorConfig

    async def setup(self) -> None:
        wire, frame = self.wire, self.max_frame_bytes
        self.codec, self.weights_codec = (
            Codec(Probe, max_frame_bytes=frame),
            Codec(WeightVersion, max_frame_bytes=frame),
        )
        self.hwm = wire.hwm
        self.reliable = {
            "window": wire.window,
            "batch_bytes": wire.batch_bytes,
            "redeliver_after": wire.redeliver_after,
        }
        self.chunk_bytes = wire.chunk_bytes
        self.role = self.config.role
        self.count = self.config.count
        self.rollouts = self.config.rollouts
        self.counters = {"work": 0, "results": 0, "batches": 0, "weights": 0, "blob_bytes": 0}
        self.done = False
        if self.role != "buffer":
            # Weights move as torch tensors. The first import takes seconds (more than the
            # heartbeat timeout on a loaded machine) and holds the event loop, so it is
            # done here, under the startup timeout, as the real actors do.
            import torch  # noqa: F401
        await getattr(self, f"_setup_{self.role}")()

    async def run(self) -> None:
        await getattr(self, f"_run_{self.role}")()
        self.done = True
        await self.wait_stopping()

    def stats(self) -> dict[str, float]:
        out = {f"probe.{k}": float(v) for k, v in self.counters.items()}
        out["probe.done"] = float(self.done)
        return out

    # -- buffer -----------------------------------------------------------------------
    async def _setup_buffer(self) -> None:
        ep = self.spec.endpoints
        await self.open(
            RpcServer(ep["buffer.work"], self.codec, self.codec, self._serve_work, hwm=self.hwm),
            "work",
        )
        self.results = await self.open(
            ReliableReceiver(ep["buffer.results"], self.codec, hwm=self.hwm), "results"
        )
        await self.open(
            RpcServer(
                ep["buffer.batches"], self.codec, self.codec, self._serve_batch, hwm=self.hwm
            ),
            "batches",
        )

    async def _serve_work(self, req: Probe, peer: bytes) -> Probe:
        self.counters["work"] += 1
        return Probe(sender=self.name, seq=req.seq, payload=_payload(req.seq))

    async def _serve_batch(self, req: Probe, peer: bytes) -> Probe:
        self.counters["batches"] += 1
        return Probe(sender=self.name, seq=req.seq, payload=_payload(req.seq))

    async def _run_buffer(self) -> None:
        expected = self.rollouts * self.count
        while self.counters["results"] < expected:
            batch = await self.results.receive_batch()
            for msg in batch:
                if not np.array_equal(msg.payload, _payload(msg.seq)):
                    raise ValueError(f"result {msg.seq} from {msg.sender} arrived corrupted")
            self.counters["results"] += len(batch)
            batch.ack()

    # -- rollout ----------------------------------------------------------------------
    async def _setup_rollout(self) -> None:
        ep = self.spec.endpoints
        self.work = await self.open(
            RpcClient(ep["buffer.work"], self.codec, self.codec, identity=self.name, hwm=self.hwm),
            "work",
        )
        self.sender = await self.open(
            ReliableSender(ep["buffer.results"], self.codec, hwm=self.hwm, **self.reliable),
            "results",
        )
        self.weights = await self.open(
            Subscriber(
                ep["trainer.weights"],
                ep["trainer.weights_snapshot"],
                self.weights_codec,
                ["weights"],
            ),
            "weights",
        )

    async def _run_rollout(self) -> None:
        for seq in range(self.count):
            item = await self.work.call(Probe(sender=self.name, seq=seq, payload=_payload(0)))
            self.counters["work"] += 1
            await self.sender.send(Probe(sender=self.name, seq=item.seq, payload=item.payload))
            self.counters["results"] += 1
        await self.sender.join()
        update = await self.weights.receive()
        self.counters["weights"] += 1
        self.version = update.msg.version
        async with BlobClient(update.msg.location, identity=self.name) as blob:
            tensors = await blob.fetch(update.msg.blob)
        if _digest(tensors) != update.msg.blob.split("@")[-1]:
            raise ValueError(f"weights {update.msg.blob} arrived corrupted")
        self.counters["blob_bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())

    # -- trainer ----------------------------------------------------------------------
    async def _setup_trainer(self) -> None:
        ep = self.spec.endpoints
        self.batches = await self.open(
            RpcClient(
                ep["buffer.batches"], self.codec, self.codec, identity=self.name, hwm=self.hwm
            ),
            "batches",
        )
        self.pub = await self.open(
            Publisher(ep["trainer.weights"], ep["trainer.weights_snapshot"], self.weights_codec),
            "weights",
        )
        self.blob = await self.open(
            BlobServer(ep["trainer.blob"], chunk_bytes=self.chunk_bytes), "blob"
        )

    async def _run_trainer(self) -> None:
        import torch

        gen = torch.Generator().manual_seed(0)
        tensors = {
            "embed.weight": torch.randn(256, 64, generator=gen).to(torch.bfloat16),
            "head.bias": torch.randn(256, generator=gen),
        }
        blob = f"v1@{_digest(tensors)}"
        manifest = self.blob.put(blob, tensors)
        self.version = 1
        self.pub.publish(
            "weights",
            WeightVersion(
                version=1,
                transport="pull",
                location=(self.blob.endpoint),
                blob=blob,
                manifest=manifest,
            ),
        )
        self.counters["weights"] += 1
        for seq in range(self.count):
            reply = await self.batches.call(Probe(sender=self.name, seq=seq, payload=_payload(0)))
            if not np.array_equal(reply.payload, _payload(seq)):
                raise ValueError(f"batch {seq} arrived corrupted")
            self.counters["batches"] += 1
