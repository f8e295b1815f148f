"""A run directory belongs to one job at a time, and a fresh job does not reuse a run.

``claim_run_dir`` holds an exclusive ``flock`` on ``RUN_DIR/.lock`` for the job's life (the
kernel drops it however the holder exits: no stale lock), and refuses a fresh job in a
directory that holds a run unless told to resume or overwrite it.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from asyncrl.checkpoints import checkpoint_steps, rewind_hint, snapshot_dir, trainer_dir
from asyncrl.errors import InputError
from asyncrl.runtime.rewind import rewind_run

#: What asyncrl writes in a run directory; ``overwrite`` removes these and nothing else.
RUN_FILES = (
    "checkpoints",
    "logs",
    "metrics",
    "metrics.jsonl",
    "trained.jsonl",
    "config.json",
    "config.previous.json",
    "config.json.tmp",
    "chaos.json",
    "plots",
    "rollout_data",
    "samples.jsonl",
    "tensorboard",
    "wandb",
    "weights",
    "engine_weights",
    "trainer.busy",
)
_LOCK = ".lock"
#: The run directories this flow of control holds, resolved, with their lock descriptors.
_claimed: contextvars.ContextVar[dict[Path, int] | None] = contextvars.ContextVar(
    "asyncrl_run_dirs", default=None
)


class RunDirInUse(InputError):
    """Another live job holds the run directory."""


class RunDirHoldsRun(InputError):
    """A fresh job was pointed at a directory that holds a run."""


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run's progress: trained steps or checkpoints."""
    checkpoints = run_dir / "checkpoints"
    has_checkpoints = checkpoints.is_dir() and any(checkpoints.iterdir())
    progress = any((run_dir / f).exists() for f in ("metrics.jsonl", "trained.jsonl"))
    return has_checkpoints or progress


@contextlib.contextmanager
def claim_run_dir(
    run_dir: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    buffered: bool = True,
    rewind_to: int | None = None,
) -> Iterator[Path | None]:
    """Hold ``run_dir`` for one job: ``RunDirInUse`` while another live job holds it;
    ``RunDirHoldsRun`` when it holds a run and neither ``resume`` nor ``overwrite`` (which
    removes asyncrl's own files only) is given. Re-entrant within one flow of control (a
    ``ContextVar``: the CLI claims, then ``run_job`` again); two jobs in one process are two
    claims. Local actors inherit the lock (``lock_fds``): the run stays claimed until the
    last has exited. ``buffered``: the job has a buffer (a train-only job from rollout
    files has none), whose checkpoint a resume needs beside the trainer's. ``rewind_to``:
    first go back to that step (``runtime/rewind.py``); yields where the later state went."""
    if (resume or rewind_to is not None) and overwrite:
        flag = "--resume" if rewind_to is None else "--resume-from-step"
        raise InputError(
            f"{flag} continues the run in the directory and --overwrite deletes it: give one"
        )
    key = _make(run_dir).resolve()
    held = _claimed.get() or {}
    if key in held:  # the same job, claiming again further in
        yield None
        return
    fd = _lock(key)
    try:
        aside = None if rewind_to is None else rewind_run(key, rewind_to)
        resume = resume or rewind_to is not None
        _check_fresh(key, resume=resume, overwrite=overwrite, buffered=buffered)
        token = _claimed.set({**held, key: fd})
        try:
            yield aside
        finally:
            _claimed.reset(token)
    finally:
        os.close(fd)  # the children that inherited it keep the lock until they exit


#: An actor process's copy of the lock's descriptor, by number (``keep_lock_to_self``).
LOCK_FD_ENV = "ASYNCRL_RUN_LOCK_FD"


def keep_lock_to_self() -> None:
    """In an actor process: keep the inherited lock, but out of what it executes.

    Daemons an actor starts (torch's shm manager, which the ipc transport starts with
    a fork and exec that keeps every inheritable descriptor) would otherwise hold the
    run claimed for seconds after the job, and a ``--resume`` right after it would be
    refused. They never write to the run directory.
    """
    fd = os.environ.pop(LOCK_FD_ENV, None)
    if fd is not None:
        with contextlib.suppress(OSError, ValueError):  # not ours, or closed: nothing held
            os.set_inheritable(int(fd), False)


def lock_fds(run_dir: Path) -> tuple[int, ...]:
    """The lock descriptor this flow of control holds for ``run_dir`` (for a child
    process to inherit), or none."""
    fd = (_claimed.get() or {}).get(run_dir.resolve())
    return () if fd is None else (fd,)


def _make(run_dir: Path) -> Path:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the run directory {run_dir}: {exc.strerror}") from None
    return run_dir


def _lock(run_dir: Path) -> int:
    """An exclusive lock on ``run_dir``'s lock file, with this process's name in it."""
    try:
        fd = os.open(run_dir / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # read-only (a mount, permissions): the job could write nothing
        raise InputError(
            f"the run directory {run_dir} is not writable ({exc.strerror}): the job writes "
            "its logs, metrics and checkpoints there; give another --output-dir"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise RunDirInUse(
            f"the run directory {run_dir} is in use by another job ({holder}, or its actors, "
            "which may still be stopping); wait for it to end, stop it, or give this job "
            "another --output-dir"
        ) from None
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%FT%T%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    return fd


def _read_holder(fd: int) -> str:
    try:
        who = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {who['pid']} on {who['host']}, since {who['since']}"
    except (ValueError, KeyError, OSError):
        return "holder unknown"


def _check_fresh(run_dir: Path, *, resume: bool, overwrite: bool, buffered: bool) -> None:
    if resume:
        if buffered:
            _check_resumable(run_dir)
        return
    if not holds_run(run_dir):
        return
    if not overwrite:
        raise RunDirHoldsRun(
            f"{run_dir} holds a run (checkpoints or metrics): continue it with --resume, "
            "start over with --overwrite (deletes that run's files), or give this job "
            "another --output-dir"
        )
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def _check_resumable(run_dir: Path) -> None:
    """Trainer checkpoints without the buffer's: resuming would serve the data again from
    the start to a trainer that has trained on it."""
    trainer = trainer_dir(run_dir)
    steps = checkpoint_steps(trainer)
    buffer = run_dir / "checkpoints" / "buffer.ckpt"
    if steps and not buffer.exists():
        raise RunDirHoldsRun(
            f"{run_dir} has trainer checkpoints but no buffer checkpoint ({buffer}): "
            "resuming would hand out again the prompts already trained on; restore it, or "
            f"start over with --overwrite{rewind_hint(snapshot_dir(run_dir), trainer)}"
        )
