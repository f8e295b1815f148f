"""``asyncrl export RUN_DIR [--step N] OUT``: a run's trained policy as a plain HF folder.

A trainer checkpoint's ``policy/`` is a complete HF folder (config, generation config,
weights, tokenizer, chat template) beside the state only a resume needs; export copies
the step's (default: the newest) to ``OUT``. A LoRA run's ``policy/`` holds the merged
weights; ``--adapter`` copies its ``adapter/`` folder instead (peft's layout).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from asyncrl.checkpoints import checkpoint_dirs, trainer_dir

#: What a checkpoint's policy folder may hold that a user's model folder should not
#: (checkpoints written before the optimizer moved beside the HF folder).
_TRAINER_STATE = frozenset({"optimizer.pt", "scheduler.pt"})


class ExportError(ValueError):
    """The run, step or destination cannot be exported; the message says which."""


def checkpoint_steps(run_dir: Path) -> dict[int, Path]:
    """``{step: policy folder}`` of the run's complete checkpoints."""
    found = checkpoint_dirs(trainer_dir(run_dir)).items()
    return {
        step: path / "policy" for step, path in found if (path / "policy/config.json").is_file()
    }


def export_policy(
    run_dir: Path, out: Path, step: int | None = None, *, adapter: bool = False
) -> Path:
    """Copy step ``step``'s (default: the newest) policy folder of ``run_dir`` to ``out``
    (``adapter``: its LoRA adapter folder)."""
    run_dir, out = Path(run_dir), Path(out).resolve()
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise ExportError(
            f"{run_dir}: no trainer checkpoint with a policy folder under "
            f"{run_dir / 'checkpoints' / 'trainer'} (was it trained with checkpoints on?)"
        )
    if step is None:
        step = max(steps)
    if step not in steps:
        raise ExportError(f"{run_dir}: no checkpoint of step {step}; steps saved: {sorted(steps)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty folder: choose another OUT")
    source = steps[step].parent / "adapter" if adapter else steps[step]
    weights = "adapter_model.safetensors" if adapter else "model.safetensors"
    if adapter and not source.is_dir():
        raise ExportError(f"{source.parent}: no adapter folder (trained without --lora-rank?)")
    if not (source / weights).is_file():
        raise ExportError(f"{source}: the checkpoint has no {weights} (incomplete?)")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=lambda _dir, names: _TRAINER_STATE & set(names))
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    tokenizer = ("tokenizer.json", "tokenizer_config.json")
    if not adapter and not any((out / name).is_file() for name in tokenizer):
        print(
            f"asyncrl export: warning: {source} has no tokenizer (a checkpoint written "
            "before checkpoints held one): copy it from the base model",
            file=sys.stderr,
        )
    return out
