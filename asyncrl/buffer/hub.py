"""The hub's whole state, every change journaled: what the BufferActor keeps and restores.

``Hub`` wraps the ``VersionedBuffer`` with what must also survive a crash: which producer
holds which groups (``holders``), each producer's last request (``requests``: a retry
after a lost reply gets the same groups), and the batches handed to the trainer and not
yet released (``outstanding``). Every mutating method queues a journal record;
``commit()`` writes them, and ``replay()`` re-applies them, checking each call's result.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import msgspec

from asyncrl.buffer.journal import (
    Followed,
    Handed,
    Journal,
    Record,
    Requeued,
    Returned,
    Settled,
    Taken,
    lineage_token,
)
from asyncrl.buffer.versioned import BufferState, VersionedBuffer
from asyncrl.errors import RunStateLost
from asyncrl.observe.logs import get_logger
from asyncrl.types import Group, Sample, TrainBatch, WorkItem
from asyncrl.wire.codec import Message

log = get_logger("asyncrl.buffer")


class ReplayDiverged(RuntimeError):
    """A journal record did not replay to what it recorded."""


class LastRequest(Message):
    """A producer's last work request (its id) and the groups it was given."""

    request: str
    uids: list[str]


class HubState(Message):
    """A hub checkpoint: the buffer's state plus the hub's, and the journal position.

    ``journal_seq``: the last journal record this state includes; ``lineage``: the
    journal lineage it continues (see ``asyncrl.buffer.journal``).
    """

    lineage: str
    journal_seq: int
    buffer: BufferState
    holders: dict[str, list[str]]
    requests: dict[str, LastRequest]
    outstanding: list[TrainBatch]
    acked: list[int]
    durable: int
    resyncing: bool
    job: str = ""


