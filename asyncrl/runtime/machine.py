"""What this machine has, and how a local job spends it: said once at start, so a user
sees the threads and precision each torch process got without reading the config."""

from __future__ import annotations

import os
from collections import Counter
from functools import cache
from pathlib import Path

from asyncrl.actors.base import ActorSpec
from asyncrl.config import RunConfig

#: CPU flags of native bf16 arithmetic (torch's bf16 matmuls run at 2-3x fp32 with them,
#: at a tenth of it without: docs/numerics.md).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's flags from ``/proc/cpuinfo`` (none where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_bf16() -> bool:
    """Whether this CPU computes bf16 natively."""
    return bool(BF16_FLAGS & cpu_flags())


def describe(cfg: RunConfig, specs: list[ActorSpec]) -> str:
    """One line: cores, bf16, and per torch process its threads and dtype, e.g.
    ``2 cores, bf16 instructions: trainer float32 x 2 threads (micro-batches of 1024
    tokens); 1 engine float32 x 1 thread; eval x 1 thread``."""
    bf16 = cpu_bf16()
    parts = []
    trainer = next((s for s in specs if s.role == "trainer"), None)
    if trainer is not None:
        parts.append(f"trainer {cfg.trainer.dtype} x {_threads(trainer)} (micro-batches of "
                     f"{cfg.trainer.max_tokens_per_microbatch} tokens)")  # fmt: skip
    engines = [s for s in specs if s.role == "rollout" and _embedded(cfg)]
    engines += [s for s in specs if s.role == "engine"]
    if engines:
        dtype = cfg.rollout.engine.dtype if cfg.rollout.engine else "float32"
        counts = Counter(_threads(s) for s in engines)
        threads = " / ".join(counts)
        parts.append(f"{len(engines)} engine{'s' if len(engines) > 1 else ''} {dtype} x {threads}")
    for role in ("eval", "reward"):
        parts += [f"{role} x {_threads(s)}" for s in specs if s.role == role]
    head = f"{os.cpu_count() or 1} cores" + (", bf16 instructions" if bf16 else "")
    line = f"{head}: " + "; ".join(parts)
    if bf16 and cfg.trainer.dtype == "float32" and not _cuda(cfg):
        line += (" (this CPU computes bf16 natively: the trainer's bf16-mixed steps ran "
                 "1.6-1.7x float32's on such a CPU, --trainer.dtype bf16-mixed)")  # fmt: skip
    return line


def _threads(spec: ActorSpec) -> str:
    n = spec.threads
    return "torch's threads" if n is None else f"{n} thread{'s' if n > 1 else ''}"


def _embedded(cfg: RunConfig) -> bool:
    engine = cfg.rollout.engine
    return engine is None or (engine.type == "torch" and engine.serve == "embedded")


def _cuda(cfg: RunConfig) -> bool:
    return cfg.trainer is not None and cfg.trainer.device.startswith("cuda")
