"""Where a run keeps its checkpoints, and which steps it can go back to.

``checkpoints/trainer/step_N/`` is the trainer's checkpoint of version N (HF weights in
``policy/``); ``checkpoints/buffer/step_N.ckpt`` the buffer's state once that checkpoint
was durable. Step N is *kept whole* while both exist: ``--resume-from-step N`` can go back
to it (``docs/reliability.md``).
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
    return sorted(n for p in snapshots.glob("step_*.ckpt") if (n := step_of(p.stem)) is not None)


def trainer_dir(run_dir: Path) -> Path:
    """Where the trainer's checkpoints of ``run_dir`` are."""
    return run_dir / "checkpoints" / "trainer"


def step_dir(root: Path, step: int) -> Path:
    """The trainer's checkpoint of ``step`` under ``root`` (``trainer_dir``)."""
    return root / STEP.format(step)


def checkpoint_dirs(root: Path) -> dict[int, Path]:
    """``{step: folder}`` of the complete trainer checkpoints under ``root``, oldest
    first (a ``.tmp`` being written, or an ``.old`` being replaced, is not one)."""
    if not root.is_dir():
        return {}
    found = {n: p for p in root.glob("step_*") if p.is_dir() and (n := step_of(p.name)) is not None}
    return dict(sorted(found.items()))


def step_of(name: str) -> int | None:
    """The step a ``STEP`` name holds; None for any other (``step_10`` beside
    ``step_000010`` would be a second folder of one step: neither found nor pruned)."""
    digits = name[len("step_") :]
    if not name.startswith("step_") or not digits.isdigit():
        return None
    return int(digits) if STEP.format(int(digits)) == name else None


def checkpoint_steps(root: Path) -> list[int]:
    """The steps of the complete trainer checkpoints under ``root``, oldest first."""
    return list(checkpoint_dirs(root))


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
