"""BatchDumper: the trainer's seat in rollout-only mode; batches go to disk, not to a model.

``asyncrl train --debug-rollout-only`` runs it under the name ``trainer``: the buffer,
rollouts and engines run as in training, but the weights stay at version 0 and the
controller lifts the admission bound, so generation runs as fast as the engines allow.
Each batch becomes ``DIR/batch_NNNNNN.msgpack`` (``asyncrl.buffer.dump``) and a metrics
row; ``--load-debug-rollout-data DIR`` later trains on the files.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from asyncrl.actors.base import Actor, ActorSpec
from asyncrl.actors.batches import BufferBatches
from asyncrl.actors.config import BatchDumperConfig
from asyncrl.buffer.dump import BatchWriter
from asyncrl.observe.logs import get_logger
from asyncrl.types import BatchReply, BatchRequest, SampleStatus, TrainBatch
from asyncrl.wire.codec import Codec
from asyncrl.wire.rpc import RpcClient

log = get_logger("asyncrl.dumper")


class BatchDumper(Actor):
    """Writes every batch the buffer serves; see the module doc."""

    Config = BatchDumperConfig
    config: BatchDumperConfig

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        self.steps_done = 0  # heartbeats report stats while setup still runs
        self._last: dict[str, float] = {}

    async def setup(self) -> None:
        self.writer = BatchWriter(Path(self.config.dump_dir))
        self.num_steps = self.config.num_steps
        frame = self.max_frame_bytes
        client = RpcClient(
            self.spec.endpoints["buffer.batches"],
            Codec(BatchRequest),
            Codec(BatchReply, max_frame_bytes=frame),
        )
        self.batches = BufferBatches(await self.open(client, "batches"), self.name)
        path = self.config.metrics_path
        self.metrics = self.open_metrics(path) if path else None

    async def run(self) -> None:
        while not self.stopping and not self._done():
            reply = await self.batches.next(version=0)
            if reply.batch is None:
                if reply.exhausted:
                    self.request_stop("the buffer has no more data")
                continue
            path = await asyncio.to_thread(self.writer.write, reply.batch)
            self.batches.done(reply.batch.batch_id)
            self.steps_done += 1
            self._record(reply.batch, path)
        if self._done():
            self.request_stop(f"dumped {self.num_steps} batches")

    def _done(self) -> bool:
        return self.num_steps > 0 and self.writer.count >= self.num_steps

    def _record(self, batch: TrainBatch, path: Path) -> None:
        self._last = batch_summary(batch)
        if self.metrics is not None:
            row = {"actor": self.name, "step": self.writer.count, "time": time.time()}
            self.metrics.write({**row, **self._last, "path": str(path)})
        log.info("batch dumped", path=str(path), samples=self._last["samples"])

    async def drain(self) -> None:
        await self.batches.close(version=0)

    def stats(self) -> dict[str, float]:
        return {"steps": float(self.steps_done), **self._last}


def batch_summary(batch: TrainBatch) -> dict[str, float]:
    """What a dumped batch holds: ``samples``, ``groups``, ``tokens`` (response tokens),
    ``reward/mean`` over samples with a finite reward, ``response_len/mean`` and ``max``,
    ``failed`` (samples with status failed)."""
    samples = batch.samples
    rewards = np.concatenate([g.rewards for g in batch.groups]) if batch.groups else np.zeros(0)
    finite = rewards[np.isfinite(rewards)]
    lengths = np.array([s.response_length for s in samples], dtype=np.float64)
    return {
        "samples": float(len(samples)),
        "groups": float(len(batch.groups)),
        "tokens": float(lengths.sum()),
        "reward/mean": float(finite.mean()) if finite.size else float("nan"),
        "response_len/mean": float(lengths.mean()) if lengths.size else 0.0,
        "response_len/max": float(lengths.max()) if lengths.size else 0.0,
        "failed": float(sum(s.status == SampleStatus.FAILED for s in samples)),
    }
