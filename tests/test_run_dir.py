"""A run directory belongs to one job, and a fresh job does not reuse a run
(``asyncrl/runtime/run_dir.py``): a second job is refused while the first runs, a run is
continued with --resume or deleted with --overwrite, and nothing else a user keeps there
is touched."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.errors import InputError
from asyncrl.runtime.run_dir import RunDirHoldsRun, RunDirInUse, claim_run_dir
from tests.test_train import job_flags, write_prompts
from tests.tiny_model import build_tiny_model

HOLD = """
import sys, time
from pathlib import Path
from asyncrl.runtime.run_dir import claim_run_dir
with claim_run_dir(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_job_is_refused_while_another_process_holds_the_directory(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUse, match=rf"in use by another job \(pid {holder.pid} on"):
            with claim_run_dir(tmp_path / "run"):
                pass
    finally:
        holder.kill()  # a killed holder leaves no stale lock: the kernel drops it
        holder.wait()
    with claim_run_dir(tmp_path / "run"):
        with claim_run_dir(tmp_path / "run"):  # re-entrant in one process
            pass


def a_finished_run(run_dir: Path) -> None:
    (run_dir / "checkpoints" / "trainer" / "step_000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "buffer.ckpt").write_bytes(b"state")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "samples.jsonl").write_text('{"step": 1, "text": "old"}\n')
    for name in ("wandb", "engine_weights"):
        (run_dir / name).mkdir(exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "notes.txt").write_text("mine")


def test_a_fresh_job_in_a_directory_with_a_run_is_refused_unless_resumed_or_overwritten(
    tmp_path,
):
    run = tmp_path / "run"
    with claim_run_dir(run):  # an empty (or log-only) directory is free to use
        (run / "logs").mkdir()
    with claim_run_dir(run):
        pass
    a_finished_run(run)
    with pytest.raises(RunDirHoldsRun, match=r"holds a run.*--resume.*--overwrite"):
        with claim_run_dir(run):
            pass
    with claim_run_dir(run, resume=True):
        assert (run / "metrics.jsonl").exists()
    with pytest.raises(InputError, match="give one"):
        with claim_run_dir(run, resume=True, overwrite=True):
            pass
    with claim_run_dir(run, overwrite=True):
        assert sorted(p.name for p in run.iterdir()) == [".lock", "notes.txt"]
    a_finished_run(run)
    (run / "checkpoints" / "buffer.ckpt").unlink()
    with pytest.raises(RunDirHoldsRun, match="trainer checkpoints but no buffer checkpoint"):
        with claim_run_dir(run, resume=True):
            pass
    with claim_run_dir(run, resume=True, buffered=False):  # a train-only job has no buffer
        pass


def test_two_jobs_in_one_process_are_two_claims(tmp_path):
    """Re-entrant within one flow of control, not across two jobs of one process."""
    with claim_run_dir(tmp_path / "run"):
        with ThreadPoolExecutor(1) as pool:  # another job's thread: a fresh context
            other = pool.submit(lambda: claim_run_dir(tmp_path / "run").__enter__())
            with pytest.raises(RunDirInUse):
                other.result()


def test_a_run_directory_that_cannot_be_made_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match="cannot create the run directory"):
        with claim_run_dir(tmp_path / "file" / "run"):
            pass


def test_a_run_directory_the_job_cannot_write_in_is_a_clear_error(tmp_path, monkeypatch):
    """A read-only mount (or permissions; a root user ignores mode bits, so the kernel's
    answer is simulated): named with the reason, no traceback."""
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).startswith(str(tmp_path / "run")) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    (tmp_path / "run").mkdir()
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(InputError, match=r"run is not writable \(Read-only file system\)"):
        with claim_run_dir(tmp_path / "run"):
            pass


def test_train_refuses_a_directory_with_a_run_before_writing_anything(tmp_path, capsys):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    run = tmp_path / "run"
    a_finished_run(run)
    (run / "config.json").write_text('{"old": true}')
    assert main(["train", *job_flags(tmp_path, steps=1)]) == 2
    assert "holds a run" in capsys.readouterr().err
    assert json.loads((run / "config.json").read_text()) == {"old": True}
    assert not (run / "logs" / "controller.jsonl").exists()


