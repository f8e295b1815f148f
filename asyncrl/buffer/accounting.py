"""The ledger: where every admitted prompt group is, so that nothing is lost or repeated.

A group is live (``in_flight``, ``partial`` waiting to resume, or ``buffered``) or has
ended (``consumed``, ``filtered`` or ``failed``, each with a reason). Always::

    admitted == in_flight + partial + buffered + consumed + filtered + failed    (2)

Every transition names the state it expects to leave, so a double delivery or a lost
update raises ``LedgerError`` instead of corrupting counts. Ended groups are counted, not
remembered one by one, and their reasons are bounded, so a days-long run stays small.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from typing import Any

from asyncrl.wire.codec import Message

#: Distinct filter or failure reasons kept per kind; later new ones count as ``OTHER``
#: (an error text that carries a request id would otherwise add a key per failure, to
#: every checkpoint and metrics row).
MAX_REASONS = 32
#: Each reason is cut to this many characters.
MAX_REASON_CHARS = 200
OTHER = "other reasons"


def _count(counter: Counter[str], reason: str) -> None:
    key = reason[:MAX_REASON_CHARS]
    if key not in counter and len(counter) >= MAX_REASONS:
        key = OTHER
    counter[key] += 1


class LedgerError(RuntimeError):
    """A transition from a state the group is not in: a bug, never user input."""


class Live(enum.StrEnum):
    """States of a group that is still the buffer's responsibility."""

    IN_FLIGHT = "in_flight"
    PARTIAL = "partial"
    BUFFERED = "buffered"


class LedgerCounts(Message, frozen=True):
    """A snapshot of the ledger; ``filtered`` and ``failed`` are counts by reason."""

    admitted: int
    in_flight: int
    partial: int
    buffered: int
    consumed: int
    filtered: dict[str, int]
    failed: dict[str, int]

    @property
    def accounted(self) -> int:
        """Right-hand side of (2)."""
        ended = self.consumed + sum(self.filtered.values()) + sum(self.failed.values())
        return self.in_flight + self.partial + self.buffered + ended


class Ledger:
    """Group states and end counts; see the module docstring for the invariant."""

    def __init__(self) -> None:
        self.live: dict[str, Live] = {}
        self.admitted = 0
        self.consumed = 0
        self.filtered: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self._sizes: Counter[Live] = Counter()

    def state(self, uid: str) -> Live | None:
        """The live state of ``uid``, or None once it ended (or was never admitted)."""
        return self.live.get(uid)

    def count(self, state: Live) -> int:
        """Groups in ``state`` now."""
        return self._sizes[state]

    @property
    def holding(self) -> int:
        """Groups that count against admission: live plus consumed (filtered/failed free a slot)."""
        return len(self.live) + self.consumed

    def admit(self, uid: str) -> None:
        """A new group starts generating."""
        if uid in self.live:
            raise LedgerError(f"group {uid} admitted twice")
        self.live[uid] = Live.IN_FLIGHT
        self._sizes[Live.IN_FLIGHT] += 1
        self.admitted += 1

    def move(self, uid: str, to: Live, *, expect: tuple[Live, ...]) -> None:
        """Move a live group from one of ``expect`` to ``to``."""
        self._leave(uid, expect)
        self.live[uid] = to
        self._sizes[to] += 1

    def consume(self, uid: str) -> None:
        """A buffered group went to the trainer."""
        self._leave(uid, (Live.BUFFERED,))
        self.consumed += 1

    def filter(self, uid: str, reason: str, *, expect: tuple[Live, ...]) -> None:
        """A group was dropped by a filter (staleness, zero variance, custom)."""
        self._leave(uid, expect)
        _count(self.filtered, reason)

    def fail(self, uid: str, reason: str, *, expect: tuple[Live, ...]) -> None:
        """A group could not be produced (workflow, engine, reward or tool error)."""
        self._leave(uid, expect)
        _count(self.failed, reason)

    def _leave(self, uid: str, expect: tuple[Live, ...]) -> None:
        state = self.live.get(uid)
        if state not in expect:
            names = "/".join(expect)
            raise LedgerError(f"group {uid} is {state or 'not live'}, expected {names}")
        del self.live[uid]
        self._sizes[state] -= 1

    def counts(self) -> LedgerCounts:
        """A frozen snapshot."""
        return LedgerCounts(
            admitted=self.admitted,
            in_flight=self._sizes[Live.IN_FLIGHT],
            partial=self._sizes[Live.PARTIAL],
            buffered=self._sizes[Live.BUFFERED],
            consumed=self.consumed,
            filtered=dict(self.filtered),
            failed=dict(self.failed),
        )

    def check(self) -> None:
        """Raise ``LedgerError`` unless invariant (2) holds."""
        c = self.counts()
        if c.admitted != c.accounted or sum(self._sizes.values()) != len(self.live):
            raise LedgerError(f"ledger does not add up: {c}")

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint."""
        return {
            "live": dict(self.live),
            "admitted": self.admitted,
            "consumed": self.consumed,
            "filtered": dict(self.filtered),
            "failed": dict(self.failed),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()`` output; checks invariant (2)."""
        self.live = {uid: Live(s) for uid, s in state["live"].items()}
        self.admitted, self.consumed = state["admitted"], state["consumed"]
        self.filtered, self.failed = Counter(state["filtered"]), Counter(state["failed"])
        self._sizes = Counter(self.live.values())
        self.check()


class FailureWatch:
    """Whether samples keep failing: of the last ``window`` groups that finished (trained
    material, filtered or failed), at least ``max_share`` failed. A job in that state
    trains little or nothing, and its cause (data, reward code, sampling settings) does
    not pass by itself. ``window`` 0 never trips."""

    def __init__(self, window: int, max_share: float) -> None:
        self.window, self.max_share = window, max_share
        self.recent: deque[bool] = deque(maxlen=max(window, 1))

    def record(self, outcome: str) -> None:
        """One ``VersionedBuffer.put`` outcome; partials and duplicates have not finished."""
        if outcome in ("stored", "filtered", "failed"):
            self.recent.append(outcome == "failed")

    def tripped(self) -> bool:
        full = self.window > 0 and len(self.recent) == self.window
        return full and sum(self.recent) >= self.max_share * self.window
