"""What this machine computes with, and what pays on it: its usable cores, whether its CPU
does bf16 natively, and whether a model is wide enough for more threads or bf16 to pay.

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


def available_memory() -> int | None:
    """Bytes of memory the kernel can give without swapping (``MemAvailable``; None where
    ``/proc/meminfo`` does not say)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    line = next((x for x in text.splitlines() if x.startswith("MemAvailable:")), "")
    fields = line.split()
    return int(fields[1]) * 1024 if len(fields) >= 2 and fields[1].isdigit() else None


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
