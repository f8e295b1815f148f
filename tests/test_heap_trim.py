"""``engines/torch/heap_trim.py``: freed heap memory goes back to the system, at most once an
interval, and the torch engine on CPU trims as it steps."""

from __future__ import annotations

import subprocess
import sys

from asyncrl.engines.torch.heap_trim import HeapTrimmer

#: Holes in the heap: 2,000 blocks of 100 kB, every other one freed. No automatic trim
#: can return them (live blocks lie above each), and glibc's mmap threshold is above them.
_HOLES = """
import sys
from asyncrl.engines.torch.heap_trim import HeapTrimmer

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) // 1024

blocks = [bytearray(b"x" * 100_000) for _ in range(2000)]
del blocks[::2]
before = rss_mb()
if sys.argv[1] == "trim":
    HeapTrimmer().trim()
print(before, rss_mb())
"""


def rss_before_and_after(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _HOLES, mode], check=True, capture_output=True)
    before, after = map(int, out.stdout.split())
    return before, after


def test_a_trim_gives_the_freed_holes_back():
    before, after = rss_before_and_after("trim")
    assert before - after > 70, (before, after)  # 100 MB of holes
    kept_before, kept_after = rss_before_and_after("keep")
    assert kept_before - kept_after < 20, (kept_before, kept_after)  # glibc keeps them


def test_trims_come_at_most_once_an_interval():
    now = [0.0]
    trimmer = HeapTrimmer(interval_s=5.0, clock=lambda: now[0])
    for t in (1.0, 4.9, 5.0, 6.0, 9.9, 10.1):
        now[0] = t
        trimmer.maybe()
    assert trimmer.trims == 2  # at 5.0 and 10.1
