"""bench/overlap.py's arithmetic: medians over repeats, speed-ups and the overlap bound."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "overlap.py"
_spec = importlib.util.spec_from_file_location("bench_overlap", _PATH)
assert _spec is not None and _spec.loader is not None
overlap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(overlap)


def run(samples_per_s: float, wait_s: float = 0.5, step_s: float = 1.0) -> dict[str, float]:
    return {"samples/s": samples_per_s, "wait_s": wait_s, "step_s": step_s}


def test_medians_take_each_figure_over_the_repeats_and_keep_the_spread():
    out = overlap.medians([run(90.0, wait_s=0.4), run(120.0, wait_s=0.9), run(100.0)])
    assert out["samples/s"] == 100.0
    assert out["wait_s"] == 0.5
    assert (out["samples/s min"], out["samples/s max"], out["repeats"]) == (90.0, 120.0, 3)


def test_speedups_are_against_sync_and_the_bound_comes_from_syncs_phases():
    results = {"sync": run(100.0, wait_s=0.5, step_s=1.0), "async-2": run(140.0)}
    bound = overlap.add_bounds(results)
    assert bound["ideal_bound"] == pytest.approx(1.5)  # (0.5 + 1.0) / 1.0
    assert results["async-2"]["speedup"] == pytest.approx(1.4)
    assert results["async-2"]["efficiency"] == pytest.approx(1.4 / 1.5)
    assert results["sync"]["speedup"] == 1.0
