"""Go back to an earlier step of a run: ``asyncrl train --resume-from-step N``.

A step kept whole (the trainer's checkpoint and the buffer's snapshot of it,
``checkpoints.py``) is the run as a crash right then would have left it, so a run whose
journal was lost or cut, or whose newer checkpoints are gone, goes on exactly from there.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl.checkpoints import (
    STEP,
    checkpoint_steps,
    resumable_steps,
    snapshot_dir,
    snapshot_path,
    snapshot_steps,
    trainer_dir,
)
from asyncrl.errors import InputError


def rewind_run(run_dir: Path, step: int) -> Path:
    """Make ``run_dir`` the run as it was at ``step``: what came after it (newer trainer
    checkpoints and snapshots, the buffer's checkpoint and journal, the later rows of
    ``metrics.jsonl``, ``trained.jsonl``, ``samples.jsonl`` and ``metrics/eval.jsonl``)
    is moved aside, nothing deleted, and the snapshot becomes the buffer's checkpoint.
    Returns where the later state went; ``InputError`` when ``step`` was not kept whole."""
    steps = resumable_steps(snapshot_dir(run_dir), trainer_dir(run_dir))
    if step not in steps:
        raise InputError(_not_kept(run_dir, step, steps))
    ckpt = run_dir / "checkpoints"
    aside = ckpt / f"rewound-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-from-{step}"
    aside.mkdir(parents=True)
    # The logs first, each replaced whole; the buffer's checkpoint last: a rewind cut
    # short leaves a run that --resume refuses (naming this step) and a rerun finishes.
    # Version v is the trainer after v steps; the batch of step s makes version s + 1.
    _cut(run_dir / "metrics.jsonl", aside, lambda r: r.get("step", 0) <= step)
    _cut(run_dir / "trained.jsonl", aside, lambda r: r.get("step", 0) < step)
    _cut(run_dir / "samples.jsonl", aside, lambda r: r.get("step", 0) <= step)
    _cut(run_dir / "metrics" / "eval.jsonl", aside, lambda r: r.get("version", 0) <= step)
    for later in checkpoint_steps(trainer_dir(run_dir)):
        if later > step:
            _move(trainer_dir(run_dir) / STEP.format(later), aside / "trainer")
    snapshots = snapshot_dir(run_dir)
    for later in snapshot_steps(snapshots):
        if later > step:
            _move(snapshot_path(snapshots, later), aside / "buffer")
    for name in ("buffer.ckpt", "buffer.journal"):
        if (ckpt / name).exists():
            _move(ckpt / name, aside)
    shutil.copyfile(snapshot_path(snapshots, step), ckpt / "buffer.ckpt")
    return aside


def _not_kept(run_dir: Path, step: int, steps: list[int]) -> str:
    if steps:
        return (
            f"--resume-from-step {step}: {run_dir} has no trainer checkpoint and buffer "
            f"snapshot both of step {step}; the steps it can go back to: "
            f"{', '.join(map(str, steps))}"
        )
    return (
        f"--resume-from-step {step}: {run_dir} kept no step whole (a trainer checkpoint "
        "and the buffer's snapshot of it, written with train.checkpoint_interval > 0); "
        "resume with --resume, or start over with --overwrite"
    )


def _move(path: Path, into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    path.rename(into / path.name)


def _cut(path: Path, aside: Path, keep: Callable[[dict], bool]) -> None:
    """Keep the rows of ``path`` that ``keep`` accepts (the file replaced whole); the file
    as it was is copied aside."""
    if not path.is_file():
        return
    copy = aside / path.relative_to(aside.parent.parent)
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, copy)
    kept = [line for line in path.read_text().splitlines() if _kept(line, keep)]
    tmp = path.with_name(path.name + ".rewound")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


def _kept(line: str, keep: Callable[[dict], bool]) -> bool:
    try:
        return keep(json.loads(line))
    except ValueError:  # a row cut short by the crash: it stays in the copy aside
        return False
