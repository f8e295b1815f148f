"""The Python API: build a job's config, run it, read what it produced.

    cfg = asyncrl.make_config("examples/arith/config.yaml", {"train.num_steps": 20, "lr": 1e-5})
    run = asyncrl.train(cfg)              # blocks; asyncrl.JobFailed says why it failed
    run.metrics[-1]["reward/mean"], run.evals, run.checkpoints, run.export("out")
    run = asyncrl.open_run("runs/arith")  # a finished run's results, from its folder

``asyncrl train`` is ``run_training`` and a printout.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import ConfigError, RunConfig, config_changes, dump_resolved, load_config
from asyncrl.job import JobResult, run_job

if TYPE_CHECKING:
    from asyncrl.runtime.chaos import Chaos

__all__ = [
    "ConfigError",
    "JobFailed",
    "Run",
    "RunConfig",
    "make_config",
    "open_run",
    "train",
    "train_async",
]


def make_config(
    path: str | Path | None = None,
    settings: Mapping[str, Any] | None = None,
    *,
    preset: str | None = None,
) -> RunConfig:
    """A job's validated config from ``preset``, the YAML file ``path`` and ``settings``
    (later wins), keyed by config key (``trainer.lr``) or flag name (``lr``; ``_`` and
    ``-`` are one); ``ConfigError`` lists every problem, naming key and flag."""
    overrides = {_flag(key): value for key, value in (settings or {}).items()}
    return load_config(path, overrides, preset=preset)


def _flag(key: str) -> str:
    return "--" + key.removeprefix("--").replace("_", "-")


class JobFailed(RuntimeError):
    """The job ended without finishing: ``run`` holds its result and folder."""

    def __init__(self, run: Run) -> None:
        reason = run.result.error if run.result else "no result"
        super().__init__(f"job {run.run_dir} failed: {reason}")
        self.run = run


@dataclass
class Run:
    """A job's folder and, when this process ran it, how it ended (``result``)."""

    run_dir: Path
    result: JobResult | None = None

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok

    @cached_property
    def metrics(self) -> list[dict[str, Any]]:
        """The trainer's rows, one per step (``metrics.jsonl``)."""
        return _jsonl(self.run_dir / "metrics.jsonl")

    @cached_property
    def evals(self) -> list[dict[str, Any]]:
        """The eval actor's rows, one per version and set (``metrics/eval.jsonl``)."""
        return _jsonl(self.run_dir / "metrics" / "eval.jsonl")

    @property
    def checkpoints(self) -> dict[int, Path]:
        """``{step: policy folder}`` of the run's complete trainer checkpoints."""
        from asyncrl.export import checkpoint_steps

        return checkpoint_steps(self.run_dir)

    def export(self, out: str | Path, step: int | None = None, *, adapter: bool = False) -> Path:
        """A checkpoint's policy (default: the newest) as a plain HF folder ``out``
        (``adapter``: a LoRA run's adapters, in peft's layout)."""
        from asyncrl.export import export_policy

        return export_policy(self.run_dir, Path(out), step, adapter=adapter)


def open_run(run_dir: str | Path) -> Run:
    """The results of the run in ``run_dir`` (finished, or still running)."""
    path = Path(run_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no asyncrl run here (no config.json)")
    return Run(path)


def train(
    cfg: RunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    resume_from_step: int | None = None,
) -> Run:
    """Run ``cfg`` to its end, blocking; ``JobFailed`` if it does not finish. A job refused
    before it starts raises ``PreflightError`` or ``InputError`` (both
    ``asyncrl.errors.InputError``) with every problem."""
    job = train_async(cfg, resume=resume, overwrite=overwrite, resume_from_step=resume_from_step)
    return asyncio.run(job)


async def train_async(
    cfg: RunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    resume_from_step: int | None = None,
) -> Run:
    """``train`` in the running event loop."""
    run = Run(cfg.resolved_output_dir())
    run.result = await run_training(
        cfg, resume=resume, overwrite=overwrite, resume_from_step=resume_from_step
    )
    if not run.result.ok:
        raise JobFailed(run)
    return run


async def run_training(
    cfg: RunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    checked: bool = False,
    chaos: Chaos | None = None,
    resume_from_step: int | None = None,
) -> JobResult:
    """The job as ``asyncrl train`` runs it: checked (``preflight``, unless ``checked``:
    ``PreflightError`` lists every problem), the run folder held (``InputError`` when
    another job holds it, or a run is there without ``resume`` or ``overwrite``), the
    controller's log and the resolved config written, then ``run_job`` (with ``chaos``'s
    kills: ``asyncrl chaos``). Nothing starts before those errors. ``resume_from_step``:
    resume from that earlier step instead of the newest (``runtime/rewind.py``)."""
    from asyncrl.observe.logs import configure_logging, get_logger
    from asyncrl.preflight import preflight
    from asyncrl.runtime.run_dir import claim_run_dir

    prestart(cfg)
    if not checked:
        await asyncio.to_thread(preflight, cfg)
    run_dir = cfg.resolved_output_dir()
    buffered = not cfg.train.load_rollout_data
    claim = claim_run_dir(
        run_dir, resume=resume, overwrite=overwrite, buffered=buffered, rewind_to=resume_from_step
    )
    with claim as rewound:
        configure_logging(
            level=cfg.log.level,
            fmt=cfg.log.format,
            file=run_dir / "logs" / "controller.jsonl",
            actor="controller",
        )
        if rewound is not None:
            get_logger("asyncrl.controller").warning(
                "went back to an earlier step", step=resume_from_step, moved_aside=str(rewound)
            )
        resume = resume or resume_from_step is not None
        record_config(cfg, run_dir, resume=resume)
        return await run_job(cfg, resume=resume, checked=True, chaos=chaos)


def record_config(cfg: RunConfig, run_dir: Path, *, resume: bool) -> None:
    """``config.json``: this start's resolved config. A resume that changes settings says
    which and keeps the last start's as ``config.previous.json`` (a resume refused later,
    on other data say, must not leave the run's record of them overwritten)."""
    path = run_dir / "config.json"
    if resume and _say_what_changed(cfg, path):
        shutil.copy2(path, run_dir / "config.previous.json")
    dump_resolved(cfg, path)


def _say_what_changed(cfg: RunConfig, path: Path) -> bool:
    """Log each resolved setting a resumed run changes against its last start (its
    ``config.json``): a flag, or a default chosen for the machine (``dtype: auto``).
    Whether any changed."""
    from asyncrl.observe.logs import get_logger

    log = get_logger("asyncrl.controller")
    try:
        before = json.loads(path.read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as exc:
        log.warning("the run's earlier config is unreadable: not compared", path=str(path),
                    error=str(exc))  # fmt: skip
        return False
    if changes := config_changes(before, cfg):
        log.warning("resumed with a changed config", changes=changes,
                    previous=str(path.with_name("config.previous.json")))  # fmt: skip
    return bool(changes)


def prestart(cfg: RunConfig) -> None:
    """A local job's zygote starts importing now, beside the checks before launch."""
    if cfg.runtime.type == "local" and cfg.runtime.fork_server:
        from asyncrl.runtime.forks import prestart_zygote

        prestart_zygote(os.environ)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
