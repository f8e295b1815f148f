"""``asyncrl plot``: figures of a synthetic run, skipped inputs, bad lines, derived numbers."""

from __future__ import annotations

import io
import json
import logging
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncrl.cli import main
from asyncrl.observe import configure_logging, reset_logging
from asyncrl.observe.plots import (
    RunData,
    busy_fraction,
    busy_fractions,
    eval_curves,
    histogram_mean,
    last_histogram,
    load_run,
    monotone,
    moving_average,
    plot_run,
    read_rows,
    reward_window,
    rollout_intervals,
    run_span,
    sample_rates,
    token_rates,
    trainer_intervals,
    windowed_rate,
)

T0 = 1_795_425_600.0
STEPS = 40  # trainer rows, 1.3 s apart: 0.2 s waiting, 1.0 s training, 0.1 s publishing
ROLLOUT_ROWS = 26  # per actor, 2 s apart, each busy for the first 1 s of its period
ALL_FIGURES = ["reward", "training", "eval", "throughput", "staleness", "timeline"]


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Undo the logging set-up of ``asyncrl plot`` and of the tests."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    reset_logging()
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def trainer_row(step: int) -> dict[str, Any]:
    return {
        "actor": "trainer",
        "step": step,
        "reward/mean": 0.1 + 0.01 * step,
        "staleness/mean": 1.0 + (step % 3) / 2,
        "num_tokens": 800.0,
        "tokens": 1300.0,
        "time/step": 1.0,
        "time/wait_data": 0.2,
        "time/publish": 0.1,
        "time": T0 + 1.3 * step,
        "mismatch_kl": 0.001 * step,
        "entropy": 1.0 - 0.01 * step,
        "response_len/mean": 40.0 - step,
        "grad_norm": 0.5,
    }


