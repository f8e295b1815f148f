"""Faults outside the actors: the controller SIGKILLed and the job resumed, the run's
checkpoints deleted under a running job. Real processes, real kills, then the audit of
``trained.jsonl``: no group trained twice, and a job that cannot go on exactly says so and
ends non-zero instead of starting over."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from asyncrl.buffer.journal import MAGIC, Taken, read_journal
from asyncrl.checkpoints import checkpoint_dirs
from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.job import run_job
from asyncrl.runtime.chaos import audit_run
from asyncrl.runtime.run_dir import RunDirInUse, claim_run_dir
from tests.polling import alive
from tests.test_train import (
    LONG_RUN,
    eval_flags,
    job_flags,
    kill_mid_run,
    lines,
    write_prompts,
)
from tests.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

AUDITED = ["--train.audit-log", "true", "--save-interval", "2"]
#: A failed job's other actors need not wait the default 10 s each to stop.
QUICK_STOP = ["--runtime.stop-timeout", "3"]


def actor_pids(run_dir: Path) -> list[int]:
    pids = []
    for log in (run_dir / "logs").glob("*.jsonl"):
        first = lines(log)[:1]
        if first and log.stem != "controller":
            pids.append(int(json.loads(first[0])["pid"]))
    return pids


def pid_of(run_dir: Path, actor: str) -> int:
    return int(json.loads(lines(run_dir / "logs" / f"{actor}.jsonl")[0])["pid"])


def claimable(run_dir: Path) -> bool:
    try:
        with claim_run_dir(run_dir, resume=True):
            return True
    except RunDirInUse:
        return False


def lock_holders(run_dir: Path) -> str:
    """The processes with the run's lock file open, for a timeout's message."""
    lock, holders = (run_dir / ".lock").resolve(), []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if Path(os.readlink(fd)) == lock:
                pid = fd.parent.parent.name
                holders.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_text()!r}")
        except OSError:
            continue
    return ", ".join(holders) or "none"


def wait_for(predicate, timeout: float, what: str | Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, (
            f"timed out waiting for {what() if callable(what) else what}"
        )
        time.sleep(0.1)


def train_in_a_process(
    tmp_path: Path, steps: int, extra: Sequence[str] = (), **popen: Any
) -> subprocess.Popen:
    """``asyncrl train`` of a tiny audited job in a process of its own (its controller)."""
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=32)
    flags = [*job_flags(tmp_path, steps=steps), *LONG_RUN, *AUDITED, *QUICK_STOP, *extra]
    code = "import sys; from asyncrl.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, "train", *flags], **popen)


def test_a_job_resumed_after_its_controller_was_sigkilled_trains_no_group_twice(tmp_path):
    run_dir = tmp_path / "run"
    first = train_in_a_process(tmp_path, steps=40)
    try:
        wait_for(lambda: len(lines(run_dir / "metrics.jsonl")) >= 3, 180, "three steps")
        buffer = pid_of(run_dir, "buffer")
        os.kill(buffer, signal.SIGSTOP)  # an orphan that is slow to stop
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    reached = len(lines(run_dir / "metrics.jsonl"))
    assert reached < 8, "the first run got too far for the test to mean anything"
    # The orphaned actors still hold the run: a resume now is refused, not mixed in.
    with pytest.raises(RunDirInUse, match="or its actors, which may still be stopping"):
        with claim_run_dir(run_dir, resume=True):
            pass
    os.kill(buffer, signal.SIGCONT)
    # They notice their controller is gone and exit; the user waits for that, and for the
    # run to be free: an actor whose log was still empty is not in actor_pids.
    wait_for(lambda: not any(alive(p) for p in actor_pids(run_dir)), 120, "orphans to exit")
    wait_for(lambda: claimable(run_dir), 60, lambda: f"the run's lock: {lock_holders(run_dir)}")
    # The user resumes with another step count than the first run asked for.
    resumed = [*job_flags(tmp_path, steps=8), *LONG_RUN, *AUDITED, *QUICK_STOP]
    assert main(["train", *resumed, "--resume"]) == 0
    audit = audit_run(run_dir, 8)
    assert audit.ok, audit.problems
    assert audit.duplicated == 0 and audit.lost == 0 and audit.final_version == 8
    buffer_log = [json.loads(x) for x in lines(run_dir / "logs" / "buffer.jsonl")]
    restored = [r for r in buffer_log if r["event"] == "buffer restored"]
    assert restored and restored[-1]["resumed_from"], restored  # the old job's state, not fresh


@pytest.mark.parametrize(
    ("victim", "says"),
    [("buffer", "the buffer's state is gone"), ("trainer", "the trainer's checkpoints in")],
)
async def test_deleted_checkpoints_and_a_crash_end_the_job_instead_of_starting_over(
    tmp_path, victim, says
):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=32)
    run_dir = tmp_path / "run"
    flags = [*job_flags(tmp_path, steps=60), *LONG_RUN, "--train.audit-log", "true", *QUICK_STOP]
    flags += ["--save-interval", "1"]  # the trainer has a checkpoint from its first step on
    # No timed buffer checkpoint that could write the state back before the kill.
    flags += ["--runtime.buffer-checkpoint-interval", "3600"]
    job = asyncio.create_task(run_job(load_config(overrides=flags)))
    async with asyncio.timeout(120):
        while len(lines(run_dir / "metrics.jsonl")) < 2:
            assert not job.done(), job.result()
            await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)  # a heartbeat tells the supervisor how far the victim got
    pid = pid_of(run_dir, victim)
    os.kill(pid, signal.SIGSTOP)  # it writes no checkpoint back before the kill
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # others may write there
    os.kill(pid, signal.SIGKILL)
    result = await job
    assert not result.ok
    assert says in result.error, result.error
    assert "not restarted" in result.error  # a restart would find the same directory
    audit = audit_run(run_dir, 0)
    assert audit.duplicated == 0, audit


@pytest.mark.parametrize("victim", ["trainer", "buffer", "rollout-0"])
async def test_a_sigterm_the_controller_did_not_send_fails_a_job_with_no_restarts(tmp_path, victim):
    """Without restarts, a SIGTERM to one actor ends the job non-zero, naming the actor
    and the signal: not a finish ("train ok" short of the steps), not a silent hang."""
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=32)
    flags = [*job_flags(tmp_path, steps=60), *LONG_RUN, *QUICK_STOP]
    flags += ["--runtime.max-restarts", "0"]
    async with asyncio.timeout(120):
        _, result = await kill_mid_run(tmp_path / "run", victim, flags, signal.SIGTERM)
    assert not result.ok and result.steps < 60
    assert f"actor {victim} exited with code 1" in result.error, result.error
    assert "stopped by SIGTERM, which the controller did not send" in result.error


#: A file size limit and what the job says: 16 bytes stop the run's lock file; at 200 kB
#: the logs fit but not the tiny model's 431 kB weights, which the trainer writes.
DISK_LIMITS = [(16, "asyncrl: the disk refused a write: [Errno 27] File too large"),
               (200_000, "train failed: ")]  # fmt: skip


@pytest.mark.parametrize(("limit", "said"), DISK_LIMITS)
def test_a_disk_that_refuses_writes_ends_the_job_once_with_the_reason(tmp_path, limit, said):
    """``ulimit -f`` makes every write past ``limit`` bytes fail (EFBIG), as a full disk
    does: the job ends non-zero with the reason, no traceback, no restart."""
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=16)
    flags = [*job_flags(tmp_path, steps=4), *QUICK_STOP]
    done = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "train", *flags],
        capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert said in out and "File too large" in out, out
    assert "restarted after a crash" not in out, out
    assert "Traceback" not in done.stderr, out  # the controller's; stdout has the actor's


def crash(tmp_path: Path, steps: int, extra: Sequence[str] = ()) -> Path:
    """A job killed at once, controller and actors together (a power loss), once it has
    trained ``steps`` steps; its run directory, free to resume."""
    run_dir = tmp_path / "run"
    # No timed buffer checkpoint after the first: the journal holds the run.
    job = train_in_a_process(tmp_path, 40, ["--runtime.buffer-checkpoint-interval", "3600",
                                            *extra])  # fmt: skip
    try:
        wait_for(lambda: len(lines(run_dir / "metrics.jsonl")) >= steps, 180, f"{steps} steps")
        for pid in actor_pids(run_dir):
            os.kill(pid, signal.SIGKILL)
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    wait_for(lambda: claimable(run_dir), 60, lambda: f"the run's lock: {lock_holders(run_dir)}")
    return run_dir


def cut_at_the_second_batch(journal: Path) -> None:
    """Cut ``journal`` inside the record of its second batch: a torn write reads as the
    end, which is what a power loss leaves of a journal written without fsync."""
    data, (_, records) = journal.read_bytes(), read_journal(journal)
    frame = struct.Struct("<II")  # length, crc32; then the body

    def after(offset: int) -> int:
        return offset + frame.size + frame.unpack_from(data, offset)[0]

    offset, taken = after(len(MAGIC)), 0  # past the header
    for _, record in records:
        taken += isinstance(record, Taken)
        if taken == 2:
            break
        offset = after(offset)
    journal.write_bytes(data[: offset + 5])


@pytest.mark.parametrize("damage", ["journal deleted", "journal cut short", "batch unknown"])
def test_a_resume_over_a_damaged_buffer_journal_is_refused_and_trains_nothing_twice(
    tmp_path, capsys, damage
):
    run_dir = crash(tmp_path, 5)
    journal = run_dir / "checkpoints" / "buffer.journal"
    if damage == "journal deleted":
        journal.unlink()
    elif damage == "journal cut short":
        cut_at_the_second_batch(journal)
    else:  # its version fits, but it holds a batch the buffer never made (skips after it)
        newest = list(checkpoint_dirs(run_dir / "checkpoints" / "trainer").values())[-1]
        assert (newest / "last_batch").read_text().strip().isdigit()
        (newest / "last_batch").write_text("1000\n")
    trained = len(lines(run_dir / "trained.jsonl"))
    flags = [*job_flags(tmp_path, steps=12), *LONG_RUN, *AUDITED, *QUICK_STOP, "--resume"]
    assert main(["train", *flags]) != 0
    err = capsys.readouterr().err
    assert "the buffer's journal or checkpoint lost records" in err, err
    assert "buffer.journal" in err and "--overwrite" in err
    assert ("holds batch 1000" in err) == (damage == "batch unknown"), err
    assert len(lines(run_dir / "trained.jsonl")) == trained  # nothing trained over it
    # The refusal names the steps kept whole (a trainer checkpoint every 2 steps, and the
    # buffer's snapshot of each): going back to the newest trains to the end, exactly.
    hint = re.search(r"--resume-from-step (\d+) \(steps: ([\d, ]+)\)", err)
    assert hint is not None, err
    step = int(hint[1])
    assert step >= 4 and step % 2 == 0 and hint[2].endswith(str(step)), hint[0]
    if damage != "journal cut short":
        return  # the same way back as the other case: once is enough
    flags[-1] = "--resume-from-step"
    assert main(["train", *flags, str(step)]) == 0
    audit = audit_run(run_dir, 12)
    assert audit.ok, audit.problems
    assert audit.duplicated == 0 and audit.lost == 0 and audit.final_version == 12
    steps = [json.loads(x)["step"] for x in lines(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, 13)), steps  # the steps after the checkpoint, once
    (aside,) = (run_dir / "checkpoints").glob(f"rewound-*-from-{step}")
    assert (aside / "buffer.journal").is_file() and (aside / "trained.jsonl").is_file()


def test_a_resume_with_no_trainer_checkpoint_behind_the_buffer_is_refused(tmp_path, capsys):
    """--save-interval 0 keeps no checkpoint: after a crash the trainer could only start
    from the initial weights while the buffer has consumed the groups of its steps."""
    run_dir = crash(tmp_path, 3, ["--save-interval", "0"])
    flags = [*job_flags(tmp_path, steps=12), *LONG_RUN, *AUDITED, *QUICK_STOP, "--resume"]
    flags += ["--save-interval", "0"]
    assert main(["train", *flags]) != 0
    err = capsys.readouterr().err
    assert "the trainer resumed at version 0, but it had reached version" in err, err
    audit = audit_run(run_dir, 0)
    assert audit.duplicated == 0, audit


async def test_trainer_checkpoints_deleted_under_a_running_job_end_it_at_the_restart(tmp_path):
    """The step folders go, their folder stays: the restarted trainer finds no checkpoint
    of this job and must not start again from the initial weights."""
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=32)
    run_dir = tmp_path / "run"
    flags = [*job_flags(tmp_path, steps=60), *LONG_RUN, *AUDITED, *QUICK_STOP]
    job = asyncio.create_task(run_job(load_config(overrides=flags)))
    async with asyncio.timeout(120):
        while len(lines(run_dir / "metrics.jsonl")) < 3:
            assert not job.done(), job.result()
            await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)  # a heartbeat tells the supervisor a checkpoint was written
    pid = pid_of(run_dir, "trainer")
    os.kill(pid, signal.SIGSTOP)
    for step in (run_dir / "checkpoints" / "trainer").glob("step_*"):
        shutil.rmtree(step)
    os.kill(pid, signal.SIGKILL)
    result = await job
    assert not result.ok
    assert "trainer" in result.error and "not restarted" in result.error, result.error
    assert "checkpoints" in result.error
    assert audit_run(run_dir, 0).duplicated == 0


def test_a_controller_paused_past_the_heartbeat_timeout_kills_no_actor(tmp_path):
    """Ctrl-Z, then fg: the heartbeats that waited unread are not the actors' silence."""
    run_dir = tmp_path / "run"
    job = train_in_a_process(tmp_path, 8, ["--runtime.heartbeat-timeout", "3"])
    try:
        wait_for(lambda: len(lines(run_dir / "metrics.jsonl")) >= 2, 180, "two steps")
        job.send_signal(signal.SIGSTOP)
        time.sleep(8)  # well past the timeout, by the controller's own clock
        job.send_signal(signal.SIGCONT)
        assert job.wait(timeout=180) == 0
    finally:
        job.kill()
    log = [json.loads(x) for x in lines(run_dir / "logs" / "controller.jsonl")]
    events = [r["event"] for r in log]
    assert "the controller was paused; actor silence is measured afresh" in events
    assert not any("restart" in e or "lost" in e for e in events), events
    assert audit_run(run_dir, 8).ok


