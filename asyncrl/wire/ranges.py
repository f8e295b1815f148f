"""``RangeSet``: a set of integers stored as sorted, disjoint inclusive ranges.

The reliable channel tracks seqs per sender stream (seen, delivered but unacked, acked).
Seqs arrive and are acknowledged almost always in order, so a handful of ranges covers
millions of seqs and every operation on the common path touches only the last range.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator


class RangeSet:
    """Sorted disjoint inclusive ranges ``[(lo, hi), ...]`` with O(log n) membership."""

    __slots__ = ("_his", "_los")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._los: list[int] = []
        self._his: list[int] = []
        for lo, hi in ranges:
            self.add(lo, hi)

    def __contains__(self, x: int) -> bool:
        i = bisect.bisect_right(self._los, x) - 1
        return i >= 0 and x <= self._his[i]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(zip(self._los, self._his, strict=True))

    def __len__(self) -> int:
        """Number of ranges (not of integers)."""
        return len(self._los)

    def __bool__(self) -> bool:
        return bool(self._los)

    def __repr__(self) -> str:
        return f"RangeSet({list(self)})"

    def count(self) -> int:
        """Number of integers in the set."""
        return sum(hi - lo + 1 for lo, hi in self)

    def add(self, lo: int, hi: int) -> None:
        """Add ``[lo, hi]``, merging with neighbours that touch or overlap it."""
        if lo > hi:
            return
        los, his = self._los, self._his
        if not los or lo > his[-1] + 1:  # common case: strictly after everything
            los.append(lo)
            his.append(hi)
            return
        if lo >= los[-1]:  # common case: extends the last range
            his[-1] = max(his[-1], hi)
            return
        i = bisect.bisect_left(his, lo - 1)
        j = bisect.bisect_right(los, hi + 1)
        if i < j:
            lo, hi = min(lo, los[i]), max(hi, his[j - 1])
        los[i:j] = [lo]
        his[i:j] = [hi]

    def remove(self, lo: int, hi: int) -> None:
        """Remove ``[lo, hi]``, splitting a range that straddles it."""
        if lo > hi or not self._los:
            return
        los, his = self._los, self._his
        i = bisect.bisect_left(his, lo)
        j = bisect.bisect_right(los, hi)
        keep_lo: list[int] = []
        keep_hi: list[int] = []
        if i < j and los[i] < lo:
            keep_lo.append(los[i])
            keep_hi.append(lo - 1)
        if i < j and his[j - 1] > hi:
            keep_lo.append(hi + 1)
            keep_hi.append(his[j - 1])
        los[i:j] = keep_lo
        his[i:j] = keep_hi

    def missing(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The sub-ranges of ``[lo, hi]`` that are not in the set."""
        out, cur = [], lo
        i = max(bisect.bisect_right(self._los, lo) - 1, 0)
        while cur <= hi and i < len(self._los):
            if self._his[i] >= cur:
                if self._los[i] > cur:
                    out.append((cur, min(hi, self._los[i] - 1)))
                cur = self._his[i] + 1
            i += 1
        if cur <= hi:
            out.append((cur, hi))
        return out

    def first_above(self, floor: int) -> int:
        """The largest ``x`` such that every integer in ``(floor, x]`` is in the set."""
        i = bisect.bisect_right(self._los, floor + 1) - 1
        if i >= 0 and self._his[i] > floor:
            return self._his[i]
        return floor

    def max(self) -> int | None:
        """The largest integer in the set, or None when empty."""
        return self._his[-1] if self._his else None

    def trim_below(self, floor: int) -> None:
        """Drop everything ``<= floor`` (compaction once a watermark has passed it)."""
        if self._los and self._los[0] <= floor:
            self.remove(self._los[0], floor)
