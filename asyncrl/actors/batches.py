"""Where a trainer's batches come from: the buffer (rpc, with acknowledgements) or a dump.

Both answer ``next(version, durable, last_batch)`` with a ``BatchReply`` (a batch, none yet, or
``exhausted``); ``done(batch_id)`` marks a batch finished and ``close(version)`` sends
what is still owed before the actor stops.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

import msgspec

from asyncrl.buffer.dump import batch_files, read_batch
from asyncrl.errors import RunStateLost
from asyncrl.observe.logs import get_logger
from asyncrl.types import BatchReply, BatchRequest
from asyncrl.wire.errors import PeerLost, RemoteError
from asyncrl.wire.rpc import RpcClient

log = get_logger("asyncrl.trainer")
_WAIT_S = 1.0
_WHAT_TO_DO = (
    "The run cannot go on exactly: restore the run directory's checkpoints and "
    "journal from a copy, or start over with --overwrite"
)


class BatchSource(Protocol):
    """What a consumer of train batches needs; see the module doc."""

    async def next(self, version: int, durable: int = -1, last_batch: int = -1) -> BatchReply: ...

    def done(self, batch_id: int) -> None: ...

    async def close(self, version: int, durable: int = -1) -> None: ...


class BufferBatches:
    """Batches from the buffer actor. A batch stays held by the buffer until acknowledged
    (and, with ``durable >= 0``, until a checkpoint of the consumer covers it); the
    acknowledgements ride on the next request, and the first request resyncs at the
    consumer's version, so a consumer restarted from a checkpoint is served again every
    batch after it. A request whose connection reset (the buffer restarted) is sent
    again with ``resync``: the batch of a lost reply comes again, nothing is skipped."""

    def __init__(self, client: RpcClient[BatchRequest, BatchReply], consumer: str) -> None:
        self.client = client
        self.consumer = consumer
        self._acks: list[int] = []
        self._resync = True
        self._durable = -1  # the newest durable version the buffer has heard

    async def next(self, version: int, durable: int = -1, last_batch: int = -1) -> BatchReply:
        req = BatchRequest(
            trainer=self.consumer,
            wait=_WAIT_S,
            ack=self._acks,
            resync=self._resync,
            version=version,
            durable=durable,
            last_batch=last_batch,
        )
        reply = await self._call(req)
        self._acks, self._resync, self._durable = [], False, durable
        return reply

    async def _call(self, req: BatchRequest) -> BatchReply:
        while True:
            try:
                return await self.client.call(req)
            except PeerLost as exc:  # the buffer went away: it comes back restored
                log.warning("buffer lost; asking again", error=str(exc))
                req = msgspec.structs.replace(req, resync=True)
                await asyncio.sleep(_WAIT_S)
            except RemoteError as exc:  # the buffer refused our resync: permanent
                lost = str(exc).removeprefix(f"{RunStateLost.__name__}: ")
                if lost != str(exc):
                    raise RunStateLost(f"{lost}. {_WHAT_TO_DO}") from None
                raise

    def done(self, batch_id: int) -> None:
        self._acks.append(batch_id)

    async def close(self, version: int, durable: int = -1) -> None:
        """Acknowledge what is finished (it must not be served again after we stop),
        with ``durable`` from the final checkpoint, written before this call: the buffer
        releases what that checkpoint covers, and only that (and keeps its snapshot of
        that step, though no batch was acknowledged since)."""
        if self._acks or durable > self._durable:
            final = BatchRequest(
                trainer=self.consumer, ack=self._acks, take=False, version=version, durable=durable
            )
            await self._call(final)
            self._acks, self._durable = [], durable


class DumpedBatches:
    """Batches from the files of a dump (``asyncrl.buffer.dump``), in order, after the
    first ``skip`` (a resumed trainer skips the batches its weights hold, up to the one
    that made its version). Each batch's id is its file's number (from 1), the trainer's
    ``last_batch`` in this job."""

    def __init__(self, directory: Path, *, skip: int = 0) -> None:
        self.files = batch_files(directory)
        if not self.files:
            raise ValueError(f"{directory}: no batch_NNNNNN.msgpack files to train on")
        self.position = min(skip, len(self.files))

    async def next(self, version: int, durable: int = -1, last_batch: int = -1) -> BatchReply:
        if self.position >= len(self.files):
            return BatchReply(batch=None, exhausted=True)
        batch = await asyncio.to_thread(read_batch, self.files[self.position])
        self.position += 1
        return BatchReply(batch=msgspec.structs.replace(batch, batch_id=self.position))

    def done(self, batch_id: int) -> None:
        pass  # files are never consumed: a dump can be replayed again

    async def close(self, version: int, durable: int = -1) -> None:
        pass