def test_ctrl_c_stops_the_job_in_order_and_says_how_to_go_on(tmp_path):
    run_dir = tmp_path / "run"
    # With an eval actor whose next version is not due: the trainer must not wait for it
    # to pull the version it stops at (that wait is for the final version only), or it
    # outlives the stop timeout and is killed instead of exiting cleanly.
    job = train_in_a_process(
        tmp_path, steps=200, extra=eval_flags(tmp_path, 100),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: len(lines(run_dir / "metrics.jsonl")) >= 2, 180, "two steps")
        job.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends the controller
        out, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 130, out
    assert "train stopped by SIGINT" in out and "--resume" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    trainer = [json.loads(x) for x in lines(run_dir / "logs" / "trainer.jsonl")]
    assert trainer[-1]["event"] == "actor exiting" and trainer[-1]["ok"], trainer[-1]
    steps = len(lines(run_dir / "metrics.jsonl"))
    # The trainer drained: its last step is checkpointed, so --resume loses nothing.
    assert (run_dir / "checkpoints" / "trainer" / f"step_{steps:06d}").is_dir()


def test_sigterm_to_every_process_of_a_job_stops_it_in_order_with_no_restart(tmp_path):
    """systemd (KillMode=control-group) and SLURM signal the whole job, the actors with
    the controller: each actor's stop is then the job's, not a fault to restart."""
    run_dir = tmp_path / "run"
    job = train_in_a_process(tmp_path, steps=200, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        wait_for(lambda: len(lines(run_dir / "metrics.jsonl")) >= 2, 180, "two steps")
        for pid in [job.pid, *actor_pids(run_dir)]:
            os.kill(pid, signal.SIGTERM)
        out, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 130, out
    assert "train stopped by SIGTERM" in out and "--resume" in out, out
    assert "restarted after a crash" not in out and "Traceback" not in out, out
    log = [json.loads(x) for x in lines(run_dir / "logs" / "controller.jsonl")]
    assert not any(r["event"] == "actor died; restarting" for r in log), log
    audit = audit_run(run_dir, len(lines(run_dir / "metrics.jsonl")))
    assert audit.duplicated == 0 and audit.lost == 0, audit


def test_a_second_sigterm_aborts_at_once_and_leaves_no_actor_behind(tmp_path):
    """A process manager that escalates (SIGTERM, then SIGTERM again) must not orphan the
    job's actors: the second signal kills them, and the run directory is free after."""
    run_dir = tmp_path / "run"
    job = train_in_a_process(
        tmp_path, steps=200, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        log = run_dir / "logs" / "controller.jsonl"
        wait_for(lambda: log.exists() and "actors up" in log.read_text(), 180, "the actors")
        pids = actor_pids(run_dir)
        job.send_signal(signal.SIGTERM)
        wait_for(lambda: "stopping the job in order" in log.read_text(), 30, "the orderly stop")
        job.send_signal(signal.SIGTERM)
        out, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 130 and "train aborted" in out, out
    assert not [pid for pid in pids if alive(pid)]
    with claim_run_dir(run_dir, overwrite=True):  # RunDirInUse while an actor holds it
        pass


async def test_an_actor_paused_at_the_stop_is_named_with_how_it_ended(tmp_path):
    """SIGSTOP leaves a process that ignores the stop command and SIGTERM alike: the
    supervisor's SIGKILL ends it, and the job says who and how, not just {'buffer': -9}."""
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=32)
    run_dir = tmp_path / "run"
    flags = [*job_flags(tmp_path, steps=2), *LONG_RUN, "--runtime.stop-timeout", "2"]
    flags += ["--runtime.heartbeat-timeout", "120"]  # not found hung (and restarted) first
    job = asyncio.create_task(run_job(load_config(overrides=flags)))
    async with asyncio.timeout(120):
        while len(lines(run_dir / "metrics.jsonl")) < 2:  # trained: the job stops next
            assert not job.done(), job.result()
            await asyncio.sleep(0.05)
    os.kill(pid_of(run_dir, "buffer"), signal.SIGSTOP)  # the buffer is stopped last
    result = await job
    assert not result.ok and result.steps == 2
    assert "did not stop cleanly: " in result.error, result.error
    assert "buffer killed by SIGKILL (hung, or paused by SIGSTOP)" in result.error, result.error