def fake_run(run_dir: Path, trainer: list[int], snapshots: list[int], steps: int) -> None:
    """A run's files as asyncrl lays them out: trainer checkpoints, the buffer's
    snapshots, its checkpoint and journal, and one row per step in each log."""
    ckpt = run_dir / "checkpoints"
    for step in trainer:
        (ckpt / "trainer" / f"step_{step:06d}").mkdir(parents=True)
    (ckpt / "buffer").mkdir(parents=True)
    for step in snapshots:
        (ckpt / "buffer" / f"step_{step:06d}.ckpt").write_bytes(f"state at {step}".encode())
    (ckpt / "buffer.ckpt").write_bytes(b"newest state")
    (ckpt / "buffer.journal").write_bytes(b"journal")
    rows = [json.dumps({"step": s}) for s in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 9, "lo')  # torn
    batches = [json.dumps({"batch": s, "step": s}) for s in range(steps)]
    (run_dir / "trained.jsonl").write_text("\n".join(batches) + "\n")
    (run_dir / "metrics").mkdir()
    evals = [json.dumps({"version": v}) for v in range(0, steps + 1, 2)]
    (run_dir / "metrics" / "eval.jsonl").write_text("\n".join(evals) + "\n")


def test_a_run_goes_back_to_a_step_kept_whole_and_moves_the_rest_aside(tmp_path):
    run_dir = tmp_path / "run"
    fake_run(run_dir, trainer=[4, 6, 8], snapshots=[2, 4, 6, 8], steps=8)
    for step, kept in ((2, "4, 6, 8"), (5, "4, 6, 8")):  # no trainer checkpoint; none at all
        with pytest.raises(InputError, match=f"step {step}; the steps it can go back to: {kept}"):
            with claim_run_dir(run_dir, rewind_to=step):
                pass
    with claim_run_dir(run_dir, rewind_to=4) as aside:
        assert aside is not None and aside.parent == run_dir / "checkpoints"
    ckpt = run_dir / "checkpoints"
    assert sorted(p.name for p in (ckpt / "trainer").iterdir()) == ["step_000004"]
    assert (ckpt / "buffer.ckpt").read_bytes() == b"state at 4"
    assert not (ckpt / "buffer.journal").exists()
    assert sorted(p.name for p in (ckpt / "buffer").iterdir()) == ["step_000002.ckpt",
                                                                   "step_000004.ckpt"]  # fmt: skip

    def column(path: Path, key: str) -> list[int]:
        return [json.loads(x)[key] for x in path.read_text().splitlines()]

    # Version v is the trainer after v steps; the batch of step s made version s + 1.
    assert column(run_dir / "metrics.jsonl", "step") == [1, 2, 3, 4]
    assert column(run_dir / "trained.jsonl", "step") == [0, 1, 2, 3]
    assert column(run_dir / "metrics" / "eval.jsonl", "version") == [0, 2, 4]
    # Nothing is deleted: what came after step 4 is aside, the files as they were.
    assert (aside / "buffer.ckpt").read_bytes() == b"newest state"
    assert (aside / "buffer.journal").read_bytes() == b"journal"
    assert sorted(p.name for p in (aside / "trainer").iterdir()) == ["step_000006", "step_000008"]
    assert len(column(aside / "trained.jsonl", "step")) == 8
    assert (aside / "metrics" / "eval.jsonl").is_file()
    assert (aside / "metrics.jsonl").read_text().endswith('"lo')


def test_a_run_that_kept_no_step_whole_says_how_to_go_on(tmp_path):
    run_dir = tmp_path / "run"
    fake_run(run_dir, trainer=[4], snapshots=[], steps=4)
    with pytest.raises(InputError, match=r"kept no step whole .*checkpoint_interval > 0"):
        with claim_run_dir(run_dir, rewind_to=4):
            pass
    assert (run_dir / "checkpoints" / "buffer.journal").is_file()  # nothing moved
    with pytest.raises(InputError, match="give one"):
        with claim_run_dir(run_dir, rewind_to=4, overwrite=True):
            pass


def test_snapshots_go_with_their_trainer_checkpoints(tmp_path):
    from asyncrl.checkpoints import prune_snapshots, rewind_hint

    run_dir = tmp_path / "run"
    fake_run(run_dir, trainer=[6, 8], snapshots=[2, 4, 6, 8], steps=8)
    snapshots, trainer = run_dir / "checkpoints" / "buffer", run_dir / "checkpoints" / "trainer"
    prune_snapshots(snapshots, 8, trainer)  # 2 and 4 were pruned by the trainer
    assert sorted(p.name for p in snapshots.iterdir()) == ["step_000006.ckpt", "step_000008.ckpt"]
    assert rewind_hint(snapshots, trainer).endswith("--resume-from-step 8 (steps: 6, 8)")
    assert rewind_hint(snapshots, tmp_path / "none") == ""


def test_a_rewind_keeps_the_batches_skipped_before_its_step_and_drops_those_at_it(tmp_path):
    """A skipped batch makes no version, so the batch after it has the same ``step``. Going
    back to step 4 keeps every batch in version 4's weights (trained or skipped, steps
    0-3) and drops a batch skipped at step 4: it is not in those weights, and the buffer
    at step 4 serves its groups again (``test_journal``), so the trainer logs them again."""
    run_dir = tmp_path / "run"
    fake_run(run_dir, trainer=[4, 6], snapshots=[4, 6], steps=6)
    rows = [(0, 0, True), (1, 1, True), (2, 2, False), (3, 2, True), (4, 3, True)]
    rows += [(5, 4, False), (6, 4, True), (7, 5, True)]
    (run_dir / "trained.jsonl").write_text(
        "".join(json.dumps({"batch": b, "step": s, "trained": t}) + "\n" for b, s, t in rows)
    )
    with claim_run_dir(run_dir, rewind_to=4):
        pass
    kept = [json.loads(x) for x in (run_dir / "trained.jsonl").read_text().splitlines()]
    assert [(r["batch"], r["step"], r["trained"]) for r in kept] == rows[:5]
