"""A ``torch.profiler`` table of one region, for finding where a GPU run's time goes.

    with profiled("asyncrl step", enabled=args.profile):
        ...

prints the top ops by self CPU time and, on a GPU, by self device time to stderr: a
region whose CPU time is its wall time and whose device time is small is bound by the
host (Python, launches, syncs), not by the GPU.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def profiled(title: str, *, enabled: bool = True, rows: int = 22) -> Iterator[None]:
    if not enabled:
        yield
        return
    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        yield
        if gpu:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("self_cpu_time_total", "self_device_time_total")[: 1 + gpu]:
        table = averages.table(sort_by=key, row_limit=rows, max_name_column_width=48)
        print(f"== {title}: top ops by {key}\n{table}", file=sys.stderr, flush=True)