class Hub:
    """The buffer actor's state machine; see the module docstring."""

    def __init__(self, buffer: VersionedBuffer, journal: Journal | None = None) -> None:
        self.buffer = buffer
        self.journal = journal
        self.lineage = lineage_token()
        self.job = ""  # the job that owns this state (a restart refuses another job's)
        self.journal_seq = 0  # the last record applied (written, or replayed)
        self.holders: dict[str, set[str]] = defaultdict(set)
        self.requests: dict[str, LastRequest] = {}
        self.outstanding: dict[int, TrainBatch] = {}  # batch id -> batch, in id order
        self.acked: set[int] = set()
        self.durable = -1
        self.resyncing = False  # after a resync: unacknowledged batches are served first
        self._records: list[Record] = []
        self._applying = False

    @property
    def journal_path(self) -> Path | None:
        """Where the journal is written (None: not journaled)."""
        return self.journal.path if self.journal is not None else None

    # -- producers -----------------------------------------------------------------------
    def is_retry(self, actor: str, request: str) -> bool:
        """``actor`` asks again with the id of its last request that was given work."""
        last = self.requests.get(actor)
        return bool(request) and last is not None and last.request == request

    def hand_out(self, actor: str, request: str, max_items: int) -> list[WorkItem]:
        """Up to ``max_items`` groups for ``actor``; the same request id again (the reply
        was lost) returns what it got then that is still in flight with it."""
        if self.is_retry(actor, request):
            last = self.requests[actor]
            held = self.holders.get(actor, set())
            items = [self.buffer.work_item(u) for u in last.uids if u in held]
            return [i for i in items if i is not None]
        items = self.buffer.next_work(max_items)
        if items:
            uids = [i.group_uid for i in items]
            self.holders[actor].update(uids)
            self.requests[actor] = LastRequest(request, uids)
            self._log(Handed(actor=actor, request=request, max_items=max_items, uids=uids))
        return items

    def put(self, group: Group) -> str:
        """Take a result (``VersionedBuffer.put``); returns its outcome."""
        # ``put`` may rewrite samples (masking resumed tokens): journal them as they came.
        received = _snapshot(group) if self.journal is not None else group
        outcome = self.buffer.put(group)
        if outcome != "duplicate":
            for uids in self.holders.values():
                uids.discard(group.uid)
            self._log(Returned(group=received, outcome=outcome))
        return outcome

    def requeue(self, actor: str) -> int:
        """The in-flight work of ``actor`` (it died) goes back to be resumed."""
        held = self.holders.pop(actor, set())
        last = self.requests.pop(actor, None)
        n = self.buffer.requeue(sorted(held))
        if held or last is not None:
            self._log(Requeued(actor=actor))
        return n

    def requeue_all(self) -> int:
        """Every producer's work goes back (the producers are gone: a new job)."""
        return sum(self.requeue(actor) for actor in sorted(self.holders))

    # -- the trainer ---------------------------------------------------------------------
    def follow(self, version: int) -> list[str]:
        """The trainer reached ``version`` (older announcements are ignored); returns the
        in-flight groups that version cut (``VersionedBuffer.set_version``)."""
        if version <= self.buffer.version:
            return []
        cancelled = self.buffer.set_version(version)
        self._log(Followed(version=version))
        return cancelled

    def settle(
        self, version: int, acks: Iterable[int], durable: int, resync: bool, last_batch: int = -1
    ) -> None:
        """A trainer request's acks, its durable version and (first request of a trainer
        incarnation, or one whose reply was lost) a resync at its ``version``: every kept
        batch from it on is served again, in order, before any new one (``_resync``). A
        batch is released once acknowledged and, with ``durable >= 0``, once a checkpoint
        covers it (``step < durable``). ``last_batch``: the batch that made the trainer's
        version (-1: unknown), checked against those handed out."""
        if resync and not self._applying:
            self._check_resync(version, last_batch)  # before any change: a refusal leaves the state
        acks = [a for a in acks if a in self.outstanding and a not in self.acked]
        if not acks and durable == self.durable and not resync:
            return
        self.acked.update(acks)
        self.durable = durable
        if resync:
            self._resync(version)
        self._release()
        # Replaying ends with the last lost batch acknowledged (decided here, in a
        # journaled call, so that a replay of the journal ends it at the same point).
        self.resyncing = self.resyncing and self._first_unacked() is not None
        self._log(Settled(version=version, acks=acks, durable=durable, resync=resync))

    def _check_resync(self, version: int, last_batch: int = -1) -> None:
        """``RunStateLost`` when a trainer at ``version``, made by batch ``last_batch``,
        cannot continue this state exactly: it holds a batch the buffer never handed out
        (the buffer's journal or checkpoint lost records: it would serve trained groups
        again; skipped batches make no version, so ``last_batch`` is the exact test), or
        it is behind the batches kept for it (its checkpoints are gone: the steps between
        would be lost, or trained twice)."""
        if version < 0:
            return
        taken = self.buffer.batches_taken
        if version > taken or last_batch > taken:
            holds = (
                f"holds batch {last_batch} (its version's, after skipped ones)"
                if last_batch > taken
                else f"is at version {version}"
            )
            raise RunStateLost(
                f"the trainer {holds}, but the buffer's state records only "
                f"{taken} batches handed out: the buffer's journal or checkpoint lost records "
                "(deleted, cut short, or an older copy), and going on would train consumed "
                "groups again"
            )
        kept = [b.step for b in self.outstanding.values() if b.step >= version]
        if version < self.buffer.version and version not in kept:
            raise RunStateLost(
                f"the trainer resumed at version {version}, but it had reached version "
                f"{self.buffer.version} (its newest checkpoint the buffer heard of: "
                f"{self.durable}) and the batches kept for a restart start at "
                f"{min(kept, default=None)}: the trainer's checkpoints are gone or older "
                "than the buffer's state, and the steps between would be lost"
            )

    def _resync(self, version: int) -> None:
        """Serve again every outstanding batch from ``version`` on; if they do not reach
        back to it, the steps between are lost: rebase (only in the replay of a journal
        written before ``_check_resync`` refused this). Batches before ``version`` are in
        the trainer's weights (trained, then the trainer died before acknowledging them):
        acknowledged now, never served again. An unknown version (< 0): serve again what
        was never acknowledged."""
        self.resyncing = True
        if version < 0:
            return
        self.acked.update(i for i, b in self.outstanding.items() if b.step < version)
        again = [b for b in self.outstanding.values() if b.step >= version]
        if version < self.buffer.version and not any(b.step == version for b in again):
            lost = self.buffer.version - version
            log.error(
                "the trainer resumed behind the batches kept for it: steps lost",
                trainer_version=version,
                buffer_version=self.buffer.version,
                kept_from=min((b.step for b in again), default=None),
                lost_steps=lost,
            )
            self.outstanding.clear()
            self.acked.clear()
            self.buffer.rebase(version)
            return
        self.acked.difference_update(b.batch_id for b in again)
        if again and not self._applying:
            log.warning("serving batches again", version=version, batches=len(again))

    def _release(self) -> None:
        for batch_id, batch in list(self.outstanding.items()):
            covered = self.durable < 0 or batch.step < self.durable
            if batch_id in self.acked and covered:
                del self.outstanding[batch_id]
                self.acked.discard(batch_id)

    def lost_batch(self) -> TrainBatch | None:
        """After a resync: the lowest outstanding batch not acknowledged, which the
        trainer lost and gets before any new one. None otherwise."""
        return self._first_unacked() if self.resyncing else None

    def _first_unacked(self) -> TrainBatch | None:
        for batch_id, batch in self.outstanding.items():
            if batch_id not in self.acked:
                return batch
        return None

    def take(self, n: int) -> TrainBatch | None:
        """A lost batch again, else a new batch of ``n`` groups (or None)."""
        batch = self.lost_batch()
        if batch is not None:
            return batch
        batch = self.buffer.take_batch(n)
        if batch is not None:
            self.outstanding[batch.batch_id] = batch
            uids = [g.uid for g in batch.groups]
            self._log(Taken(n=n, version=batch.step, batch_id=batch.batch_id, uids=uids))
        return batch

    # -- journal -------------------------------------------------------------------------
    def _log(self, record: Record) -> None:
        if not self._applying:
            self._records.append(record)

    def commit(self) -> None:
        """Write the records queued since the last commit (before answering anyone)."""
        if not self._records:
            return
        records, self._records = self._records, []
        if self.journal is not None:
            self.journal_seq = self.journal.append(records)
        else:
            self.journal_seq += len(records)

    def replay(self, records: Iterable[tuple[int, Record]]) -> int:
        """Re-apply journal records after ``journal_seq``; returns how many applied."""
        self._applying, applied = True, 0
        try:
            for seq, record in records:
                if seq <= self.journal_seq:
                    continue  # already in the checkpoint
                if seq != self.journal_seq + 1:
                    raise ReplayDiverged(f"journal jumps from seq {self.journal_seq} to {seq}")
                self._apply(record)
                self.journal_seq, applied = seq, applied + 1
        finally:
            self._applying = False
        return applied

    def _apply(self, r: Record) -> None:
        if isinstance(r, Handed):
            got = [i.group_uid for i in self.hand_out(r.actor, r.request, r.max_items)]
            _check(got == r.uids, r, got)
        elif isinstance(r, Returned):
            outcome = self.put(r.group)
            _check(outcome == r.outcome, r, outcome)
        elif isinstance(r, Requeued):
            self.requeue(r.actor)
        elif isinstance(r, Followed):
            self.follow(r.version)
        elif isinstance(r, Settled):
            self.settle(r.version, r.acks, r.durable, r.resync)
        elif isinstance(r, Taken):
            batch = self.take(r.n)
            got = (batch.batch_id, [g.uid for g in batch.groups]) if batch else None
            _check(got == (r.batch_id, r.uids), r, got)

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> HubState:
        """Everything to continue from, as of the last committed record."""
        if self._records:
            raise RuntimeError("commit() before taking a checkpoint")
        return HubState(
            lineage=self.lineage,
            journal_seq=self.journal_seq,
            buffer=self.buffer.state_dict(),
            holders={a: sorted(u) for a, u in self.holders.items() if u},
            requests=dict(self.requests),
            outstanding=list(self.outstanding.values()),
            acked=sorted(self.acked),
            durable=self.durable,
            resyncing=self.resyncing,
            job=self.job,
        )

    def load_state_dict(self, state: HubState) -> None:
        """Continue exactly from ``state`` (in-flight work stays with its holders)."""
        self.buffer.load_state_dict(state.buffer, requeue_in_flight=False)
        self.lineage, self.journal_seq = state.lineage, state.journal_seq
        self.holders = defaultdict(set, {a: set(u) for a, u in state.holders.items()})
        self.requests = dict(state.requests)
        self.outstanding = {b.batch_id: b for b in state.outstanding}
        self.acked, self.durable = set(state.acked), state.durable
        self.resyncing = state.resyncing
        self.job = state.job


def _snapshot(group: Group) -> Group:
    """A copy of ``group`` that rewriting its samples' columns leaves alone (the columns
    are immutable bytes: copying the records is enough)."""
    return msgspec.structs.replace(group, samples=[_copy(s) for s in group.samples])


def _copy(sample: Sample) -> Sample:
    branches = [msgspec.structs.replace(b) for b in sample.branches]
    return msgspec.structs.replace(sample, branches=branches)


def _check(ok: bool, record: Record, got: object) -> None:
    if not ok:
        raise ReplayDiverged(
            f"journal record {type(record).__name__} replayed to {got!r}, recorded "
            f"otherwise; a custom filter or priority that is not deterministic cannot be "
            f"replayed"
        )
