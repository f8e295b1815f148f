"""BufferActor: where rollout producers and the trainer meet (``docs/design.md`` section 2).

It hands out work, takes results, serves batches and publishes APRIL's aborts and cuts;
all policy lives in ``VersionedBuffer``, behind a journaled ``Hub``. A request waits up
to its ``wait`` seconds for something to hand out rather than polling: every state
change wakes the waiters. The journal is committed before any reply or ack goes out, so
a restarted buffer has all it told anyone (``docs/reliability.md``, the buffer's journal).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

from asyncrl.actors.base import Actor, ActorSpec
from asyncrl.actors.config import BufferActorConfig
from asyncrl.buffer.accounting import FailureWatch
from asyncrl.buffer.admission import fair_share
from asyncrl.buffer.checkpoint import recover_hub, write_checkpoint
from asyncrl.buffer.hub import Hub
from asyncrl.buffer.journal import Journal
from asyncrl.buffer.sources import PromptSource
from asyncrl.buffer.versioned import BufferStats, VersionedBuffer
from asyncrl.checkpoints import prune_snapshots, rewind_hint, snapshot_path
from asyncrl.errors import RunStateLost, SamplesFailing
from asyncrl.observe.logs import get_logger
from asyncrl.types import BatchReply, BatchRequest, BufferEvent, Group, WorkReply, WorkRequest
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import Command, Scalar, WeightVersion
from asyncrl.wire.pubsub import Publisher, Subscriber
from asyncrl.wire.reliable import ReliableReceiver
from asyncrl.wire.rpc import RpcServer

log = get_logger("asyncrl.buffer")

#: A producer that asked for work this recently (seconds) still gets its share; producers
#: ask about once a second (each request waits up to a second) while they have free slots.
_LIVE_S = 5.0


def _engine_was_down(group: Group) -> bool:
    """A sample failed because its engine could not be reached (a remote engine restarting)."""
    return any((s.error or "").startswith("EngineUnavailable") for s in group.samples)


class BufferActor(Actor):
    """Serves work and batches from a ``VersionedBuffer``; see the module docstring."""

    Config = BufferActorConfig
    config: BufferActorConfig

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        self.hub: Hub | None = None  # heartbeats may ask for stats while setup runs
        self._checkpointed_at = time.monotonic()
        self._snapshot_at = -1  # the newest durable step kept as a snapshot

    async def setup(self) -> None:
        config = self.config
        source = await asyncio.to_thread(_open_source, config)  # tokenizing: off the loop
        self.buffer = VersionedBuffer(config.buffer.model_copy(), source)
        journal = Path(config.journal) if config.journal else None
        fsync = config.journal_fsync
        hub = Hub(self.buffer, Journal(journal, fsync=fsync) if journal else None)
        if hub.journal is not None:
            self.close_later(hub.journal.close)  # after the channels: no commit comes later
        hub.job = config.job
        self.checkpoint_path = Path(config.checkpoint) if config.checkpoint else None
        if self.spec.incarnation.restarted or config.resume:
            await asyncio.to_thread(self._recover, hub, journal)
        self.hub = hub  # only now: stats() reads it, and recovery ran in a thread
        self._checkpoint()  # a fresh lineage's first, or what recovery rebuilt
        self.version = self.buffer.version
        self._waiters: set[asyncio.Future[None]] = set()
        self._aborted_at = -1
        self._outcomes: dict[str, int] = defaultdict(int)
        cfg = self.buffer.config
        self._failures = FailureWatch(cfg.failure_window, cfg.max_failed_share)
        self.colocate = config.colocate
        # Colocated: actor -> engines released; an actor not heard from yet is awake.
        self._asleep = dict.fromkeys(config.rollout_actors, False)
        # Producer -> loop time it last asked for work (the configured ones: from now, so
        # the first to ask does not take a whole step before the others have started).
        now = asyncio.get_running_loop().time()
        self._asked = dict.fromkeys(config.rollout_actors, now)
        await self._open_channels()
        path = config.metrics_path
        self.metrics = self.open_metrics(path) if path else None

    async def _open_channels(self) -> None:
        ep, frame, hwm = self.spec.endpoints, self.max_frame_bytes, self.wire.hwm
        work, batch = Codec(WorkRequest, max_frame_bytes=frame), Codec(BatchRequest)
        await self.open(
            RpcServer(
                ep["buffer.work"],
                work,
                Codec(WorkReply, max_frame_bytes=frame),
                self._serve_work,
                hwm=hwm,
            ),
            "work",
        )
        await self.open(
            RpcServer(
                ep["buffer.batches"],
                batch,
                Codec(BatchReply, max_frame_bytes=frame),
                self._serve_batch,
                hwm=hwm,
            ),
            "batches",
        )
        self.results = await self.open(
            ReliableReceiver(ep["buffer.results"], Codec(Group, max_frame_bytes=frame), hwm=hwm),
            "results",
        )
        self.events = await self.open(
            Publisher(ep["buffer.events"], ep["buffer.events_snapshot"], Codec(BufferEvent)),
            "events",
        )
        self.weights = None
        if "trainer.weights" in ep:
            self.weights = await self.open(
                Subscriber(
                    ep["trainer.weights"],
                    ep["trainer.weights_snapshot"],
                    Codec(WeightVersion, max_frame_bytes=frame),
                    ["weights"],
                ),
                "weights",
            )

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            loops = [
                tg.create_task(self._results_loop(), name="buffer.results"),
                tg.create_task(self._checkpoint_loop(), name="buffer.checkpoints"),
            ]
            if self.weights is not None:
                loops.append(tg.create_task(self._versions_loop(), name="buffer.versions"))
            if self.metrics is not None:
                loops.append(tg.create_task(self._metrics_loop(), name="buffer.metrics"))
            await self.wait_stopping()
            for task in loops:  # a stop ends the loops; their failures still propagate
                task.cancel()

    # -- producers -----------------------------------------------------------------------
    async def _serve_work(self, req: WorkRequest, peer: bytes) -> WorkReply:
        self._note_sleep(req.actor, req.asleep)
        self._asked[req.actor] = asyncio.get_running_loop().time()
        if self.hub.is_retry(req.actor, req.request):
            # Its reply was lost: the groups are the actor's whatever happened since (a
            # new version, a stop), or they would stay in flight with no one on them.
            items = self.hub.hand_out(req.actor, req.request, req.max_items)
            return WorkReply(items=items, version=self.buffer.version)
        if self.stopping or self._behind(req):
            return WorkReply(items=[], version=self.buffer.version)
        await self._wait_until(
            lambda: self._share(req.actor) > 0 or self._wake_to_sleep(req), req.wait
        )
        if self._behind(req):  # a new version came while we waited: load it first
            return WorkReply(items=[], version=self.buffer.version)
        share = min(max(0, req.max_items), self._share(req.actor))
        items = self.hub.hand_out(req.actor, req.request, share)
        self._commit()
        exhausted = not items and self._no_more_work()
        sleep = self.colocate and not items and not exhausted
        return WorkReply(items=items, version=self.buffer.version, exhausted=exhausted, sleep=sleep)

    def _behind(self, req: WorkRequest) -> bool:
        """The actor's engines serve an older version than admission would stamp."""
        return 0 <= req.version < self.buffer.version

    def _wake_to_sleep(self, req: WorkRequest) -> bool:
        """End the wait at once: the data is used up, or (colocated) a full batch waits
        for the trainer, so an awake actor should go to sleep now rather than later."""
        if self._no_more_work():
            return True
        # ready() runs the staleness backstop: only colocated jobs pay for it here.
        return self.colocate and not req.asleep and self.buffer.ready()

    def _note_sleep(self, actor: str, asleep: bool) -> None:
        if self.colocate and self._asleep.get(actor) != asleep:
            self._asleep[actor] = asleep
            self._notify()  # the trainer may be waiting for the last engine to sleep

    def _batch_ready(self, n: int) -> bool:
        """``n`` groups are done and, colocated, every rollout actor (``rollout_actors``,
        and any other that asked for work) has released its engines."""
        return self.buffer.ready(n) and (not self.colocate or all(self._asleep.values()))

    def _can_serve(self, n: int) -> bool:
        """A batch the trainer lost is served again (colocated: once the engines sleep,
        as for any batch), else a new one when ready or at the end of the data."""
        if self.hub.lost_batch() is not None:
            return not self.colocate or all(self._asleep.values())
        return self._batch_ready(n) or self.buffer.exhausted

    def _share(self, actor: str) -> int:
        """The groups ``actor`` may take now: its fair share (``admission.fair_share``) of
        the partials to resume and the new groups admission allows, over the producers
        that asked within ``_LIVE_S``. A producer whose slots are full does not ask, so it
        drops out rather than keep a share no one else may take."""
        if self._no_more_work():
            return 0
        held = {a: len(uids) for a, uids in self.hub.holders.items() if uids}
        since = asyncio.get_running_loop().time() - _LIVE_S
        live = {a for a, t in self._asked.items() if t >= since}
        return fair_share(available=self.buffer.available(), held=held, actor=actor, producers=live)

    def _no_more_work(self) -> bool:
        return self.buffer.source_done and not len(self.buffer.pool)

    async def _results_loop(self) -> None:
        while True:
            received = await self.results.receive_batch()
            for group in received:
                self._record(group)
            self._commit()
            received.ack()  # only once journaled: an unacked result is redelivered
            self._check_failures()
            self._maybe_abort()
            self._notify()

    def _record(self, group: Group) -> None:
        outcome = self.hub.put(group)
        self._outcomes[outcome] += 1
        if not (outcome == "failed" and _engine_was_down(group)):
            self._failures.record(outcome)  # an engine outage passes: not the job's fault
        if outcome in ("failed", "filtered"):
            log.debug("group dropped", group=group.uid, outcome=outcome)

    def _check_failures(self) -> None:
        """End the job (a permanent error) once samples keep failing; see ``FailureWatch``."""
        watch = self._failures
        if not watch.tripped():
            return
        failed = Counter(self.buffer.ledger.failed).most_common(3)
        reasons = "; ".join(f"{n} x [{reason}]" for reason, n in failed)
        raise SamplesFailing(
            f"samples keep failing: {sum(watch.recent)} of the last {watch.window} finished "
            f"groups failed (limit buffer.max_failed_share {watch.max_share}); the commonest "
            f"reasons over the run: {reasons}"
        )

    def _maybe_abort(self) -> None:
        if self.buffer.should_abort() and self._aborted_at != self.buffer.version:
            self._aborted_at = self.buffer.version
            self.events.publish("events", BufferEvent(kind="abort", version=self.version))

    # -- the trainer ---------------------------------------------------------------------
    async def _serve_batch(self, req: BatchRequest, peer: bytes) -> BatchReply:
        try:
            self.hub.settle(req.version, req.ack, req.durable, req.resync, req.last_batch)
        except RunStateLost as exc:  # the trainer fails with it; the buffer state stands
            files = [str(p) for p in (self.checkpoint_path, self.hub.journal_path) if p]
            where = f"the buffer's state: {' and '.join(files)}"
            if self.hub.journal_path is None:
                where += (
                    "; runtime.journal is off, so that state is the last checkpoint "
                    "(runtime.buffer_checkpoint_interval), not the moment of a crash"
                )
            log.error("the trainer cannot continue this buffer state", error=str(exc))
            raise RunStateLost(f"{exc} ({where}){self._rewind_hint()}") from None
        self.version = self.buffer.version  # a resync may have rebased it
        self._follow_version(req.version)
        self._commit()
        if self.hub.durable > self._snapshot_at:
            self._snapshot(self.hub.durable)
        if not req.take:
            return BatchReply(batch=None)
        n = req.num_groups or self.buffer.config.groups_per_step
        ready = await self._wait_until(lambda: self._can_serve(n), req.wait)
        if not ready:
            return BatchReply(batch=None)
        batch = self.hub.take(n)
        self._commit()
        if batch is not None:
            self._notify()
        return BatchReply(batch=batch, exhausted=batch is None and self.buffer.exhausted)

    async def _versions_loop(self) -> None:
        assert self.weights is not None
        while True:
            update = await self.weights.receive()
            self._follow_version(update.msg.version)
            self._commit()

    def _follow_version(self, version: int) -> None:
        if version > self.buffer.version:
            if self.hub.follow(version):
                groups = self.buffer.cancelled
                log.info("stale groups cut in flight", version=version, groups=len(groups))
                self.events.publish("cancel", BufferEvent("cancel", version, groups))
            self.version = version
            self._notify()

    # -- waiting -------------------------------------------------------------------------
    def _notify(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    async def _wait_until(self, ready: Callable[[], bool], seconds: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, seconds)
        while not ready():
            remaining = deadline - loop.time()
            if remaining <= 0 or self.stopping:
                return False
            fut = loop.create_future()
            self._waiters.add(fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                return ready()
            finally:
                self._waiters.discard(fut)
        return True

    # -- commands, checkpoints, metrics --------------------------------------------------
    async def on_command(self, cmd: Command) -> dict[str, Scalar]:
        """``requeue`` (``actor=NAME``: its in-flight work goes back to be resumed; the
        supervisor sends it when a producer dies) and ``checkpoint`` (``path=FILE``: a copy)."""
        if cmd.kind == "requeue":
            return {"requeued": self.requeue_actor(str(cmd.args.get("actor", "")))}
        if cmd.kind == "checkpoint":
            write_checkpoint(self.hub.state_dict(), Path(str(cmd.args["path"])))
            return {"path": str(cmd.args["path"])}
        return await super().on_command(cmd)

    def requeue_actor(self, actor: str) -> int:
        """Put the in-flight work of ``actor`` (it died) back to be handed out again."""
        n = self.hub.requeue(actor)
        self._commit()
        self._asleep.pop(actor, None)  # a dead actor's engines hold nothing to wait for
        self._asked.pop(actor, None)  # nor a share to keep for it
        log.warning("requeued in-flight work", actor=actor, groups=n)
        if n:
            self._notify()
        return n

    # -- crash safety --------------------------------------------------------------------
    def _recover(self, hub: Hub, journal: Path | None) -> None:
        """Rebuild ``hub`` from the checkpoint and the journal after it.

        A restart (``recover``) continues this job's state; a resumed job (``resume``)
        takes the state another job left, makes it its own (a checkpoint and a fresh
        journal first, so that a crash from here on recovers as this job) and requeues
        what the old producers held. State that a previous incarnation wrote and that is
        gone now (``state_expected``) is an error, never a fresh start."""
        start, resume = time.monotonic(), self.config.resume
        path = self.checkpoint_path
        if path is None:
            raise ValueError("buffer recovery needs config.checkpoint")
        self._check_state_kept(path, journal, self.spec.incarnation.state_expected)
        if not path.exists():
            log.warning("no buffer checkpoint yet: the buffer starts fresh", checkpoint=str(path))
            return
        if resume and journal is not None and not journal.exists():
            # Expected after --resume-from-step (the journal is moved aside) or a job run
            # without one; otherwise what it recorded is gone, and the trainer's resync
            # refuses a state it has outrun.
            log.warning(
                "no buffer journal after the checkpoint: resuming from the checkpoint alone "
                "(expected after --resume-from-step or a job without runtime.journal)",
                checkpoint=str(path),
                journal=str(journal),
            )
        job = hub.job
        try:
            replayed = recover_hub(hub, path, journal)
        except RunStateLost as exc:  # a damaged journal: say where to go back to
            raise RunStateLost(f"{exc}{self._rewind_hint()}") from exc
        written_by, hub.job = hub.job, job
        if written_by != job and not resume:
            raise RunStateLost(
                f"{path} holds the buffer of another job ({written_by}), not this one's: "
                "the run directory was reused; continue that run with --resume or "
                "start over with --overwrite"
            )
        # A resumed job's first buffer takes the old job's state; so does a restart of it
        # that died before making that state its own (the checkpoint is still the old one).
        requeued = 0
        if resume and (not self.spec.incarnation.restarted or written_by != job):
            self._persist(hub)
            requeued = hub.requeue_all()
        hub.commit()
        log.info(
            "buffer restored",
            checkpoint=str(path),
            version=self.buffer.version,
            journal_records=replayed,
            requeued=requeued,
            resumed_from=written_by if written_by != job else None,
            seconds=round(time.monotonic() - start, 3),
        )

    def _check_state_kept(self, path: Path, journal: Path | None, expected: bool) -> None:
        """A previous incarnation of this buffer wrote a checkpoint and, with journaling,
        a journal after it: both must still be there."""
        if not expected:
            return
        missing = [p for p in (path, journal) if p is not None and not p.exists()]
        if missing:
            names = " and ".join(str(p) for p in missing)
            raise RunStateLost(
                f"the buffer's state is gone ({names} deleted or moved while the job ran): "
                "restarting from nothing would hand out prompts the trainer has consumed "
                f"again. Restore the files, or start a new run{self._rewind_hint()}"
            )

    def _commit(self) -> None:
        """Journal what changed before anyone hears of it. A failed write leaves memory
        ahead of the journal, so the buffer stops at once (no reply or ack goes out) and
        its restart recovers the journal's state, which is what everyone was told."""
        try:
            self.hub.commit()
        except OSError as exc:
            log.critical("journal write failed: stopping the buffer now", error=str(exc))
            os._exit(70)

    def _checkpoint(self) -> None:
        """Checkpoint, then start a fresh journal after it: at start, every
        ``checkpoint_interval`` seconds, when the journal passes ``journal_max_bytes``, and
        on stop."""
        if self.checkpoint_path is None:
            return
        self._commit()
        self._persist(self.hub)

    def _rewind_hint(self) -> str:
        snapshots, trainer = self.config.snapshots, self.config.trainer_checkpoints
        return rewind_hint(Path(snapshots), Path(trainer)) if snapshots and trainer else ""

    def _snapshot(self, step: int) -> None:
        """Keep the state as of the trainer's durable checkpoint of ``step``, for
        ``--resume-from-step`` (``checkpoints.py``). A write that fails costs only
        that way back: the trainer's request is answered, and the next one tries again."""
        config = self.config
        if not config.snapshots or not config.trainer_checkpoints:
            self._snapshot_at = step
            return
        snapshots, trainer = Path(config.snapshots), Path(config.trainer_checkpoints)
        try:
            write_checkpoint(self.hub.state_dict(), snapshot_path(snapshots, step))
            prune_snapshots(snapshots, step, trainer)
        except OSError as exc:
            log.warning("buffer snapshot not written", step=step, error=str(exc))
            return
        self._snapshot_at = step

    def _persist(self, hub: Hub) -> None:
        """Write ``hub``'s committed state as the checkpoint and start the journal after it."""
        assert self.checkpoint_path is not None
        write_checkpoint(hub.state_dict(), self.checkpoint_path)
        if hub.journal is not None:
            hub.journal.reset(hub.lineage, hub.journal_seq + 1)
        self._checkpointed_at = time.monotonic()

    async def _checkpoint_loop(self) -> None:
        interval = self.config.checkpoint_interval
        max_bytes = self.config.journal_max_bytes
        journal = self.hub.journal
        while True:
            await asyncio.sleep(min(1.0, interval))
            due = time.monotonic() - self._checkpointed_at >= interval
            if due or (journal is not None and journal.bytes_written >= max_bytes):
                self._checkpoint()

    async def drain(self) -> None:
        self._write_metrics()  # the last row holds the final accounting
        self._checkpoint()

    def stats(self) -> dict[str, float]:
        if self.hub is None:
            return {}
        return {**flatten_stats(self.buffer.statistics()), **self._hub_stats()}

    def _hub_stats(self) -> dict[str, float]:
        """Batches handed to the trainer and kept for it: not acknowledged (it holds them,
        or lost them and is served them again), and in all (kept until a checkpoint)."""
        hub = self.hub
        assert hub is not None
        unacked = [b for i, b in hub.outstanding.items() if i not in hub.acked]
        return {
            "unacked_batches": len(unacked),
            "buffer.unacked_groups": sum(len(b.groups) for b in unacked),
            "buffer.kept_batches": len(hub.outstanding),
            "buffer.journal_seq": hub.journal_seq,
        }

    async def _metrics_loop(self) -> None:
        interval = self.config.metrics_interval
        while True:
            await asyncio.sleep(interval)
            self._write_metrics()

    def _write_metrics(self) -> None:
        if self.metrics is not None:
            full = self.buffer.statistics()  # the histograms too, not just their means
            self.metrics.write(
                {
                    "actor": self.name,
                    **flatten_stats(full),
                    **self._hub_stats(),
                    "buffer.unacked_batch_ids": sorted(
                        i for i in self.hub.outstanding if i not in self.hub.acked
                    ),
                    "buffer.staleness_samples": full.staleness_samples,
                    "buffer.staleness_tokens": full.staleness_tokens,
                    "buffer.data_too_long": getattr(self.buffer.source, "too_long", 0),
                }
            )


def flatten_stats(s: BufferStats) -> dict[str, float]:
    """Buffer statistics as flat ``buffer.*`` numbers for heartbeats and metrics."""
    c = s.ledger
    out: dict[str, float] = {
        f"buffer.{k}": float(getattr(c, k))
        for k in ("admitted", "in_flight", "partial", "buffered", "consumed")
    }
    out |= {
        f"buffer.{k}": float(getattr(s, k))
        for k in (
            "version",
            "duplicates",
            "capacity",
            "peak_buffered",
            "batches",
            "resumed_consumed",
            "masked_tokens",
            "queue_age_max",
            "lost_steps",
        )
    }
    out.update({f"buffer.filtered.{k}": float(v) for k, v in c.filtered.items()})
    out.update({f"buffer.failed.{k[:60]}": float(v) for k, v in c.failed.items()})
    out["buffer.staleness_mean"] = _mean(s.staleness_samples)
    out["buffer.staleness_max"] = float(max(s.staleness_samples, default=0))
    out["buffer.token_staleness_mean"] = _mean(s.staleness_tokens)
    out["buffer.recycled_share"] = s.resumed_consumed / c.consumed if c.consumed else 0.0
    return out


def _mean(hist: dict[int, int]) -> float:
    total = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / total if total else 0.0


def _open_source(config: BufferActorConfig) -> PromptSource | None:
    if config.source is None:
        return None
    tokenizer = None
    if config.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    return PromptSource.open(config.source.model_copy(), tokenizer)
