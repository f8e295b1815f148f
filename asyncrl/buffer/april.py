"""APRIL partial rollouts: the pool of groups waiting to resume.

APRIL (active partial rollouts) submits ``(1 + alpha) * B`` groups per step; once ``B``
are finished the rest are aborted and come back with what they generated so far
(tokens, behaviour log-probs, versions). They wait here and are handed out before any
new prompt, so long responses are finished across steps instead of being thrown away
(throwing them away biases training toward short answers). The same pool holds groups
aborted on a weight update and the in-flight work of a producer that died.

Synchronous (eta 0, as in slime): once a step's groups are done the extras are aborted
(``VersionedBuffer.should_abort``), and neither they nor new groups start until the batch
is taken; then the extras resume, during the train step. Resumed at once, they would run
to their end before a colocated step could start (its engines must be idle), and the abort
would save nothing; new groups started in filtered groups' slots would be trained a
version late, which eta 0 promises not to do.

Asynchronous (eta > 0): nothing waits for the tail, so an abort would only make the
engines prefill the partials again: the extras run on into the next steps. A new version
cuts only the work that can no longer land within the backstop (``too_stale``), in flight
or waiting, which is filtered ``cut`` at once instead of ``stale`` on arrival.

Resuming a sample continues its response: the engine gets ``prompt + response`` tokens
and ``max_new_tokens - response_length`` new tokens at most (``remaining_tokens``). The
tokens generated before the resume came from older weights; ``mask_resumed_tokens``
optionally takes them out of the loss.

Users: ``VersionedBuffer``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from asyncrl.types import Group, WorkItem


def remaining_tokens(generated: int, max_new_tokens: int) -> int:
    """New tokens a resumed sample may still generate: ``max(0, max_new - generated)``."""
    return max(0, max_new_tokens - generated)


def mask_resumed_tokens(group: Group, resumed_at_version: int) -> int:
    """Zero the loss mask of tokens older than ``resumed_at_version`` (branches' too);
    returns how many."""
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
