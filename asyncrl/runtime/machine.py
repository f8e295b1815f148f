"""What this machine has, and how a local job spends it: said once at start, so a user
sees the threads and precision each torch process got without reading the config."""

from __future__ import annotations

from collections import Counter

from asyncrl import hardware
from asyncrl.actors.base import ActorSpec
from asyncrl.config import RunConfig
from asyncrl.engines.config import sampled_dtype


def describe(cfg: RunConfig, specs: list[ActorSpec]) -> str:
    """One line: cores, bf16, and per torch process its threads and dtype, e.g.
    ``2 cores, bf16 instructions: trainer float32 x 2 threads (micro-batches of 1024
    tokens); 1 engine float32 x 1 thread (2 while the trainer waits); eval x 1 thread``.
    On Ray the cores are the controller's, and each actor's threads are as set."""
    bf16 = hardware.cpu_bf16()
    parts = []
    trainer = next((s for s in specs if s.role == "trainer"), None)
    if trainer is not None and cfg.trainer is not None:
        parts.append(f"trainer {cfg.trainer.dtype} x {_threads(trainer)} (micro-batches of "
                     f"{cfg.trainer.microbatch_tokens} tokens)")  # fmt: skip
    if engines := _engines(cfg, specs):
        parts.append(engines)
    for role in ("eval", "reward"):
        parts += [f"{role} x {_threads(s)}" for s in specs if s.role == role]
    where = " (the controller's; on Ray)" if cfg.runtime.type == "ray" else ""
    head = f"{hardware.usable_cores()} cores{where}" + (", bf16 instructions" if bf16 else "")
    return f"{head}: " + "; ".join(parts) + _dtype_hint(cfg, bf16)


def _engines(cfg: RunConfig, specs: list[ActorSpec]) -> str:
    """The engines: embedded torch ones in the rollout actors, or engine actors (a torch
    engine behind HTTP, or a vLLM / SGLang server, whose threads are its own)."""
    engine = cfg.rollout.engine
    kind = "torch" if engine is None else engine.type
    hosts = [s for s in specs if s.role == ("rollout" if _embedded(cfg) else "engine")]
    if not hosts:
        return f"{kind} engines at {len(engine.urls)} urls" if engine and engine.urls else ""
    plural = "s" if len(hosts) > 1 else ""
    if kind != "torch":
        return f"{len(hosts)} {kind} engine{plural}"
    trainer = cfg.trainer
    default = sampled_dtype(trainer.dtype, trainer.model_path) if trainer else "float32"
    dtype = engine.dtype if engine else default
    threads = " / ".join(Counter(_threads(s) for s in hosts))
    return f"{len(hosts)} engine{plural} {dtype} x {threads}"


def _dtype_hint(cfg: RunConfig, bf16: bool) -> str:
    """Where the trainer's or a CPU torch engine's precision disagrees with what
    ``dtype: auto`` picks here (``hardware.low_precision_pays``), what to set instead."""
    if cfg.trainer is None or _cuda(cfg):
        return ""
    low = cfg.trainer.dtype != "float32"
    if not low and hardware.low_precision_pays(cfg.trainer.model_path):
        return (
            " (this CPU computes bf16 natively: SmolLM2-135M's trainer steps ran "
            "1.6-1.7x faster in bf16-mixed on such a CPU: --trainer.dtype bf16-mixed)"
        )
    if bf16:
        return ""
    slow = {"--trainer.dtype": cfg.trainer.dtype} if low else {}
    engine = cfg.rollout.engine
    if engine is not None and engine.type == "torch" and engine.device == "cpu":
        if engine.dtype in ("bfloat16", "float16"):  # set: auto picked float32 here
            slow["--rollout.engine.dtype"] = engine.dtype
    if not slow:
        return ""
    said = " and ".join(f"{flag} {dtype}" for flag, dtype in slow.items())
    fix = " ".join(f"{flag} float32" for flag in slow)
    return (
        f" (this CPU has no native bf16: a bf16 matmul ran at a tenth of float32's or "
        f"less on such a CPU; {said} will be slow: {fix})"
    )


def _threads(spec: ActorSpec) -> str:
    n = spec.threads
    text = "torch's threads" if n is None else f"{n} thread{'s' if n > 1 else ''}"
    if spec.idle_trainer_threads is not None:  # cores the trainer lends (cores.py)
        text += f" ({spec.idle_trainer_threads} while the trainer waits)"
    return text


def _embedded(cfg: RunConfig) -> bool:
    engine = cfg.rollout.engine
    return engine is None or (engine.type == "torch" and engine.serve == "embedded")


def _cuda(cfg: RunConfig) -> bool:
    return cfg.trainer is not None and cfg.trainer.device.startswith("cuda")
