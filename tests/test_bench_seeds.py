"""bench/seeds.py: a config trained on several seeds, each really, and the figures across
them; an interrupted sweep goes on without training a finished seed again."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import ConfigError  # noqa: E402
from bench import seeds  # noqa: E402

EVAL = [{"name": "test", "path": "examples/arith/data/test.jsonl@[0:8]", "n_samples": 2,
         "pass_k": [1], "sampling": {"temperature": 1.0, "max_new_tokens": 24}}]  # fmt: skip
SHORT = ["--train.num-steps", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
         "--buffer.filters", "[]", "--save-interval", "0", "--eval-interval", "2",
         "--eval.sets", json.dumps(EVAL)]  # fmt: skip


def sweep(root: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "bench" / "seeds.py"), "examples/arith/config.yaml",
               "--root", str(root), *flags]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_mean_and_standard_error_and_the_seeds_that_met_the_target() -> None:
    finals = ((0, 0.4), (1, 0.2), (2, 0.35))
    runs = [{"seed": s, "curve": {0: 0.1, 4: a}, "gain": a - 0.1, "wall_s": 10.0 + s,
             "samples/s": None if s == 2 else 3.0,
             "time_to_threshold_s": None if s == 1 else 40.0 + s} for s, a in finals]  # fmt: skip
    out = seeds.summarize(runs, target_gain=0.2)
    last = out["versions"][4]
    assert last["mean"] == pytest.approx(statistics.fmean([0.4, 0.2, 0.35]))
    assert last["se"] == pytest.approx(statistics.stdev([0.4, 0.2, 0.35]) / 3**0.5)
    assert (last["min"], last["max"], last["n"]) == (0.2, 0.4, 3)
    assert out["target"] == {"gain": 0.2, "met": 2, "of": 3, "seeds": [0, 2]}
    assert out["samples/s"]["n"] == 2  # a seed without a steady state is left out
    reached = out["time_to_threshold_s"]  # seed 1 never got there: said beside the mean
    assert (reached["mean"], reached["n"], reached["of"]) == (41.0, 2, 3)
    assert seeds.mean_se([0.5])["se"] is None  # one seed says nothing of the spread


@pytest.mark.slow
def test_each_seed_trains_its_own_run_and_a_rerun_reuses_them(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    done = sweep(root, "--seeds", "1", "2", "--target-gain", "-1", "--", *SHORT)
    assert done.returncode == 0, done.stdout + done.stderr
    payload = json.loads((root / "seeds.json").read_text())
    assert [s["seed"] for s in payload["seeds"]] == [1, 2] and not payload["failed"]
    for s in payload["seeds"]:
        run = root / f"seed_{s['seed']}"
        assert json.loads((run / "config.json").read_text())["seed"] == s["seed"]
        assert list(s["curve"]) == ["0", "2"] and s["steps"] == 2
        assert not (run / "checkpoints").exists()  # removed once the seed finished
        assert 0 <= s["cpu_steal"] < 1  # the share of the machine its host took, kept
    curves = [s["curve"]["2"] for s in payload["seeds"]]
    assert payload["summary"]["versions"]["2"]["mean"] == pytest.approx(statistics.fmean(curves))
    assert payload["summary"]["target"]["met"] == 2
    assert (root / "seeds.png").stat().st_size > 0
    assert "mean +- s.e." in done.stdout
    # A rerun of the same sweep reads the finished seeds instead of training them again.
    trained = (root / "seed_1" / "metrics.jsonl").stat().st_mtime_ns
    again = sweep(root, "--seeds", "1", "2", "--target-gain", "-1", "--", *SHORT)
    assert again.returncode == 0 and again.stdout.count("reusing") == 2, again.stdout
    assert (root / "seed_1" / "metrics.jsonl").stat().st_mtime_ns == trained


def test_a_seed_that_fails_is_reported_with_its_reason_and_the_sweep_exits_1(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "missing.jsonl"  # loads, then the job's preflight refuses it
    done = sweep(tmp_path / "sweep", "--seeds", "0", "--", "--prompt-data", str(missing))
    assert done.returncode == 1
    failed = done.stdout[done.stdout.index("seed 0 FAILED") :]
    assert "(rc 2)" in failed and str(missing) in failed, failed


@pytest.mark.parametrize(
    ("flags", "said"),
    [(["--train.num-steps", "zero"], "train.num_steps: Input should be a valid integer"),
     (["--rollout.temprature", "1"], "unknown option --rollout.temprature (did you mean"),
     (["--train.num-steps"], "argument --train.num-steps: expected one argument"),
     (["--help"], "--help asks for help, not a run")],
)  # fmt: skip
def test_flags_the_config_refuses_stop_the_sweep_before_anything_runs(
    flags: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "sweep"
    with pytest.raises(SystemExit) as stop:
        seeds.parse_args(["examples/arith/config.yaml", "--root", str(root), "--", *flags])
    assert stop.value.code == 2 and said in capsys.readouterr().err
    assert not root.exists()


def test_a_finished_seed_is_reused_only_for_the_same_command_and_config_file(tmp_path: Path):
    config = tmp_path / "c.yaml"
    config.write_text((ROOT / "examples/arith/config.yaml").read_text())
    # Prompts that are not there: a launch fails at once, so "reused" is told from "ran".
    args = seeds.parse_args([str(config), "--root", str(tmp_path / "sweep"), "--seeds", "0",
                             "--", "--prompt-data", str(tmp_path / "none.jsonl")])  # fmt: skip
    out = args.root / "seed_0"
    out.mkdir(parents=True)
    record = {"seed": 0, "command": seeds.command(args, 0)[1:], "rc": 0, "wall_s": 5.0,
              "config_sha256": seeds.sha256(config), "data_sha256": args.data,
              "commit": "abc"}  # fmt: skip
    (out / "sweep.json").write_text(json.dumps(record))
    assert seeds.train(args, 0) == record  # reused, not run
    legacy = {k: v for k, v in record.items() if k != "data_sha256"}  # kept before data keys
    (out / "sweep.json").write_text(json.dumps(legacy))
    assert seeds.train(args, 0) == legacy
    config.write_text(config.read_text() + "\n# edited\n")
    again = seeds.train(args, 0)  # the file changed: run again (and fail on the prompts)
    assert again["rc"] == 2 and json.loads((out / "sweep.json").read_text())["rc"] == 2
    assert seeds.train(args, 0)["rc"] == 2  # a failed record is never reused


def test_the_sweep_refuses_flags_that_would_override_each_seeds_own(tmp_path: Path):
    done = sweep(tmp_path / "sweep", "--seeds", "0", "--", "--seed", "3")
    assert done.returncode == 2 and "the sweep sets each seed's seed and folder" in done.stderr


def test_a_seeds_throughput_and_time_to_threshold_come_from_its_run_folder(tmp_path: Path):
    out = tmp_path / "seed_0"
    (out / "metrics").mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(
        {"buffer": {"groups_per_step": 4, "num_samples_per_prompt": 2}}))  # fmt: skip
    steps = [{"step": k, "time": 100.0 + 10 * k, "num_tokens": 50.0,
              "batch/dropped_groups": 1.0 if k == 3 else 0.0} for k in (1, 2, 3, 4)]  # fmt: skip
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    evals = [{"version": v, "set": "test", "pass@1": a} for v, a in ((0, 0.1), (2, 0.3), (4, 0.5))]
    (out / "metrics" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    record = {"seed": 0, "start": 95.0, "wall_s": 60.0}
    got = seeds.read_seed(record, out, None, "pass@1", threshold=0.3)
    # Steps 2-4 over 30 s: 8 + 6 + 8 samples (step 3 lost a group), 150 tokens.
    assert got["samples/s"] == pytest.approx(22 / 30) and got["tokens/s"] == pytest.approx(5.0)
    assert got["time_to_threshold_s"] == 25.0  # version 2's step ended 25 s after launch
    assert got["gain"] == pytest.approx(0.4) and got["steps"] == 4
    assert (
        seeds.read_seed(record, out, None, "pass@1", threshold=0.9)["time_to_threshold_s"] is None
    )
    with pytest.raises(SystemExit, match="no 'pass@4'"):
        seeds.read_seed(record, out, None, "pass@4")
    # A version that reached it without its step's row has no known time (not launch's 0).
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps[2:]))
    with pytest.raises(SystemExit, match="version 2 reached the threshold but its step"):
        seeds.read_seed(record, out, None, "pass@1", threshold=0.3)


def test_a_seeds_identity_holds_the_data_files_its_config_names(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text((ROOT / "examples/arith/config.yaml").read_text())
    data = seeds.data_files(config, ["--eval.sets", json.dumps(EVAL)])
    test = "examples/arith/data/test.jsonl@[0:8]"  # an eval set's slice: its whole file
    assert data[test] == seeds.sha256(ROOT / "examples/arith/data/test.jsonl")
    assert any(name.endswith("train.jsonl") for name in data), data
    with pytest.raises(ConfigError, match=r"missing\.yaml"):
        seeds.data_files(tmp_path / "missing.yaml", [])


def test_a_root_holding_other_settings_is_refused_before_anything_runs(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    args = seeds.parse_args(["examples/arith/config.yaml", "--root", str(root), "--seeds", "0"])
    kept = {"seed": 0, "rc": 0, "wall_s": 5.0, **seeds.ident(args, 0)}
    kept["command"] = [*kept["command"], "--trainer.lr", "1e-3"]  # the sweep run before
    (root / "seed_0").mkdir(parents=True)
    (root / "seed_0" / "sweep.json").write_text(json.dumps(kept))
    none = str(tmp_path / "none.jsonl")  # prompts that are not there: the job fails at once
    done = sweep(root, "--seeds", "0", "--", "--prompt-data", none)
    assert done.returncode == 1 and "seed_0: other command" in done.stderr, done.stderr
    assert "--fresh" in done.stderr and json.loads((root / "seed_0/sweep.json").read_text()) == kept
    # --fresh replaces it (here with a run that fails on its flag at once).
    fresh = sweep(root, "--seeds", "0", "--fresh", "--", "--prompt-data", none)
    assert fresh.returncode == 1 and "seed 0 FAILED" in fresh.stdout
    assert json.loads((root / "seed_0/sweep.json").read_text())["rc"] == 2


def test_a_second_sweep_on_the_same_root_is_refused(tmp_path: Path) -> None:
    import fcntl

    root = tmp_path / "sweep"
    root.mkdir()
    with (root / ".lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        done = sweep(root, "--seeds", "0")
    assert done.returncode == 1 and "another sweep is using it" in done.stderr


def test_an_eval_set_not_in_the_run_is_refused_by_name(tmp_path: Path) -> None:
    out = tmp_path / "seed_0"
    (out / "metrics").mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(
        {"buffer": {"groups_per_step": 4, "num_samples_per_prompt": 2}}))  # fmt: skip
    (out / "metrics" / "eval.jsonl").write_text(
        json.dumps({"version": 0, "set": "test", "pass@1": 0.1}) + "\n"
    )
    with pytest.raises(SystemExit, match="no eval set 'tset'"):
        seeds.read_seed({"seed": 0, "start": 0.0, "wall_s": 1.0}, out, "tset", "pass@1")


STOPS_IN_ORDER = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGINT, lambda *a: (time.sleep(1), open(sys.argv[1], 'w').close(),"
    " sys.exit(0)))\n"
    "print('up', flush=True)\n"
    "time.sleep(60)\n"
)


def test_ctrl_c_lets_a_seeds_job_stop_in_order(tmp_path: Path) -> None:
    import os
    import signal

    stopped = tmp_path / "stopped"
    sweep = ("import sys; sys.path.insert(0, sys.argv[1]); from bench.seeds import run_to_end\n"
             f"run_to_end([sys.executable, '-c', {STOPS_IN_ORDER!r}, sys.argv[2]])\n")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", sweep, str(ROOT), str(stopped)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole group
        proc.wait(timeout=30)
    finally:
        proc.kill()
    # subprocess.run would have SIGKILLed the job 0.25 s in, before its 1 s stop ended.
    assert stopped.exists() and proc.returncode != 0
