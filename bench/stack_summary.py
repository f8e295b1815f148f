"""Where a process's wall time goes, from py-spy's collapsed stacks (``--format raw``).

    py-spy record --format raw --idle --threads --subprocesses -o stacks.txt -- python ...
    python bench/stack_summary.py stacks.txt [--top 25] [--match engine]

``torch.profiler`` sees only torch's ops; a run whose wall time is mostly outside them
(Python, the event loop, waiting on a lock or a device sync) needs a sampler of every
thread's Python stack. Each line of the raw format is ``frame;frame;... count``; this
prints, per thread, its share of the samples, then the functions that hold the most
samples inclusively (on the stack anywhere) and by self time (the innermost frame).
``--match`` keeps the samples whose stacks mention it (a function: the time under it).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

_THREAD = re.compile(r"^thread \((?:0x)?[0-9a-fA-F]+\)")
_LINE = re.compile(r":\d+\)$")


def parse(path: Path) -> dict[str, Counter[tuple[str, ...]]]:
    """Stacks by thread: ``{thread: Counter({(outermost, ..., innermost): samples})}``."""
    threads: dict[str, Counter[tuple[str, ...]]] = defaultdict(Counter)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # py-spy puts "process N:cmd" (one per level with --subprocesses) and "thread (id)"
        # first: a thread is keyed by the innermost of each.
        n = 0
        while n < len(frames) and (frames[n].startswith("process ") or _THREAD.match(frames[n])):
            n += 1
        head = [f.split(":")[0] if f.startswith("process ") else f for f in frames[:n]][-2:]
        threads[";".join(head)][tuple(frames[n:])] += int(count)
    return threads


def report(threads: dict[str, Counter[tuple[str, ...]]], top: int, match: str | None) -> None:
    total = sum(sum(c.values()) for c in threads.values()) or 1
    for name, stacks in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        if match:
            stacks = Counter({s: c for s, c in stacks.items() if any(match in f for f in s)})
        n = sum(stacks.values())
        if n < 0.01 * total:
            continue
        print(f"\n== {name}: {n} samples ({100 * n / total:.1f}% of all)")
        inclusive: Counter[str] = Counter()
        own: Counter[str] = Counter()
        for frames, count in stacks.items():
            for f in {_LINE.sub(")", f) for f in frames}:  # a function, whatever its line
                inclusive[f] += count
            own[frames[-1] if frames else "(no Python frame)"] += count
        print("  inclusive:")
        for f, c in inclusive.most_common(top):
            print(f"    {100 * c / n:5.1f}%  {f}")
        print("  self:")
        for f, c in own.most_common(top):
            print(f"    {100 * c / n:5.1f}%  {f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stacks", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--match", default=None, help="only samples whose stacks mention this")
    args = ap.parse_args()
    report(parse(args.stacks), args.top, args.match)


if __name__ == "__main__":
    main()
