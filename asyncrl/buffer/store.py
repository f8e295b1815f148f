"""The versioned priority store: finished groups waiting for the trainer.

A group's head version ``h`` is the oldest weight version of its tokens; at trainer
version ``v`` its staleness is ``s = v - h``. ``take(n, v)`` evicts every group with
``s > hard_staleness`` (the backstop), then serves those with ``s >= age_guarantee``
oldest first, so no priority starves old work past the backstop, then the rest by
priority (highest first, ties in arrival order). Both orders are lazy-deletion heaps.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from asyncrl.plugins import load_object
from asyncrl.types import Group

Priority = Callable[[Group], float]


def oldest(group: Group) -> float:
    """Default priority: older head version first."""
    return -group.head_version


def freshness(group: Group) -> float:
    """Newest head version first (pair with a tight age guarantee)."""
    return group.head_version


def reward_variance(group: Group) -> float:
    """Groups whose rewards disagree most first (they carry the most GRPO signal)."""
    rewards = group.rewards
    rewards = rewards[~np.isnan(rewards)]
    return float(rewards.var()) if rewards.size else 0.0


PRIORITIES: dict[str, Priority] = {
    "oldest": oldest,
    "freshness": freshness,
    "reward_variance": reward_variance,
}


def load_priority(name: str) -> Priority:
    """A built-in priority by name, or a callable ``group -> float`` by dotted path."""
    if name in PRIORITIES:
        return PRIORITIES[name]
    fn = load_object(name, what="priority")
    if not callable(fn):
        raise ValueError(f"priority {name!r} is not callable")
    return fn


@dataclass(slots=True)
class StoredGroup:
    """A group in the store with its bookkeeping."""

    group: Group
    head_version: int
    seq: int
    stored_at: float
    served: int = 0


@dataclass(slots=True)
class Taken:
    """What ``take`` chose and what it evicted on the way."""

    groups: list[StoredGroup] = field(default_factory=list)
    evicted: list[StoredGroup] = field(default_factory=list)


class VersionedStore:
    """Finished groups by head version and priority; see the module docstring."""

    def __init__(
        self,
        *,
        priority: Priority = oldest,
        hard_staleness: int,
        age_guarantee: int,
        max_reuse: int = 1,
    ) -> None:
        if max_reuse < 1 or hard_staleness < 0 or age_guarantee < 0:
            raise ValueError("need max_reuse >= 1, hard_staleness >= 0, age_guarantee >= 0")
        self.priority, self.max_reuse = priority, max_reuse
        self.hard_staleness, self.age_guarantee = hard_staleness, age_guarantee
        self.priority_errors = 0
        self.peak = 0
        self._entries: dict[str, StoredGroup] = {}
        self._by_age: list[tuple[int, int, str]] = []
        self._by_priority: list[tuple[float, int, str]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, uid: str) -> bool:
        return uid in self._entries

    def entries(self) -> list[StoredGroup]:
        """Every stored group, in arrival order."""
        return sorted(self._entries.values(), key=lambda e: e.seq)

    def put(self, group: Group, *, now: float = 0.0, served: int = 0) -> None:
        """Store a finished group (``served`` > 0 when restoring a reused one)."""
        if group.uid in self._entries:
            raise ValueError(f"group {group.uid} is already stored")
        self._seq += 1
        entry = StoredGroup(group, group.head_version, self._seq, now, served)
        self._insert(entry)

    def _insert(self, entry: StoredGroup) -> None:
        self._entries[entry.group.uid] = entry
        heapq.heappush(self._by_age, (entry.head_version, entry.seq, entry.group.uid))
        prio = self._score(entry)
        heapq.heappush(self._by_priority, (-prio, entry.seq, entry.group.uid))
        self.peak = max(self.peak, len(self._entries))
        if len(self._by_age) + len(self._by_priority) > 4 * len(self._entries) + 64:
            self._compact()

    def _compact(self) -> None:
        # Lazy deletion leaves dead items behind; rebuild both heaps from the live entries.
        live = self._entries
        for heap in (self._by_age, self._by_priority):
            heap[:] = [i for i in heap if i[2] in live and live[i[2]].seq == i[1]]
            heapq.heapify(heap)

    def _score(self, entry: StoredGroup) -> float:
        if self.priority is oldest:  # the default: reuse the head computed at put
            return -entry.head_version
        try:
            score = float(self.priority(entry.group))
        except Exception:  # user code: a broken priority must not lose the group
            self.priority_errors += 1
            return 0.0
        return score if not math.isnan(score) else 0.0

    def evict_stale(self, version: int) -> list[StoredGroup]:
        """Remove and return every group with staleness above ``hard_staleness``."""
        out = []
        while self._by_age and version - self._by_age[0][0] > self.hard_staleness:
            entry = self._pop(self._by_age)
            if entry is not None:
                out.append(entry)
        return out

    def take(self, n: int, version: int) -> Taken:
        """Evict stale groups, then choose up to ``n`` (see the module docstring). A group
        served fewer than ``max_reuse`` times goes back in, never twice in one batch."""
        taken = Taken(evicted=self.evict_stale(version))
        while len(taken.groups) < n and self._urgent(version):
            taken.groups.append(self._pop(self._by_age))
        while len(taken.groups) < n and self._entries:
            entry = self._pop(self._by_priority)
            if entry is not None:
                taken.groups.append(entry)
        for entry in taken.groups:
            entry.served += 1
        for entry in taken.groups:  # re-insert after choosing, so one batch has no repeats
            if entry.served < self.max_reuse:
                self._reinsert(entry)
        return taken

    def _urgent(self, version: int) -> bool:
        self._drop_dead(self._by_age)
        return bool(self._by_age) and version - self._by_age[0][0] >= self.age_guarantee

    def _reinsert(self, entry: StoredGroup) -> None:
        self._seq += 1
        entry.seq = self._seq
        self._insert(entry)

    def _pop(self, heap: list) -> StoredGroup | None:
        """Pop the top of ``heap``; None if it was a stale (lazily deleted) item."""
        _, seq, uid = heapq.heappop(heap)
        entry = self._entries.get(uid)
        if entry is None or entry.seq != seq:
            return None
        del self._entries[uid]
        return entry

    def _drop_dead(self, heap: list) -> None:
        while heap:
            entry = self._entries.get(heap[0][2])
            if entry is not None and entry.seq == heap[0][1]:
                return
            heapq.heappop(heap)
