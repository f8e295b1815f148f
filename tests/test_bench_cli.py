"""``asyncrl bench`` and ``asyncrl plot RESULTS.json`` (issue 11), and the cluster
simulator's arithmetic: the GPU budget of each mode, its time scale, the comparisons."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "bench_cluster_sim", ROOT / "bench" / "cluster_sim.py"
)
assert _spec is not None and _spec.loader is not None
cluster_sim = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cluster_sim  # its dataclasses look their module up
_spec.loader.exec_module(cluster_sim)


def test_bench_lists_the_scripts_and_refuses_an_unknown_one(capsys: pytest.CaptureFixture[str]):
    assert main(["bench", "--help"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("vs-trl", "overlap", "cluster-sim"))
    assert main(["bench", "nonsense"]) == 2
    assert "no benchmark 'nonsense'" in capsys.readouterr().err


def test_each_mode_splits_the_same_gpu_budget():
    args = cluster_sim.parse_args(
        ["--gpus", "128", "--engine-gpus", "2", "--rollout-share", "0.25"]
    )
    assert cluster_sim.engines_of("sync-colocated", args) == (64, 128)  # everything, in turns
    assert cluster_sim.engines_of("async-4", args) == (16, 96)  # 32 GPUs generate, 96 train


def test_the_time_scale_keeps_the_engines_within_the_wall_rate():
    work = cluster_sim.Workload(100, 1.0, 100, "every response 100 tokens")
    args = cluster_sim.parse_args(["--gpus", "4", "--concurrency", "10", "--groups", "2",
                                   "--group-size", "10", "--decode-base-s", "0.01",
                                   "--decode-s-per-seq", "0", "--wall-rate", "20",
                                   "--time-scale", "1000", "--train-gpu-s-per-token", "0",
                                   "--train-base-s", "4"])  # fmt: skip
    # sync: 20 requests held on 4 engines, 1 s each: 20 a modelled second -> scale 1.
    assert math.isclose(cluster_sim.time_scale("sync-colocated", args, work), 1.0)
    # async-2 on 2 engines: 20 held, 20 a second, but the trainer takes 20 every 4 s.
    assert math.isclose(cluster_sim.time_scale("async-2", args, work), 4.0)


def test_published_figures_sit_beside_the_modes_they_compare_with():
    results = {"sync-colocated": {"samples/s": 2.0, "rollout samples/s": 3.0},
               "april": {"samples/s": 5.0, "rollout samples/s": 9.0},
               "april-colocated": {"samples/s": 2.4, "rollout samples/s": 4.0}}  # fmt: skip
    rows = {r["system"]: r for r in cluster_sim.comparisons(results)}
    assert set(rows) == {"verl fully_async", "APRIL"}  # AReaL's async-8 did not run
    assert rows["verl fully_async"]["ours"] == pytest.approx(2.5)
    assert rows["APRIL"]["ours"] == pytest.approx(4.0 / 3.0)  # rollout throughput


def test_the_load_tests_peak_sums_actors_per_second_not_rows(tmp_path: Path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    rows = {  # groups in flight; actor 0 reports twice within second 10
        "rollout-0": [(9.6, 3.0), (10.2, 5.0), (10.4, 4.0), (11.0, 1.0)],
        "rollout-1": [(10.0, 2.0), (11.1, 6.0)],
    }
    for name, points in rows.items():
        lines = [json.dumps({"time": t, "rollout/in_flight": n}) for t, n in points]
        (metrics / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    # second 10: max(3, 5, 4) + 2 = 7 groups; second 11: 1 + 6 = 7; 7 x 16 samples
    assert cluster_sim.peak_in_flight(tmp_path, 16) == 7 * 16


def test_the_load_tests_rate_skips_the_steps_that_drain_the_start():
    # 3 fill steps come fast (their samples were in flight at the start); then 1 a second.
    steps = [{"time": t} for t in (0.0, 0.1, 0.2, 1.2, 2.2, 3.2)]
    assert cluster_sim.sustained(steps, 3, per_step=100) == pytest.approx(100.0)
    with pytest.raises(RuntimeError, match="no window"):
        cluster_sim.sustained(steps, 5, per_step=100)


def test_a_small_cluster_simulation_runs_from_the_cli_and_plots(tmp_path: Path):
    out = tmp_path / "cluster_sim.json"
    flags = ["--workload", "short", "--gpus", "4", "--concurrency", "16", "--actors", "1",
             "--groups", "4", "--group-size", "4", "--steps", "3", "--time-scale", "20",
             "--switch-s", "3", "--weight-update-s", "0.5", "--train-base-s", "1",
             "--modes", "sync-colocated", "async-2", "--out", str(out)]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "bench", "cluster-sim", *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads(out.read_text())
    modes = payload["modes"]
    assert set(modes) == {"sync-colocated", "async-2"}
    assert modes["sync-colocated"]["staleness_max"] == 0 and modes["async-2"]["samples/s"] > 0
    assert modes["sync-colocated"]["vs sync-colocated"] == 1.0
    png = tmp_path / "again.png"
    assert main(["plot", str(out), "--out", str(png)]) == 0 and png.stat().st_size > 0
    (tmp_path / "overlap.json").write_text("{}")
    assert main(["plot", str(tmp_path / "overlap.json")]) == 2  # not overlap.py's results


def test_training_speed_grows_with_gpus_as_the_scaling_exponent_says():
    linear = cluster_sim.parse_args(["--gpus", "128", "--train-gpu-s-per-token", "0.128"])
    assert math.isclose(cluster_sim.per_token(linear, 128), 0.001)
    assert math.isclose(cluster_sim.per_token(linear, 64), 0.002)
    flat = cluster_sim.parse_args(["--gpus", "128", "--train-gpu-s-per-token", "0.128",
                                   "--train-scaling", "0"])  # fmt: skip
    assert math.isclose(cluster_sim.per_token(flat, 64), 0.001)  # half the GPUs, same speed
