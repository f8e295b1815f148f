"""What this machine computes with, and what pays on it: its usable cores, whether its CPU
does bf16 natively, and whether a model is wide enough for more threads or bf16 to pay;
and how its CPU time was spent (``cpu_times``: a VM's stolen time, for timed benches).

A local job's defaults follow from these: the threads each torch process gets and the
core loan (``job.py``), and ``dtype: auto`` (``low_precision_pays``); the start line
says what was chosen (``runtime/machine.py``). No torch here: the config reads it.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

#: CPU flags of native bf16 arithmetic (torch's bf16 matmuls run at 2-3x fp32 with them,
#: at a tenth of it without: docs/numerics.md).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})

#: Below this hidden size a step's matmuls are too small for a second thread or for bf16
#: to pay: the 1M arith toy (hidden 128) ran 0.91x with the core loan; SmolLM2-135M
#: (hidden 576) trained 1.6-1.7x faster in bf16-mixed.
MIN_HIDDEN = 256


@cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's flags from ``/proc/cpuinfo`` (none where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's share, not the
    host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


#: ``/proc/stat``'s per-CPU time columns, in its order.
CPU_COLUMNS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
CpuTimes = dict[str, int]


def cpu_times(stat: Path = Path("/proc/stat")) -> CpuTimes | None:
    """The whole machine's CPU time so far by kind, in clock ticks (``/proc/stat``'s
    ``cpu`` line), or None where there is no such file."""
    try:
        with stat.open() as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    return dict(zip(CPU_COLUMNS, map(int, fields[1:]), strict=False))


def cpu_shares(before: CpuTimes | None, after: CpuTimes | None) -> dict[str, float] | None:
    """Each kind's share of the CPU time between two ``cpu_times`` readings:
    ``share_k = (after_k - before_k) / sum_j (after_j - before_j)``. ``steal`` is the time
    a virtual machine's cores waited for the host: a timed run beside a busy neighbour
    shows it, where the guest's own load does not."""
    if before is None or after is None:
        return None
    spent = {k: after[k] - before[k] for k in after if k in before}
    total = sum(spent.values())
    return {k: v / total for k, v in spent.items()} if total > 0 else None


def available_memory(root: Path = Path("/")) -> int | None:
    """Bytes this process may still take without swapping or its container's OOM kill:
    the host's ``MemAvailable``, or less when a cgroup (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``) leaves less. None where ``/proc/meminfo`` does not say."""
    try:
        text = (root / "proc/meminfo").read_text()
    except OSError:
        return None
    line = next((x for x in text.splitlines() if x.startswith("MemAvailable:")), "")
    fields = line.split()
    if len(fields) < 2 or not fields[1].isdigit():
        return None
    free = int(fields[1]) * 1024
    cgroup = root / "sys/fs/cgroup"
    for limit, usage in _CGROUP_MEMORY:
        left = _cgroup_left(cgroup / limit, cgroup / usage)
        if left is not None:
            return min(free, left)
    return free


#: A cgroup's memory limit and usage files, v2 then v1.
_CGROUP_MEMORY = (
    ("memory.max", "memory.current"),
    ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
)


def _cgroup_left(limit: Path, usage: Path) -> int | None:
    """``limit - usage`` in bytes; None without a limit ("max", or v1's huge number)."""
    try:
        cap, used = limit.read_text().strip(), int(usage.read_text().strip())
    except (OSError, ValueError):
        return None
    if not cap.isdigit() or int(cap) >= 1 << 60:
        return None
    return max(int(cap) - used, 0)


def cpu_bf16() -> bool:
    """Whether this CPU computes bf16 natively."""
    return bool(BF16_FLAGS & cpu_flags())


def model_hidden(model_path: str | None) -> int | None:
    """The hidden size in the HF ``config.json`` at ``model_path`` (None if unknown)."""
    if not model_path:
        return None
    try:
        config = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    hidden = config.get("hidden_size", config.get("n_embd", config.get("d_model")))
    return hidden if isinstance(hidden, int) else None


def wide_model(model_path: str | None) -> bool:
    """Whether the model is at least ``MIN_HIDDEN`` wide (unknown: assume so)."""
    hidden = model_hidden(model_path)
    return hidden is None or hidden >= MIN_HIDDEN


def low_precision_pays(model_path: str | None, device: str = "cpu") -> bool:
    """``dtype: auto``'s rule: compute in bf16 on a GPU, and on a CPU with native bf16
    (``BF16_FLAGS``) for a model at least ``MIN_HIDDEN`` wide; else float32."""
    if device.startswith("cuda"):
        return True
    return cpu_bf16() and wide_model(model_path)
