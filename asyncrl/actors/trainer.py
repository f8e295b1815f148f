"""TrainerActor: batches in, optimizer steps, weight versions out (docs/design.md s.2).

Each step takes a batch (from the buffer, or ``load_dump``'s files), trains it in a
worker thread (heartbeats and sockets keep running), publishes the new version and
acknowledges the batch on the next request. Each request also carries the version of the
newest complete checkpoint (``durable``): the buffer keeps every batch after it, so a
restarted trainer retrains exactly what it lost (``docs/reliability.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from asyncrl.actors.base import CHECKPOINTED_STAT, Actor, ActorSpec
from asyncrl.actors.batches import BatchSource, BufferBatches, DumpedBatches
from asyncrl.actors.config import PublishConfig, TrainerActorConfig
from asyncrl.buffer.dump import BatchWriter
from asyncrl.buffer.journal import fsync_dir
from asyncrl.checkpoints import checkpoint_dirs, step_dir, step_of
from asyncrl.cores import BusyMark
from asyncrl.errors import CheckpointUnreadable, NonFiniteTraining, RunStateLost
from asyncrl.observe.episodes import episode_metrics
from asyncrl.observe.logs import get_logger
from asyncrl.observe.metrics import JsonlMetricsSink
from asyncrl.observe.samples import sample_rows
from asyncrl.trainers.backends import create_trainer
from asyncrl.trainers.base import NonFiniteStep, StepResult, UntrainableBatch
from asyncrl.types import BatchReply, BatchRequest, TrainBatch
from asyncrl.weights.config import check_group_host
from asyncrl.weights.group import GroupMembership
from asyncrl.weights.sync import WeightPublisher
from asyncrl.wire.blob import BlobServer
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import Command, Scalar, WeightVersion
from asyncrl.wire.pubsub import Publisher
from asyncrl.wire.rpc import RpcClient

log = get_logger("asyncrl.trainer")


class TrainerActor(Actor):
    """Trains on batches from the buffer and publishes each version; see the module doc."""

    Config = TrainerActorConfig
    config: TrainerActorConfig

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        # Heartbeats report these from the start, while setup still loads the model.
        self.steps_done = 0
        self.skipped = 0
        self._nonfinite = 0  # non-finite steps in a row (skipped)
        self._resumed_from = ""  # the checkpoint setup loaded, if any
        # The id of the batch that made this version (-1: unknown: a checkpoint written
        # before this was recorded); every batch up to it is in the weights, trained or
        # skipped. Checkpoints record it, and the buffer checks a resync by it: a skipped
        # batch makes no version. Skips at this version are not in it: the buffer serves
        # them again to a restart from this version, which skips them again.
        self.last_batch = 0
        self._last: dict[str, float] = {}
        self.metrics: JsonlMetricsSink | None = None
        self.samples: JsonlMetricsSink | None = None
        # One trainer call at a time: a stop drains (a checkpoint) while run() may still be
        # inside a step, and a checkpoint taken mid-step would hold half of it.
        self._busy = asyncio.Lock()
        # A step and its bookkeeping (the ack, the audit row, the publish, the metrics
        # row) are one: a drain waits for the step under way to finish all of it, so a
        # stop never leaves a trained version without its row or its announcement.
        self._stepping = asyncio.Lock()
        self._finished = False  # the run ended (num_steps, or no more data), not a stop
        self.mark: BusyMark | None = None  # set while a step computes (``cores.py``)
        # The newest version a complete checkpoint holds (-1: none is taken). Heartbeats
        # report it: a restart must find a checkpoint only once one was complete, and
        # ``version`` runs ahead of it while a checkpoint is written.
        self.durable = -1
        # The interval checkpoint being written in the background (``async_save``): one
        # at a time, by one thread, awaited before the next checkpoint and on stop.
        self._writer: ThreadPoolExecutor | None = None
        self._writing: asyncio.Future[None] | None = None
        self._said_inline = False  # that checkpoints cannot be written in the background

    async def setup(self) -> None:
        cfg = self.config
        if self.spec.busy_mark:  # set while we compute; clear, the engines take our cores
            self.mark = BusyMark(Path(self.spec.busy_mark))
            self.mark.set(True)  # loading the model; cleared once set up
            self.close_later(self.mark.close)
        self.trainer = await asyncio.to_thread(create_trainer, cfg.trainer, cfg.algo)
        await asyncio.to_thread(self._resume)
        self.version = self.trainer.version
        # Batches after this version are kept by the buffer until a checkpoint covers them.
        self.durable = self.trainer.version if cfg.checkpoint_interval > 0 else -1
        # Flushed per row: a row lost to a crash may be of a batch no restart trains again.
        self.audit = self.open_metrics(cfg.audit_path, flush_every=0) if cfg.audit_path else None
        self.num_steps = cfg.num_steps
        await self._open_channels()
        # Flushed per row (one a step): a row buffered when a kill comes may be of a step
        # at or before the checkpoint the restart resumes from, which is never retrained.
        path = cfg.metrics_path
        self.metrics = self.open_metrics(path, flush_every=0) if path else None
        logged = cfg.samples_path and cfg.log_samples
        self.samples = self.open_metrics(cfg.samples_path, flush_every=0) if logged else None
        if self.mark is not None:
            self.mark.set(False)

    async def _open_channels(self) -> None:
        ep, frame, cfg = self.spec.endpoints, self.max_frame_bytes, self.config
        self.batches: BatchSource
        if cfg.load_dump:  # train-only: no buffer in this job
            skip = self.last_batch if self.last_batch >= 0 else self.trainer.version
            self.batches = DumpedBatches(Path(cfg.load_dump), skip=skip)
        else:
            codec_rep = Codec(BatchReply, max_frame_bytes=frame)
            client = RpcClient(ep["buffer.batches"], Codec(BatchRequest), codec_rep)
            self.batches = BufferBatches(await self.open(client, "batches"), self.name)
        self.dump = BatchWriter(Path(cfg.save_dump)) if cfg.save_dump else None
        announcer = await self.open(
            Publisher(ep["trainer.weights"], ep["trainer.weights_snapshot"], Codec(WeightVersion)),
            "weights",
        )
        publish = cfg.publish
        blob = None
        if publish.transport in ("pull", "dist", "ipc"):  # dist, ipc: for those outside
            server = BlobServer(
                ep["trainer.blob"],
                chunk_bytes=self.wire.chunk_bytes,
                keep=publish.keep,
                max_frame_bytes=frame,
            )
            blob = await self.open(server, "blob")
        group = await self._join_group(publish) if publish.transport == "dist" else None
        self.weights = WeightPublisher(
            announcer,
            transport=publish.transport,
            blob=blob,
            disk_dir=Path(publish.dir) if publish.dir else None,
            group=group,
            keep=publish.keep,
            bucket_bytes=publish.bucket_bytes,
        )
        self.close_later(self.weights.close)

    async def _join_group(self, publish: PublishConfig) -> GroupMembership:
        """Rank 0 of the weight broadcast group: serves its store; the group forms in the
        background as the subscribers join (``weights/group.py``)."""
        cfg = publish.group
        if cfg is None or cfg.rank not in (0, None):
            raise ValueError("publish.transport dist needs publish.group, with rank 0")
        address = cfg.address or self.spec.endpoints["trainer.group"]
        check_group_host(address, trusted=cfg.trusted_network)
        membership = GroupMembership(cfg, rank=0, address=address)
        await asyncio.to_thread(membership.open)
        self.close_later(membership.close)
        return membership

    async def run(self) -> None:
        await self._publish()  # engines and the buffer learn where we start
        waited = 0.0  # since the last step, over every request (empty replies included)
        while not self.stopping and not self._done():
            batch_reply, wait = await self._next_batch()
            waited += wait
            if batch_reply.batch is None:
                if batch_reply.exhausted:
                    self._finished = True
                    self.request_stop("the buffer has no more data")
                continue
            batch = batch_reply.batch
            async with self._stepping:  # a drain comes before this step or after all of it
                if self.stopping:  # its checkpoint may be taken already: train nothing past it
                    log.info("batch left to the buffer: stopping", batch=batch.batch_id)
                    break  # unacknowledged, so the buffer keeps it and serves it again
                async with self._computing():
                    result = await self._train(batch)
                self.batches.done(batch.batch_id)
                self._audit(batch, trained=result is not None)
                if result is not None:
                    self.last_batch = batch.batch_id
                    self._log_samples(batch, result.version)
                    agent = episode_metrics(s for g in batch.groups for s in g.samples)
                    await self._after_step(result, waited, agent)
            waited = 0.0
        if self._done():  # a stop drains: the last acks go out and a checkpoint is taken
            self._finished = True
            self.request_stop(f"trained {self.num_steps} steps")

    @contextlib.asynccontextmanager
    async def _computing(self) -> AsyncIterator[None]:
        """The trainer held (one call at a time: ``_busy``) with its busy mark set, so the
        engines on this machine give back the cores they were lent (``cores.py``)."""
        async with self._busy:
            with self._marked():
                yield

    def _marked(self) -> contextlib.AbstractContextManager[object]:
        return self.mark.busy() if self.mark is not None else contextlib.nullcontext()

    async def _train(self, batch: TrainBatch) -> StepResult | None:
        """One optimizer step on ``batch`` (written to the dump first); None: skipped."""
        if self.dump is not None:
            await asyncio.to_thread(self.dump.write, batch)
        try:
            result = await asyncio.to_thread(self.trainer.train_step, batch)
        except NonFiniteStep as exc:
            self._nonfinite += 1
            if self._nonfinite >= self.config.max_nonfinite_steps:
                raise NonFiniteTraining(
                    f"{self._nonfinite} steps in a row had a NaN or infinite loss or gradient "
                    f"(train.max_nonfinite_steps), the last on batch {batch.batch_id}: {exc}. "
                    "Check the rewards' range, the learning rate and the data"
                ) from None
            self.skipped += 1
            log.error(
                "non-finite step skipped",
                batch=batch.batch_id,
                reason=str(exc),
                in_a_row=self._nonfinite,
            )
            return None
        except UntrainableBatch as exc:  # its groups are accounted for; go on
            self.skipped += 1
            log.warning("batch skipped", batch=batch.batch_id, reason=str(exc))
            return None
        self._nonfinite = 0
        return result

    def _done(self) -> bool:
        """``num_steps`` counts from the initial weights, so a resumed run stops at it too."""
        return self.num_steps > 0 and self.trainer.version >= self.num_steps

    async def _next_batch(self) -> tuple[BatchReply, float]:
        start = time.perf_counter()
        try:
            reply = await self.batches.next(self.trainer.version, self.durable, self.last_batch)
        except RunStateLost as exc:  # the buffer refused our resync: say where we stand
            raise RunStateLost(f"{exc} {self._where_from()}") from None
        return reply, time.perf_counter() - start

    def _where_from(self) -> str:
        """Which weights this trainer started from, for a refused resync's message."""
        cfg = self.config
        start = self._resumed_from or f"the initial weights (no checkpoint in {cfg.checkpoint_dir})"
        text = f"This trainer started from {start}."
        if cfg.checkpoint_interval == 0:
            text += (
                " With --save-interval 0 the trainer writes a checkpoint only when it stops "
                "in order: after a crash a run cannot be resumed"
            )
        return text

    async def _after_step(self, result: StepResult, waited: float, agent: dict[str, float]) -> None:
        self.version = result.version
        self.steps_done += 1
        start = time.perf_counter()
        await self._publish()
        publish_s = time.perf_counter() - start
        self._last = {
            **result.metrics,
            **agent,
            "time/wait_data": waited,
            "time/publish": publish_s,
        }
        if self.metrics is not None:
            self.metrics.write({"actor": self.name, "step": result.version, **self._last})
        if self._writing is not None and self._writing.done():
            await self._settle_write()  # its failure is ours, as a save in the step is
        interval = self.config.checkpoint_interval
        if interval > 0 and result.version % interval == 0:
            await self._checkpoint(background=self.config.async_save)
        log.info("step", version=result.version, loss=result.metrics.get("loss"))

    async def _publish(self) -> None:
        # ipc copies a version into its shared buckets as it publishes: it takes the live
        # weights (a GPU's, for CUDA IPC: no copy through the host), so nothing may step
        # the trainer until that copy is made.
        live = self.weights.transport == "ipc"
        async with self._computing():
            export = partial(self.trainer.export_weights, copy=False) if live else None
            tensors = await asyncio.to_thread(export or self.trainer.export_weights)
            if live:
                await self.weights.publish(self.trainer.version, tensors)
        if not live:
            await self.weights.publish(self.trainer.version, tensors)

    def _log_samples(self, batch: TrainBatch, version: int) -> None:
        if self.samples is not None:
            key = self.config.trainer.reward_key
            for row in sample_rows(batch, version, self.config.log_samples, key):
                self.samples.write(row)

    def _audit(self, batch: TrainBatch, *, trained: bool) -> None:
        """One ``audit_path`` row per batch trained or skipped: its id, its ``step``, the
        trainer version after it and its group uids."""
        if self.audit is not None:
            groups = [g.uid for g in batch.groups]
            self.audit.write(
                {
                    "batch": batch.batch_id,
                    "step": batch.step,
                    "trained": trained,
                    "version": self.trainer.version,
                    "groups": groups,
                }
            )

    # -- checkpoints, acks on stop, commands ----------------------------------------------
    def _resume(self) -> None:
        cfg, incarnation = self.config, self.spec.incarnation
        path: str | Path | None = cfg.resume_from
        root = cfg.checkpoint_dir
        if incarnation.restarted:  # the supervisor restarted us: this job's newest
            path = _newest_checkpoint(root, job=cfg.job) or path
        if not path and cfg.resume:
            path = _newest_checkpoint(root)
        if not path and incarnation.restarted and incarnation.state_expected:
            raise RunStateLost(
                f"the trainer's checkpoints in {root} are gone (deleted or moved while the "
                "job ran): a restart from the initial weights would silently lose the steps "
                "trained. Restore them, or start a new run"
            )
        if path:
            self.trainer.load_checkpoint(Path(path))
            self.last_batch = _last_batch_in(Path(path))
            self._resumed_from = str(path)
            log.info(
                "trainer resumed",
                path=str(path),
                version=self.trainer.version,
                last_batch=self.last_batch,
            )

    async def _checkpoint(self, *, background: bool = False) -> Path | None:
        """A checkpoint of this version; ``background``: from a copy of the state taken
        now, written while training goes on (``_write_later``), else in the step's time.
        Either way ``durable`` moves only once it is on disk."""
        cfg = self.config
        if not cfg.checkpoint_dir:
            return None
        root = Path(cfg.checkpoint_dir)
        async with self._busy:  # the write under way settled and the next begun
            await self._settle_write()  # under one hold: one write of a folder at a time
            # Marked busy only from here: waiting for the writer's I/O lends the cores.
            with self._marked():
                version = self.trainer.version
                path = step_dir(root, version)
                write = await asyncio.to_thread(self._snapshot) if background else None
                if write is not None:
                    self._write_later(write, path, version)
                    return path
                save = self.trainer.save_checkpoint
                await asyncio.to_thread(_save_atomically, save, path, cfg.job, self.last_batch)
        self._made_durable(version)
        if cfg.keep_checkpoints:
            await asyncio.to_thread(_prune_checkpoints, root, cfg.keep_checkpoints, cfg.job)
        return path

    def _snapshot(self) -> Callable[[Path], None] | None:
        write = self.trainer.snapshot_checkpoint()
        if write is None and not self._said_inline:
            self._said_inline = True
            log.info(
                "checkpoints are written in the step's time: this trainer cannot copy its "
                "state aside (several processes, LoRA, or under twice the copy free)"
            )
        return write

    def _write_later(self, write: Callable[[Path], None], path: Path, version: int) -> None:
        """Write ``write``'s copy to ``path`` on the writer thread; ``durable`` moves to
        ``version`` when it is on disk, pruned after it as in the step's time."""
        cfg = self.config
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        job = partial(_write_and_prune, write, path, cfg.job, cfg.keep_checkpoints, self.last_batch)
        start = time.perf_counter()
        self._writing = asyncio.get_running_loop().run_in_executor(self._writer, job)

        def written(done: asyncio.Future[None]) -> None:
            if not done.cancelled() and done.exception() is None:
                self._made_durable(version)
                seconds = round(time.perf_counter() - start, 2)
                log.info("checkpoint written", version=version, seconds=seconds)

        self._writing.add_done_callback(written)

    async def _settle_write(self) -> None:
        """Wait for the background write under way, if any; its error is raised here. A
        cancelled wait leaves it under way and waited for by the next caller: a save of
        the same folder must never start beside it."""
        writing = self._writing
        if writing is None:
            return
        try:
            await asyncio.shield(writing)
        finally:
            if writing.done() and self._writing is writing:
                self._writing = None

    def _made_durable(self, version: int) -> None:
        if self.config.checkpoint_interval > 0:
            self.durable = max(self.durable, version)

    async def teardown(self) -> None:
        try:  # a write under way is finished, not cut: it may be a restart's checkpoint
            await self._settle_write()
        except Exception as exc:  # the actor is ending: say why and go on
            log.error("background checkpoint failed", error=f"{type(exc).__name__}: {exc}")
        if self._writer is not None:
            self._writer.shutdown(wait=False)  # a write left runs to its end before exit
        weights = getattr(self, "weights", None)
        if weights is not None:  # dist: the last broadcast ends (or fails) first
            await weights.settle()
        # A multi-process trainer stops its other ranks (a one-process one has no close).
        close = getattr(getattr(self, "trainer", None), "close", None)
        if close is not None:
            async with self._busy:
                await asyncio.to_thread(close)

    async def drain(self) -> None:
        # Checkpoint first: the buffer releases the batches kept for us once it hears of
        # a checkpoint that covers them, and a kill between the two must lose nothing.
        async with self._stepping:
            await self._checkpoint()
        await self.batches.close(self.trainer.version, self.durable)
        # A stop mid-run (Ctrl-C) has no final version to hand over; nor has a run whose
        # data ran out first: the eval actor's final version is num_steps.
        if self._finished and self._done():
            await self._linger()

    async def _linger(self) -> None:
        """Keep serving the final version until the subscribers named in
        ``publish.final_pullers`` (the eval actor, say) pulled it, for at most
        ``publish.linger_s`` seconds: the weights live in this process and go with it."""
        publish = self.config.publish
        want = list(publish.final_pullers)
        try:
            async with asyncio.timeout(publish.linger_s):
                await self.weights.wait_fetched(want)
        except TimeoutError:
            got = self.weights.fetched()
            log.warning("exiting before the final weights were pulled", want=want, got=got)

    async def on_command(self, cmd: Command) -> dict[str, Scalar]:
        if cmd.kind == "checkpoint":
            path = await self._checkpoint()
            return {"path": str(path or "")}
        return await super().on_command(cmd)

    def stats(self) -> dict[str, float]:
        return {
            "steps": float(self.steps_done),
            "skipped": float(self.skipped),
            CHECKPOINTED_STAT: float(self.durable),
            **self._last,
        }