def make_run(root: Path, *, evals: bool = True, buffer: bool = True, rollouts: int = 2) -> Path:
    """A run directory with every file the job writes (the optional ones on request)."""
    run = root / "run"
    write_jsonl(run / "metrics.jsonl", [trainer_row(step) for step in range(1, STEPS + 1)])
    if evals:
        write_jsonl(
            run / "metrics" / "eval.jsonl",
            [
                row
                for v in range(0, STEPS + 1, 10)
                for row in (
                    {
                        "version": v,
                        "set": "test",
                        "pass@1": v / 100,
                        "pass@4": v / 50,
                        "pass@1/short": 0.5,
                        "time": T0 + 1.3 * v,
                    },
                    {"version": v, "set": "greedy", "pass@1": v / 80, "time": T0 + 1.3 * v},
                )
            ],
        )
    if buffer:  # every 2 steps: 16 more samples (4 fresh, 12 one version old)
        write_jsonl(
            run / "metrics" / "buffer.jsonl",
            [
                {
                    "actor": "buffer",
                    "buffer.version": 2.0 * k,
                    "time": T0 + 2.6 * k,
                    "buffer.staleness_samples": {"0": 4 * k, "1": 12 * k},
                    "buffer.staleness_tokens": {"0": 40 * k, "1": 200 * k},
                }
                for k in range(1, STEPS // 2 + 1)
            ],
        )
    for i in range(rollouts):
        write_jsonl(
            run / "metrics" / f"rollout-{i}.jsonl",
            [
                {
                    "actor": f"rollout-{i}",
                    "time": T0 + 2 * k,
                    "rollout/samples": 8.0 * k,
                    "rollout/tokens": 500.0 * k,
                    "busy": [[T0 + 2 * k - 2, T0 + 2 * k - 1]],
                    "version": k,
                    "rollout/reward_mean": 0.05 * k,
                }
                for k in range(1, ROLLOUT_ROWS + 1)
            ],
        )
    return run


def assert_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, channels = imread(path).shape
    assert height >= 150 and width >= 500 and channels in (3, 4)


# -- figures and the command ----------------------------------------------------------------
def test_a_full_run_gets_every_figure(tmp_path: Path):
    run = make_run(tmp_path)
    written = plot_run(run, tmp_path / "out")
    assert written == [tmp_path / "out" / f"{name}.png" for name in ALL_FIGURES]
    for path in written:
        assert_png(path)


def test_figures_whose_inputs_are_missing_are_skipped(tmp_path: Path):
    run = make_run(tmp_path, evals=False, buffer=False, rollouts=0)
    written = plot_run(run, tmp_path / "out")
    # no eval.jsonl: no eval.png; no buffer.jsonl: staleness falls back to metrics.jsonl
    assert [p.stem for p in written] == ["reward", "training", "throughput", "staleness",
                                         "timeline"]  # fmt: skip
    assert not (tmp_path / "out" / "eval.png").exists()
    for path in written:
        assert_png(path)


def test_the_training_figure_has_a_panel_per_metric_present_and_the_rewards_before_filters(
    tmp_path: Path,
):
    from asyncrl.observe.plots import _training_figure, load_run

    run = load_run(make_run(tmp_path, rollouts=2))
    fig = _training_figure(run)
    titles = [ax.get_title() for ax in fig.axes]
    # KL, entropy, response length and grad norm are in the rows; truncation and clip are not
    assert titles == ["KL", "entropy", "response length (loss tokens)",
                      "grad norm (before clipping)", "mean reward"]  # fmt: skip
    labels = [line.get_label() for line in fig.axes[-1].get_lines()]
    assert labels == ["trained", "rollout-0, before filters", "rollout-1, before filters"]


def test_a_run_of_rows_without_timings_or_rewards_draws_nothing(tmp_path: Path):
    write_jsonl(tmp_path / "run" / "metrics.jsonl", [{"step": 1}, {"step": 2}])
    assert plot_run(tmp_path / "run", tmp_path / "out") == []


def test_the_command_writes_into_run_dir_plots_and_prints_the_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    run = make_run(tmp_path, rollouts=1)
    assert main(["plot", str(run)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(run / "plots" / f"{name}.png") for name in ALL_FIGURES]
    assert main(["plot", str(run), "--out", str(tmp_path / "elsewhere")]) == 0
    assert capsys.readouterr().out.split()[0] == str(tmp_path / "elsewhere" / "reward.png")
    assert_png(tmp_path / "elsewhere" / "timeline.png")


def test_the_command_refuses_a_directory_without_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    missing = tmp_path / "not-a-run"
    missing.mkdir()
    assert main(["plot", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"asyncrl plot: {missing} is not a run directory" in err
    assert "metrics.jsonl" in err
    assert not (missing / "plots").exists()
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert str(tmp_path / "nowhere") in capsys.readouterr().err


def test_malformed_lines_are_skipped_with_a_warning_naming_file_and_line(tmp_path: Path):
    out = io.StringIO()
    configure_logging(fmt="json", stream=out)
    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\nnot json\n[1, 2]\n\n{"a": 2}\n{"a": 3, "b"')
    assert read_rows(path) == [{"a": 1}, {"a": 2}]
    warnings = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(w["level"], w["path"], w["line"]) for w in warnings] == [
        ("warning", str(path), 2),
        ("warning", str(path), 3),
        ("warning", str(path), 6),
    ]
    assert "malformed" in warnings[0]["event"] and "list" in warnings[1]["reason"]


def test_the_command_plots_a_file_with_a_malformed_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    run = make_run(tmp_path, rollouts=0)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines.insert(3, '{"step": 4, "reward/me\n')
    (run / "metrics.jsonl").write_text("".join(lines))
    assert main(["plot", str(run)]) == 0
    captured = capsys.readouterr()
    assert "skipping malformed line" in captured.err
    assert str(run / "metrics.jsonl") in captured.err and "line=4" in captured.err
    assert len(captured.out.split()) == len(ALL_FIGURES)
    assert len(load_run(run).trainer) == STEPS


def test_the_package_imports_and_computes_without_matplotlib():
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "import asyncrl.cli, asyncrl.observe.plots as p\n"
        "print(p.histogram_mean({1: 1, 3: 1}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2.0"


# -- derived quantities ---------------------------------------------------------------------
def test_trainer_intervals_come_from_the_row_time_and_its_durations():
    rows = [
        {"time": 10.0, "time/step": 2.0, "time/publish": 0.5, "time/wait_data": 1.0},
        {"time": 12.0, "time/step": 1.0},  # no publish or wait recorded: 0
        {"time": 13.0},  # no time/step: left out
        {"time/step": 1.0},
    ]
    busy, waiting = trainer_intervals(rows)
    assert busy == [(7.5, 10.0), (11.0, 12.0)]
    assert waiting == [(6.5, 7.5)]


def test_busy_fraction_counts_overlaps_once_and_clips_to_the_span():
    assert busy_fraction([(0, 2), (1, 3), (5, 6)], (0, 10)) == pytest.approx(0.4)
    assert busy_fraction([(-1, 1), (3, 9)], (0, 4)) == pytest.approx(0.5)
    assert busy_fraction([(2, 3), (0, 5)], (0, 10)) == pytest.approx(0.5)  # nested
    assert busy_fraction([], (0, 10)) == 0.0
    assert busy_fraction([(0, 1)], (3, 3)) == 0.0
    assert run_span([[(2, 3)], [], [(1, 2), (4, 6)]]) == (1, 6)
    assert run_span([[], []]) is None


def test_busy_fractions_of_the_synthetic_run(tmp_path: Path):
    run = load_run(make_run(tmp_path))
    span = 1.3 * STEPS  # from the first wait (T0) to the last trainer row
    fractions = busy_fractions(run)
    assert fractions == pytest.approx(
        {
            "rollout-0": ROLLOUT_ROWS * 1.0 / span,
            "rollout-1": ROLLOUT_ROWS * 1.0 / span,
            "trainer": STEPS * 1.1 / span,
            "trainer/wait": STEPS * 0.2 / span,
        }
    )
    assert busy_fractions(RunData(trainer=[])) == {"trainer": 0.0, "trainer/wait": 0.0}


def test_rollout_intervals_skip_malformed_pairs():
    rows = [
        {"busy": [[1.0, 2.0], [3, 4]]},
        {"busy": []},
        {},
        {"busy": [[5.0], [7.0, 6.0], ["a", 8.0], [None, 1.0], [8.0, 9.5]]},
    ]
    assert rollout_intervals(rows) == [(1.0, 2.0), (3.0, 4.0), (8.0, 9.5)]


def test_moving_average_is_trailing_and_ignores_missing_values():
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([1.0, 2.0, 3.0, 4.0], 1) == [1.0, 2.0, 3.0, 4.0]
    out = moving_average([1.0, math.nan, 3.0, math.nan, math.nan], 2)
    assert out[:4] == [1.0, 1.0, 3.0, 3.0] and math.isnan(out[4])
    assert [reward_window(n) for n in (0, 3, 40, 150)] == [1, 1, 4, 15]


def test_windowed_rate_divides_counter_growth_by_elapsed_time():
    xs, rates = windowed_rate([0.0, 1.0, 3.0, 4.0], [0.0, 10.0, 20.0, 30.0], window=2)
    assert xs == [1.0, 3.0, 4.0]
    assert rates == pytest.approx([10.0, 20 / 3, 20 / 3])
    xs, rates = windowed_rate([0.0, 1.0, 1.0, 3.0], [0.0, 5.0, 6.0, 10.0], window=1)
    assert (xs, rates) == ([1.0, 3.0], [5.0, 2.0])  # no time passed: no point
    assert windowed_rate([5.0], [1.0], 3) == ([], [])
    assert monotone([0, 5, 9, 2, 4, 1]) == [0, 5, 9, 11, 13, 14]


def test_throughput_rates_of_the_synthetic_run(tmp_path: Path):
    run = load_run(make_run(tmp_path, rollouts=1))
    tokens = token_rates(run, T0)
    assert tokens["trained, forwarded"][1] == pytest.approx([1300 / 1.3] * (STEPS - 1))
    assert tokens["trained, loss tokens"][1] == pytest.approx([800 / 1.3] * (STEPS - 1))
    assert tokens["generated (rollout-0)"][1] == pytest.approx([250.0] * (ROLLOUT_ROWS - 1))
    assert tokens["trained, forwarded"][0][0] == pytest.approx(2 * 1.3)  # seconds since T0
    samples = sample_rates(run, T0)
    assert samples["trained (buffer)"][1] == pytest.approx([16 / 2.6] * (STEPS // 2 - 1))
    assert samples["generated (rollout-0)"][1] == pytest.approx([4.0] * (ROLLOUT_ROWS - 1))
    assert sample_rates(RunData(trainer=run.trainer), T0) == {}


def test_the_staleness_histogram_is_the_last_row_that_has_one():
    rows = [
        {"h": {"0": 1}},
        {"h": {"10": 5, "2": 3, "0": 2}},
        {"other": 1},
    ]
    assert list(last_histogram(rows, "h").items()) == [(0, 2.0), (2, 3.0), (10, 5.0)]
    assert last_histogram(rows, "missing") == {}
    assert histogram_mean({0: 64, 1: 64, 2: 120, 3: 8}) == pytest.approx(328 / 256)
    assert math.isnan(histogram_mean({}))


def test_eval_curves_per_set_and_k_sorted_by_version():
    rows = [
        {"version": 20, "set": "test", "pass@1": 0.3, "pass@8": 0.6, "pass@1/short": 0.9},
        {"version": 10, "set": "test", "pass@1": 0.2, "pass@8": 0.5},
        {"version": 10, "set": "greedy", "pass@1": 0.25},
        {"version": 20, "set": "test", "pass@1": 0.35},  # a later row replaces the earlier
        {"set": "test", "pass@1": 1.0},  # no version: left out
    ]
    assert eval_curves(rows) == {
        "test": {1: [(10, 0.2), (20, 0.35)], 8: [(10, 0.5), (20, 0.6)]},
        "greedy": {1: [(10, 0.25)]},
    }
