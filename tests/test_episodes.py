"""Agent episode metrics (``observe/episodes.py``) and their figure in ``asyncrl plot``."""

from __future__ import annotations

import json

import pytest

from asyncrl.observe.episodes import episode_metrics
from asyncrl.observe.plots import plot_run
from asyncrl.types import Sample


def episode(turns: list[int], calls: list[dict], finish: str = "stop") -> Sample:
    """A sample whose assistant turns have ``turns`` tokens, a 3-token tool turn between."""
    s = Sample(uid="u", group_id="g", metadata={"tool_calls": calls}, finish_reason=finish)
    for k, n in enumerate(turns):
        if k:
            s.append_response([7] * 3, [0.0] * 3, 0, loss_mask=0, role="tool")
        s.append_response([5] * n, [-0.1] * n, 0)
    return s


def call(error: str | None = None, seconds: float = 0.5, timed_out: bool = False) -> dict:
    return {"name": "calculator", "error": error, "seconds": seconds, "timed_out": timed_out}


def test_metrics_average_over_episodes_and_calls():
    samples = [
        episode([10, 20, 30], [call(), call("Error: x", 1.5)]),
        episode([40], [], finish="stop"),  # answered at once: still an episode
        episode([6, 4], [call("Error: timed out", 10.0, timed_out=True)], finish="length"),
    ]
    m = episode_metrics(samples)
    assert m["agent/turns"] == pytest.approx(6 / 3)
    assert m["agent/tool_calls"] == pytest.approx(3 / 3)
    assert m["agent/tool_errors"] == pytest.approx(2 / 3)
    assert m["agent/tool_timeouts"] == pytest.approx(1 / 3)
    assert m["agent/tool_latency_s"] == pytest.approx(12.0 / 3)
    assert m["agent/tokens_per_turn"] == pytest.approx(110 / 6)
    assert m["agent/context_ended"] == pytest.approx(1 / 3)


def test_single_turn_batches_have_no_agent_metrics_and_calls_without_timing_no_latency():
    plain = Sample(uid="u", group_id="g")
    plain.append_response([1, 2], [-0.1, -0.2], 0)
    assert episode_metrics([plain]) == {}
    m = episode_metrics([episode([5, 5], [{"name": "search", "error": None}])])
    assert "agent/tool_latency_s" not in m and m["agent/tool_calls"] == 1.0


def test_plot_draws_the_agent_figure_only_for_agent_runs(tmp_path):
    rows = [{"actor": "trainer", "step": k, "reward/mean": 0.1 * k, "agent/turns": 2.0 + k,
             "agent/tool_calls": 1.0, "agent/context_ended": 0.0} for k in range(1, 4)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = {p.name for p in plot_run(tmp_path, tmp_path / "plots")}
    assert "agent.png" in names
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    assert "agent.png" not in {p.name for p in plot_run(plain, plain / "plots")}
