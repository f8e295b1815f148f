"""bench/trainer_bound.py: the per-step arithmetic of a job, its trainer alone and its
engine alone, and a bad --trl-result refused before anything runs."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import trainer_bound  # noqa: E402


def steps(times: list[float], tokens: list[float], losses: list[float]) -> list[dict]:
    t, out = 100.0, []
    for i, (s, n, loss) in enumerate(zip(times, tokens, losses, strict=True), 1):
        t += s + 1.0  # one second of saves and bookkeeping beside each step
        out.append({"step": i, "time": t, "time/step": s, "num_tokens": n, "loss": loss})
    return out


def test_own_cores_take_the_slower_of_the_trainer_alone_and_the_engine_alone() -> None:
    tokens, losses = [900.0, 1000.0, 200.0], [0.1, 0.2, 0.3]
    job = steps([12.0, 10.0, 6.0], tokens, losses)
    alone = steps([11.0, 8.0, 2.0], tokens, losses)
    # Rollout-only: 2,000 tokens in 4 s after the first batch, 2 ms a token.
    rollout = [{"time": 0.0, "tokens": 500.0}, {"time": 1.0, "tokens": 500.0},
               {"time": 4.0, "tokens": 1500.0}]  # fmt: skip
    s = trainer_bound.summarize(job, alone, rollout)
    assert s["engine_s_per_token"] == pytest.approx(0.002)
    assert [r["engine_s"] for r in s["steps"]] == pytest.approx([2.0, 0.4])
    assert s["mean"]["own_cores_s"] == pytest.approx((8.0 + 2.0) / 2)  # step 3: the engine's
    assert s["mean"]["job_s"] == pytest.approx(8.0) and s["replay_matches"]
    assert s["wall_per_step"] == pytest.approx({"job": 9.0, "alone": 6.0})
    trl = trainer_bound.against_trl(s, {"step_s": 20.0})
    assert trl["job"] == pytest.approx(9.0 / 20) and trl["trainer_alone"] == pytest.approx(0.3)
    assert trl["own_cores"] == pytest.approx((5.0 + 1.0) / 20)  # the same saves added
    replayed = steps([11.0, 8.0, 2.0], tokens, [0.1, 0.2, 0.31])
    assert not trainer_bound.summarize(job, replayed, rollout)["replay_matches"]
    with pytest.raises(ValueError, match="job 3, alone 2"):
        trainer_bound.summarize(job, alone[:2], rollout)


def bench(*flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "bench" / "trainer_bound.py"), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_a_missing_trl_result_is_refused_before_any_run(tmp_path: Path) -> None:
    done = bench("--work", str(tmp_path), "--trl-result", str(tmp_path / "none.json"))
    assert done.returncode == 2 and "none.json: no such file" in done.stderr
    assert not any(tmp_path.iterdir())


def test_a_second_copy_on_the_same_work_folder_is_refused_and_deletes_nothing(
    tmp_path: Path,
) -> None:
    (tmp_path / "job").mkdir()  # the first copy's run, in progress
    with (tmp_path / ".lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        done = bench("--work", str(tmp_path))
    assert done.returncode == 2 and "another trainer_bound run" in done.stderr
    assert (tmp_path / "job").is_dir()
