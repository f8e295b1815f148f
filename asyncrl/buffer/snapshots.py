"""The buffer's snapshots: its state at each durable trainer checkpoint, so that a run
can go back to that step whole (``runtime/rewind.py``, ``--resume-from-step``).

The buffer writes ``checkpoints/buffer/step_N.ckpt`` (a buffer checkpoint, beside its
own) as soon as the trainer tells it that its checkpoint of version N is durable: the
state a crash right then would leave, every batch served after N still kept. A snapshot
is dropped once its trainer checkpoint is (``train.keep_checkpoints``). Step N is *kept
whole* while both exist.
"""

from __future__ import annotations

from pathlib import Path

STEP = "step_{:06d}"


def snapshot_dir(run_dir: Path) -> Path:
    """Where the buffer keeps its state at each durable trainer checkpoint."""
    return run_dir / "checkpoints" / "buffer"


def snapshot_path(snapshots: Path, step: int) -> Path:
    return snapshots / f"{STEP.format(step)}.ckpt"


def snapshot_steps(snapshots: Path) -> list[int]:
    """The steps ``snapshots`` holds a buffer snapshot of, oldest first."""
    if not snapshots.is_dir():
        return []
    return sorted(int(p.stem[5:]) for p in snapshots.glob("step_*.ckpt") if p.stem[5:].isdigit())


def trainer_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "trainer"


def checkpoint_steps(root: Path) -> list[int]:
    """The steps of the complete trainer checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(
        int(p.name[5:]) for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()
    )


def resumable_steps(snapshots: Path, trainer: Path) -> list[int]:
    """The steps kept whole: a trainer checkpoint under ``trainer`` and a snapshot."""
    return sorted(set(checkpoint_steps(trainer)) & set(snapshot_steps(snapshots)))


def rewind_hint(snapshots: Path, trainer: Path) -> str:
    """What a refusal to resume adds: the steps ``--resume-from-step`` can go back to
    (none: nothing)."""
    steps = resumable_steps(snapshots, trainer)
    if not steps:
        return ""
    listed = ", ".join(map(str, steps[-5:]))
    return f"; or go back to a step kept whole: --resume-from-step {steps[-1]} (steps: {listed})"


def prune_snapshots(snapshots: Path, step: int, trainer: Path) -> None:
    """Drop the snapshots older than ``step`` whose trainer checkpoint under ``trainer``
    is gone (``train.keep_checkpoints`` pruned it)."""
    kept = set(checkpoint_steps(trainer))
    for old in snapshot_steps(snapshots):
        if old < step and old not in kept:
            snapshot_path(snapshots, old).unlink(missing_ok=True)
