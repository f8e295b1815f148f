"""Freed host memory back to the system, on a clock.

glibc keeps what a process frees in its heaps for reuse. An engine on CPU frees KV slabs
and activations of ever-changing sizes, below glibc's 32 MB mmap ceiling, and reuses
little of it, so its resident memory climbs until the kernel's OOM killer acts
(docs/benchmarks.md, "The eval actor's memory"). ``malloc_trim(0)`` returns the free
pages; ``HeapTrimmer()`` is a no-op where there is no glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

#: Seconds between trims (more often: a lower peak, but a slower engine; docs/benchmarks.md).
TRIM_INTERVAL_S = 5.0


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # musl, macOS: no malloc_trim
        return None


class HeapTrimmer:
    """``maybe()``: trim when ``interval_s`` has passed since the last trim."""

    def __init__(
        self, interval_s: float = TRIM_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s, self.clock = interval_s, clock
        self._trim = _malloc_trim()
        self._last = clock()
        self.trims = 0

    def maybe(self) -> None:
        if self._trim is not None and self.clock() - self._last >= self.interval_s:
            self.trim()

    def trim(self) -> None:
        self._last = self.clock()
        if self._trim is not None:
            self._trim(0)
            self.trims += 1
