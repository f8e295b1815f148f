"""APRIL partial rollouts: the pool of groups waiting to resume (``docs/design.md`` section 5).

Groups cut mid-generation (APRIL's over-provisioned extras, a weight update, a dead
producer's work) come back with what they generated so far and wait here. They are
handed out before any new prompt, so long responses are finished across steps instead of
thrown away, which would bias training toward short answers.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from asyncrl.types import Group, WorkItem


def remaining_tokens(generated: int, max_new_tokens: int) -> int:
    """New tokens a resumed sample may still generate: ``max(0, max_new - generated)``
    (the engine continues from the prompt and the response so far)."""
    return max(0, max_new_tokens - generated)


def mask_resumed_tokens(group: Group, resumed_at_version: int) -> int:
    """Zero the loss mask of tokens older than ``resumed_at_version`` (branches' too),
    which older weights generated before the resume; returns how many."""
    masked = 0
    for sample in (x for s in group.samples for x in (s, *s.branches)):
        old = sample.token_versions < resumed_at_version
        if old.any():
            masked += int((old & (sample.loss_mask == 1)).sum())
            sample.set_loss_mask(sample.loss_mask * ~old)
    return masked


class PartialPool:
    """Work waiting to resume, oldest head version first (ties: arrival order)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, str]] = []
        self._items: dict[str, WorkItem] = {}
        # A removed and re-added uid leaves its old heap entry behind; the seq tells them apart.
        self._seqs: dict[str, int] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, uid: str) -> bool:
        return uid in self._items

    def __iter__(self) -> Iterator[WorkItem]:
        """In ``pop`` order, so re-adding them in this order restores the same order."""
        return iter(sorted(self._items.values(), key=self._order))

    def _order(self, item: WorkItem) -> tuple[int, int]:
        return head_version(item), self._seqs[item.group_uid]

    def add(self, item: WorkItem) -> None:
        """Queue ``item`` (its ``partial`` holds the samples so far, if any)."""
        if item.group_uid in self._items:
            raise ValueError(f"group {item.group_uid} is already waiting to resume")
        self._seq += 1
        self._items[item.group_uid] = item
        self._seqs[item.group_uid] = self._seq
        heapq.heappush(self._heap, (*self._order(item), item.group_uid))

    def pop(self) -> WorkItem | None:
        """The oldest waiting item, or None."""
        while self._heap:
            _, seq, uid = heapq.heappop(self._heap)
            if self._seqs.get(uid) == seq:
                del self._seqs[uid]
                return self._items.pop(uid)
        return None

    def remove(self, uid: str) -> WorkItem:
        """Take ``uid`` out (its result arrived from an earlier attempt)."""
        del self._seqs[uid]
        return self._items.pop(uid)


def too_stale(items: Iterable[WorkItem], oldest_kept: int) -> list[str]:
    """Uids, sorted, of the ``items`` whose group can only land past the backstop: head
    version below ``oldest_kept = v - hard_staleness``.

    The head is what the buffer knows (``head_version``). An engine still on older weights
    makes the true head older: the cut is then late, never wrong. Samples that queued in an
    engine past a version change make it newer, so a group could be cut a version early.
    """
    return sorted(i.group_uid for i in items if head_version(i) < oldest_kept)


def head_version(item: WorkItem) -> int:
    """The oldest weight version ``item``'s group can end with, as far as the buffer
    knows: the oldest token of its partial, else the version it was handed out at (a
    sample that has not started yet gets its first token at that version or later)."""
    partial = item.partial
    started = [s.head_version for s in partial.samples if s.packed_response] if partial else []
    return min(started, default=item.version)
