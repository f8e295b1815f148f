"""VersionedBuffer: the buffer's policy as one plain, synchronous, checkpointable class.

It composes the parts of ``asyncrl.buffer``::

    PromptSource --> admission (1) --> WorkItem --> [rollout] --> put(Group)
         ^                                  ^                        |
         |                       PartialPool (resumed first) <-- aborted / requeued
         |                                                           |
    cursor state                     filters --> VersionedStore --> take_batch() --> TrainBatch

Every transition is recorded in the ``Ledger``. The first result for a live group wins;
later ones count as duplicates. No I/O, no tasks; the clock is injectable.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncrl.buffer import april
from asyncrl.buffer.accounting import Ledger, LedgerCounts, Live
from asyncrl.buffer.admission import admission_capacity
from asyncrl.buffer.filters import FilterFailed, apply_filters, load_filter
from asyncrl.buffer.store import StoredGroup, VersionedStore, load_priority
from asyncrl.types import Group, Prompt, SampleStatus, TrainBatch, WorkItem
from asyncrl.wire.codec import Message

_LIVE = (Live.IN_FLIGHT, Live.PARTIAL)


class PromptSupply(Protocol):
    """What the buffer needs from a data source (``asyncrl.buffer.sources.PromptSource``)."""

    @property
    def exhausted(self) -> bool: ...

    def take(self, n: int) -> list[Prompt]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class BufferStats(Message, frozen=True):
    """A snapshot for metrics: the ledger's counts, queues, staleness, reuse and APRIL figures.

    Staleness histograms count consumed samples (``staleness_samples``) and consumed
    response tokens (``staleness_tokens``, by ``v - token_version``), keyed by staleness.
    """

    version: int
    ledger: LedgerCounts
    duplicates: int
    capacity: int
    peak_buffered: int
    batches: int
    resumed_consumed: int
    masked_tokens: int
    queue_age_max: float
    staleness_samples: dict[int, int]
    staleness_tokens: dict[int, int]
    lost_steps: int = 0


class VersionedBuffer:
    """Admission, partial pool, priority store and ledger behind one API."""

    class Config(BaseModel):
        """Buffer settings. Flag names follow slime where the concept exists."""

        model_config = ConfigDict(extra="forbid", validate_assignment=True)

        groups_per_step: int = Field(
            8, ge=1, description="B: prompt groups per optimizer step (--rollout-batch-size)."
        )
        num_samples_per_prompt: int = Field(
            4, ge=1, description="Samples per group (--n-samples-per-prompt)."
        )
        max_staleness: int = Field(
            1, ge=0, description="eta: admission keeps head staleness <= eta; 0 is synchronous."
        )
        hard_staleness: int | None = Field(
            None,
            ge=0,
            description="Backstop: drop buffered groups staler than this (default eta + 1).",
        )
        over_provision: float = Field(
            0.0,
            ge=0.0,
            le=4.0,
            description="APRIL alpha: run (1 + alpha) * B groups a step (eta 0: extras aborted "
            "once B are done; eta > 0: they run on).",
        )
        max_in_flight: int | None = Field(
            None, ge=1, description="Cap on groups generating at once (engine concurrency)."
        )
        priority: str = Field(
            "oldest",
            description="Serving order: oldest | freshness | reward_variance | dotted path.",
        )
        age_guarantee: int | None = Field(
            None,
            ge=0,
            description="Serve groups this stale first, whatever the priority (default eta).",
        )
        filters: list[str] = Field(
            default_factory=list,
            description="Dynamic-sampling filters: zero_reward_variance | dotted path.",
        )
        max_reuse: int = Field(1, ge=1, description="Times one group may be trained on.")
        mask_resumed_tokens: bool = Field(
            False, description="Take tokens generated before an APRIL resume out of the loss."
        )
        max_failed_share: float = Field(
            0.9,
            gt=0.0,
            le=1.0,
            description="End the job once this share of the last failure_window finished "
            "groups failed (1.0: only when all of them did).",
        )
        failure_window: int = Field(
            32, ge=0, description="Finished groups max_failed_share is judged over; 0: never."
        )

        @model_validator(mode="after")
        def _hard_at_least_eta(self) -> VersionedBuffer.Config:
            if self.hard_staleness is not None and self.hard_staleness < self.max_staleness:
                raise ValueError(
                    f"hard_staleness ({self.hard_staleness}) must be >= max_staleness "
                    f"({self.max_staleness}): the backstop would drop work admission allowed"
                )
            if self.over_provision > 0 and self.resolved_hard_staleness == 0:
                raise ValueError(
                    "hard_staleness 0 with over_provision (APRIL) would drop every "
                    "resumed partial (it lands a version old): unset it, or >= 1"
                )
            return self

        @property
        def resolved_hard_staleness(self) -> int:
            """The backstop in force."""
            if self.hard_staleness is None:
                return self.max_staleness + 1
            return self.hard_staleness

    def __init__(
        self,
        config: Config,
        source: PromptSupply | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.source, self.clock = config, source, clock
        self.version = 0
        self.lost_steps = 0  # optimizer steps a rebase took back (see ``rebase``)
        self.ledger = Ledger()
        self.pool = april.PartialPool()
        self.store = VersionedStore(
            priority=load_priority(config.priority),
            hard_staleness=config.resolved_hard_staleness,
            age_guarantee=_or(config.age_guarantee, config.max_staleness),
            max_reuse=config.max_reuse,
        )
        self.filters = [(name, load_filter(name)) for name in config.filters]
        self._in_flight: dict[str, WorkItem] = {}
        self._resumed_at: dict[str, int] = {}  # group uid -> version of its latest resume
        self._cancelled: set[str] = set()  # cut in flight, their results not back yet
        self._pending: list[Prompt] = []  # drawn from the source, not yet admitted
        self._batches = 0
        self._duplicates = 0
        self._resumed_consumed = 0
        self._masked_tokens = 0
        self._queue_age_max = 0.0
        self._stale_samples: Counter[int] = Counter()
        self._stale_tokens: Counter[int] = Counter()

    # -- versions and admission -------------------------------------------------------
    def set_version(self, version: int) -> list[str]:
        """The trainer reached ``version`` (optimizer steps applied); never goes back.

        Groups now staler than the backstop are dropped at once (not at the next take),
        so the state after a sequence of calls does not depend on when ``ready()`` was
        polled: a journal replay reproduces it exactly. Returns the groups cut in flight
        (``_cancel_doomed``)."""
        if version < self.version:
            raise ValueError(f"version went back from {self.version} to {version}")
        self.version = version
        self._evict_stale()
        return self._cancel_doomed()

    def _cancel_doomed(self) -> list[str]:
        """Asynchronous APRIL (``april`` module): filter as ``cut`` now the work the
        backstop would drop (``stale``) on arrival; returns the in-flight uids, for their
        producers to abort (their late results are ``cancelled``)."""
        cfg = self.config
        if cfg.over_provision == 0 or cfg.max_staleness == 0:
            return []
        oldest_kept = self.version - cfg.resolved_hard_staleness
        for uid in april.too_stale(self.pool, oldest_kept):
            self.pool.remove(uid)
            self._forget(uid)
            self.ledger.filter(uid, "cut", expect=(Live.PARTIAL,))
        doomed = april.too_stale(self._in_flight.values(), oldest_kept)
        for uid in doomed:
            del self._in_flight[uid]
            self._cancelled.add(uid)
            self._forget(uid)
            self.ledger.filter(uid, "cut", expect=(Live.IN_FLIGHT,))
        return doomed

    def rebase(self, version: int) -> None:
        """The trainer went back to ``version``, the steps since lost (only in the replay of
        an old journal: ``Hub._check_resync`` refuses it now). Admission still counts the
        lost steps (``lost_steps``): their groups were consumed."""
        if version > self.version:
            raise ValueError(f"rebase goes back, not forward: {self.version} -> {version}")
        self.lost_steps += self.version - version
        self.version = version

    def capacity(self) -> int:
        """New groups that may start now: rule (1); none once a sync APRIL step is done."""
        cfg = self.config
        if self._sync_step_done():
            return 0
        return admission_capacity(
            admitted=self.ledger.holding,
            in_flight=len(self._in_flight),
            version=self.version + self.lost_steps,
            max_staleness=cfg.max_staleness,
            groups_per_step=cfg.groups_per_step,
            over_provision=cfg.over_provision,
            max_in_flight=cfg.max_in_flight,
        )

    @property
    def cancelled(self) -> list[str]:
        """Groups cut in flight (``_cancel_doomed``) whose results are not back."""
        return sorted(self._cancelled)

    @property
    def in_flight(self) -> list[str]:
        """Uids of groups handed out and not yet returned."""
        return list(self._in_flight)

    def work_item(self, uid: str) -> WorkItem | None:
        """The work item of ``uid`` while it is in flight, else None."""
        return self._in_flight.get(uid)

    def available(self) -> int:
        """About how many groups ``next_work`` could hand out now: the partials that may
        resume and the new groups admission allows (a source running dry gives fewer)."""
        resumable = len(self.pool) if self._may_resume() else 0
        return resumable + self.capacity()

    def next_work(self, max_items: int) -> list[WorkItem]:
        """Up to ``max_items`` work items: resumed groups first, then new prompts."""
        out: list[WorkItem] = []
        while len(out) < max_items and self._may_resume():
            out.append(self._resume(self.pool.pop()))
        room = min(max_items - len(out), self.capacity())
        for prompt in self._draw(room):
            out.append(self._admit(prompt))
        return out

    def _may_resume(self) -> bool:
        cap = self.config.max_in_flight
        return (
            bool(self.pool)
            and (cap is None or len(self._in_flight) < cap)
            and not self._sync_step_done()
        )

    def _sync_step_done(self) -> bool:
        """Synchronous APRIL: a step's groups are done; its aborted extras and new groups
        wait until they are taken (``april`` module)."""
        cfg = self.config
        buffered = self.ledger.count(Live.BUFFERED)
        return cfg.max_staleness == 0 and cfg.over_provision > 0 and buffered >= cfg.groups_per_step

    def _resume(self, item: WorkItem | None) -> WorkItem:
        assert item is not None
        item = msgspec.structs.replace(item, version=self.version, attempt=item.attempt + 1)
        self.ledger.move(item.group_uid, Live.IN_FLIGHT, expect=(Live.PARTIAL,))
        self._in_flight[item.group_uid] = item
        if item.partial is not None and item.partial.num_tokens:
            self._resumed_at[item.group_uid] = self.version
        return item

    def _draw(self, n: int) -> list[Prompt]:
        if n <= 0:
            return []
        if len(self._pending) < n and self.source is not None and not self.source.exhausted:
            self._pending += self.source.take(n - len(self._pending))
        out, self._pending = self._pending[:n], self._pending[n:]
        return out

    def _admit(self, prompt: Prompt) -> WorkItem:
        item = WorkItem(
            group_uid=prompt.uid,
            prompt=prompt,
            num_samples=self.config.num_samples_per_prompt,
            version=self.version,
        )
        self.ledger.admit(item.group_uid)
        self._in_flight[item.group_uid] = item
        return item

    def offer(self, prompts: list[Prompt]) -> None:
        """Queue prompts from outside the source (eval sets, tests); admitted like any other."""
        self._pending += prompts

    @property
    def source_done(self) -> bool:
        """No new prompt will come: the source is used up and none is pending admission."""
        return (self.source is None or self.source.exhausted) and not self._pending

    @property
    def draining(self) -> bool:
        """No group can finish any more: the source is done and nothing generates or waits."""
        return self.source_done and not self._in_flight and not len(self.pool)

    @property
    def exhausted(self) -> bool:
        """True when the source is used up and nothing is pending, in flight or buffered."""
        return self.source_done and not self.ledger.live

    # -- results ---------------------------------------------------------------------
    def put(self, group: Group) -> str:
        """Take a result; returns stored, partial, filtered, failed, duplicate or cancelled."""
        item = self._claim(group.uid)
        if item is None:
            if group.uid in self._cancelled:
                self._cancelled.discard(group.uid)
                return "cancelled"
            self._duplicates += 1
            return "duplicate"
        # A group of the wrong size cannot be trained (GRPO needs all n) nor resumed, and an
        # empty one has no head version: fail it here rather than store it or raise mid-way.
        size = len(group.samples)
        if size != item.num_samples:
            failure: str | None = f"expected {item.num_samples} samples, got {size}"
        elif not group.is_done:
            return self._park(item, group)
        else:
            failure = _failure(group)
        if failure is not None:
            self._end(group.uid)
            self._forget(group.uid)
            self.ledger.fail(group.uid, failure, expect=_LIVE)
            return "failed"
        return self._keep(group)

    def _claim(self, uid: str) -> WorkItem | None:
        """The work item of a live, unreturned group (from flight or the pool), else None."""
        state = self.ledger.state(uid)
        if state is Live.IN_FLIGHT:
            return self._in_flight[uid]
        if state is Live.PARTIAL:  # a result from an attempt before a requeue or restore
            return self.pool.remove(uid) if uid in self.pool else None
        return None

    def _park(self, item: WorkItem, group: Group) -> str:
        self._in_flight.pop(group.uid, None)
        self.pool.add(msgspec.structs.replace(item, partial=group))
        if self.ledger.state(group.uid) is Live.IN_FLIGHT:
            self.ledger.move(group.uid, Live.PARTIAL, expect=(Live.IN_FLIGHT,))
        return "partial"

    def _end(self, uid: str) -> None:
        self._in_flight.pop(uid, None)

    def _keep(self, group: Group) -> str:
        self._end(group.uid)
        resumed_at = self._resumed_at.get(group.uid)
        if resumed_at is not None and self.config.mask_resumed_tokens:
            self._masked_tokens += april.mask_resumed_tokens(group, resumed_at)
        try:
            reason = apply_filters(group, self.filters)
        except FilterFailed as exc:
            self._forget(group.uid)
            self.ledger.fail(group.uid, str(exc), expect=_LIVE)
            return "failed"
        if reason is not None:
            self._forget(group.uid)
            self.ledger.filter(group.uid, reason, expect=_LIVE)
            return "filtered"
        self.store.put(group, now=self.clock())
        self.ledger.move(group.uid, Live.BUFFERED, expect=_LIVE)
        # Already past the backstop: dropped now (as set_version would), not at a take.
        return "filtered" if group.uid in self._evict_stale() else "stored"

    def _forget(self, uid: str) -> None:
        self._resumed_at.pop(uid, None)

    def requeue(self, uids: list[str]) -> int:
        """Put in-flight groups back to be handed out again (their producer died)."""
        n = 0
        for uid in uids:
            self._cancelled.discard(uid)  # cut in flight, and no late result will come now
            item = self._in_flight.pop(uid, None)
            if item is not None:
                self.pool.add(item)
                self.ledger.move(uid, Live.PARTIAL, expect=(Live.IN_FLIGHT,))
                n += 1
        return n

    def should_abort(self) -> bool:
        """Synchronous APRIL: a step's worth is buffered while over-provisioned groups
        still generate (asynchronous APRIL aborts nothing for a step: ``april`` module)."""
        cfg = self.config
        # Buffered, not len(store): groups kept for reuse were trained on already.
        enough = self.ledger.count(Live.BUFFERED) >= cfg.groups_per_step
        sync = cfg.max_staleness == 0
        return sync and cfg.over_provision > 0 and enough and bool(self._in_flight)

    # -- serving the trainer -------------------------------------------------------------
    def ready(self, n: int | None = None) -> bool:
        """True if ``take_batch(n)`` would return a batch (after the staleness backstop).

        At the end of the data a shorter last batch is ready: nothing else can arrive.
        """
        self._evict_stale()
        stored = len(self.store)
        return stored >= (n or self.config.groups_per_step) or (stored > 0 and self.draining)

    def take_batch(self, n: int | None = None) -> TrainBatch | None:
        """``n`` groups (default B) for the trainer at the current version, or None."""
        if not self.ready(n):
            return None
        taken = self.store.take(n or self.config.groups_per_step, self.version)
        assert not taken.evicted  # ready() evicted them
        now = self.clock()
        for entry in taken.groups:
            self._account_consumed(entry, now)
        self._batches += 1
        return TrainBatch(self._batches, self.version, [e.group for e in taken.groups])

    def _evict_stale(self) -> set[str]:
        """Drop the groups past the backstop; the uids of those that were buffered."""
        dropped = set()
        for entry in self.store.evict_stale(self.version):
            if entry.served == 0:  # a reused group was consumed already
                self._forget(entry.group.uid)
                self.ledger.filter(entry.group.uid, "stale", expect=(Live.BUFFERED,))
                dropped.add(entry.group.uid)
        return dropped

    def _account_consumed(self, entry: StoredGroup, now: float) -> None:
        if entry.served > 1:
            return  # a reuse: consumed and counted the first time
        self.ledger.consume(entry.group.uid)
        if self._resumed_at.pop(entry.group.uid, None) is not None:
            self._resumed_consumed += 1
        self._queue_age_max = max(self._queue_age_max, now - entry.stored_at)
        group = entry.group
        _count_into(self._stale_samples, self.version - group.sample_head_versions())
        _count_into(self._stale_tokens, self.version - group.token_versions().astype(np.int64))

    # -- metrics and checkpoints ---------------------------------------------------------
    @property
    def batches_taken(self) -> int:
        """Batches made for the trainer so far, over the run and the jobs that resumed it."""
        return self._batches

    def statistics(self) -> BufferStats:
        """A frozen snapshot for the metrics sink."""
        return BufferStats(
            version=self.version,
            ledger=self.ledger.counts(),
            duplicates=self._duplicates,
            capacity=self.capacity(),
            peak_buffered=self.store.peak,
            batches=self._batches,
            resumed_consumed=self._resumed_consumed,
            masked_tokens=self._masked_tokens,
            queue_age_max=self._queue_age_max,
            staleness_samples=dict(self._stale_samples),
            staleness_tokens=dict(self._stale_tokens),
            lost_steps=self.lost_steps,
        )

    def state_dict(self) -> BufferState:
        """Everything needed to continue after a restart, as one wire record.

        The pool and the store are saved in their serving order and the in-flight work
        apart from them, so ``load_state_dict(..., requeue_in_flight=False)`` continues
        exactly where this buffer stood (what a journal replay needs).
        """
        stored = self.store.entries()
        return BufferState(
            version=self.version,
            ledger=msgspec.json.encode(self.ledger.state_dict()),
            waiting=list(self.pool),
            stored=[e.group for e in stored],
            served=[e.served for e in stored],
            pending=list(self._pending),
            resumed_at=dict(self._resumed_at),
            source=msgspec.json.encode(self.source.state_dict() if self.source else None),
            batches=self._batches,
            in_flight=list(self._in_flight.values()),
            lost_steps=self.lost_steps,
            tallies=msgspec.json.encode(self._tallies()),
        )

    def _tallies(self) -> dict[str, Any]:
        return {
            "duplicates": self._duplicates,
            "resumed_consumed": self._resumed_consumed,
            "masked_tokens": self._masked_tokens,
            "queue_age_max": self._queue_age_max,
            "stale_samples": dict(self._stale_samples),
            "stale_tokens": dict(self._stale_tokens),
            "cancelled": sorted(self._cancelled),
        }

    def load_state_dict(self, state: BufferState, *, requeue_in_flight: bool = True) -> None:
        """Restore from ``state_dict()`` into a freshly built buffer.

        ``requeue_in_flight``: work in flight at the checkpoint waits to resume, since
        the producers that held it are gone (a new job); a late result from before is
        still accepted once. False keeps it in flight (the same job's producers still
        hold it: a buffer restart).
        """
        if self.ledger.admitted or len(self.store):
            raise RuntimeError("load_state_dict needs a fresh buffer")
        self.version, self._batches = state.version, state.batches
        self.lost_steps = state.lost_steps
        ledger = msgspec.json.decode(state.ledger)
        for item in state.waiting:
            self.pool.add(item)
        for item in state.in_flight:
            if requeue_in_flight:
                ledger["live"][item.group_uid] = Live.PARTIAL
                self.pool.add(item)
            else:
                self._in_flight[item.group_uid] = item
        self.ledger.load_state_dict(ledger)
        for group, served in zip(state.stored, state.served, strict=True):
            self.store.put(group, now=self.clock(), served=served)
        self._pending, self._resumed_at = list(state.pending), dict(state.resumed_at)
        source_state = msgspec.json.decode(state.source)
        if self.source is not None and source_state is not None:
            self.source.load_state_dict(source_state)
        self._load_tallies(msgspec.json.decode(state.tallies) if state.tallies else {})

    def _load_tallies(self, t: dict[str, Any]) -> None:
        self._duplicates = t.get("duplicates", 0)
        self._resumed_consumed = t.get("resumed_consumed", 0)
        self._masked_tokens = t.get("masked_tokens", 0)
        self._queue_age_max = t.get("queue_age_max", 0.0)
        # JSON keys are strings; the histograms are keyed by staleness.
        self._stale_samples = Counter({int(k): v for k, v in t.get("stale_samples", {}).items()})
        self._stale_tokens = Counter({int(k): v for k, v in t.get("stale_tokens", {}).items()})
        self._cancelled = set(t.get("cancelled", []))


class BufferState(Message):
    """A buffer checkpoint (``VersionedBuffer.state_dict``); encode it with a ``Codec``.

    ``waiting``: the partial pool in serving order; ``stored``: the store in arrival
    order, each group served ``served[i]`` times so far; ``in_flight``: work handed out
    and not returned; ``tallies``: the statistics' counters and histograms (JSON).
    """

    version: int
    ledger: bytes
    waiting: list[WorkItem]
    stored: list[Group]
    served: list[int]
    pending: list[Prompt]
    resumed_at: dict[str, int]
    source: bytes
    batches: int
    in_flight: list[WorkItem] = msgspec.field(default_factory=list)
    lost_steps: int = 0
    tallies: bytes = b""


def _failure(group: Group) -> str | None:
    for sample in group.samples:
        if sample.status is SampleStatus.FAILED:
            return sample.error or "failed without a reason"
    return None


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _count_into(hist: Counter[int], values: np.ndarray) -> None:
    """Add a histogram of the integers in ``values`` to ``hist``."""
    if not values.size:
        return
    lo = int(values.min())
    for value, count in enumerate(np.bincount(values - lo).tolist(), start=lo):
        if count:
            hist[value] += count