_JOB_FILE = "job"
_LAST_BATCH_FILE = "last_batch"


def _write_and_prune(
    write: Callable[[Path], None], path: Path, job: str | None, keep: int | None, last_batch: int
) -> None:
    _save_atomically(write, path, job, last_batch)
    if keep:
        _prune_checkpoints(path.parent, keep, job)


def _save_atomically(
    write: Callable[[Path], None], path: Path, job: str | None = None, last_batch: int = -1
) -> None:
    """Save into ``path.tmp`` then rename: a crash mid-save never leaves a partial ``path``,
    and an older ``path`` is moved aside, not deleted, until the new one is in place (a
    checkpoint reported durable must never be missing). ``job`` marks which job wrote it
    (a restart loads only its own job's), ``last_batch`` the batch that made its version;
    this job's checkpoint of the same version is already this state and is kept as it is."""
    if job and path.is_dir() and _written_by(path) == job:
        return
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    if job:
        (tmp / _JOB_FILE).write_text(job)
    if last_batch >= 0:
        (tmp / _LAST_BATCH_FILE).write_text(f"{last_batch}\n")
    _fsync_tree(tmp)  # on disk before the buffer hears it is durable
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    """Every file under ``root`` and every directory entry, flushed to disk: a machine
    crash after the buffer was told this checkpoint is durable must not lose it."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(Path(folder) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))


def _checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    return list(checkpoint_dirs(root).values())


def _newest_checkpoint(root: str | None, *, job: str | None = None) -> Path | None:
    """The newest checkpoint under ``root``; with ``job``, the newest that job wrote."""
    if not root or not Path(root).is_dir():
        return None
    steps = _checkpoints(Path(root))
    if job is not None:
        steps = [p for p in steps if _written_by(p) == job]
    return steps[-1] if steps else None


def _written_by(path: Path) -> str | None:
    marker = path / _JOB_FILE
    return marker.read_text() if marker.is_file() else None


def _last_batch_in(path: Path) -> int:
    """The batch that made the version of the checkpoint at ``path``; -1 when it does not
    say (written before this was recorded, or by another tool)."""
    marker = path / _LAST_BATCH_FILE
    if not marker.is_file():
        return -1
    text = marker.read_text().strip()
    if not text.isdigit():
        raise CheckpointUnreadable(
            f"{marker}: {text[:40]!r} is not a batch id: the checkpoint is damaged; "
            "restore it from a copy, or resume from an earlier step (--resume-from-step)"
        )
    return int(text)


def _prune_checkpoints(root: Path, keep: int, job: str | None = None) -> None:
    """Remove all but the newest ``keep`` checkpoints; with ``job``, of that job's and of
    the earlier jobs it resumed (steps below its first). Another job's higher steps are
    neither counted nor removed: counted, they would prune each new checkpoint of this
    job as it is written, and a restart would find none to resume from. Uncounted, the
    lower ones would stay forever, a run's disk growing by ``keep`` at every resume."""
    found = _checkpoints(root)
    mine = [p for p in found if job is None or _written_by(p) == job]
    if job is not None and mine:
        first = _step_of(mine[0])
        mine = [p for p in found if p in mine or _step_of(p) < first]
    for path in mine[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def _step_of(path: Path) -> int:
    step = step_of(path.name)
    assert step is not None  # checkpoint_dirs found it
    return step
