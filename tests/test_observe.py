"""Logs and metrics: context on every line, one pipeline for all records, safe JSONL."""

from __future__ import annotations

import io
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import structlog
import torch

from asyncrl.observe import (
    JsonlMetricsSink,
    MultiSink,
    bind_context,
    bind_task_context,
    configure_logging,
    get_logger,
    read_jsonl,
    unbind_context,
)


@pytest.fixture(autouse=True)
def reset_logging() -> Iterator[None]:
    yield
    configure_logging(level="info", fmt="console")
    unbind_context("actor", "pid", "version", "role")
    structlog.contextvars.clear_contextvars()


def json_lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_json_lines_carry_the_process_context_from_any_task():
    out = io.StringIO()
    configure_logging(fmt="json", stream=out, actor="rollout-1", pid=99)
    bind_context(version=4)
    get_logger("t").info("sampled", n=3)
    line = json_lines(out)[-1]
    assert {k: line[k] for k in ("event", "level", "actor", "pid", "version", "n")} == {
        "event": "sampled",
        "level": "info",
        "actor": "rollout-1",
        "pid": 99,
        "version": 4,
        "n": 3,
    }
    assert line["timestamp"].endswith("Z")
    unbind_context("version")
    get_logger("t").info("again")
    assert "version" not in json_lines(out)[-1]


def test_task_context_stays_with_its_task():
    out = io.StringIO()
    configure_logging(fmt="json", stream=out)
    bind_task_context(uid="s-1")
    get_logger("t").info("in task")
    assert json_lines(out)[-1]["uid"] == "s-1"


def test_console_format_renders_key_values_for_people():
    out = io.StringIO()
    configure_logging(fmt="console", stream=out, actor="buffer")
    get_logger("t").warning("queue full", size=10)
    text = out.getvalue()
    assert "queue full" in text and "size=10" in text and "actor=buffer" in text
    assert "\x1b[" not in text  # no colour codes off a terminal


def test_standard_logging_goes_through_the_same_pipeline_and_level():
    out = io.StringIO()
    configure_logging(level="info", fmt="json", stream=out, actor="trainer")
    logging.getLogger("transformers").info("loaded %d layers", 4)
    logging.getLogger("transformers").debug("noise")
    lines = json_lines(out)
    assert [line["event"] for line in lines] == ["loaded 4 layers"]
    assert lines[0]["actor"] == "trainer"


def test_exceptions_are_rendered_into_json():
    out = io.StringIO()
    configure_logging(fmt="json", stream=out)
    try:
        raise KeyError("missing-shard")
    except KeyError:
        get_logger("t").exception("load failed")
    line = json_lines(out)[-1]
    assert "KeyError: 'missing-shard'" in line["exception"]


def test_a_log_file_always_gets_json_lines_and_reconfiguring_does_not_duplicate(tmp_path: Path):
    out = io.StringIO()
    configure_logging(fmt="console", stream=out, file=tmp_path / "a.jsonl", actor="x")
    configure_logging(fmt="console", stream=out, file=tmp_path / "a.jsonl", actor="x")
    get_logger("t").info("once")
    assert out.getvalue().count("once") == 1
    lines = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [line["event"] for line in lines] == ["once"]


def test_bad_log_level_is_refused():
    with pytest.raises(ValueError, match="log level must be one of"):
        configure_logging(level="loud")


def test_metrics_are_written_as_json_lines_with_plain_numbers(tmp_path: Path):
    path = tmp_path / "m" / "metrics.jsonl"
    with JsonlMetricsSink(path) as sink:
        sink.write(
            {
                "step": np.int64(3),
                "loss": torch.tensor(0.5),
                "lr": np.float32(1e-3),
                "nan": math.nan,
                "inf": np.float64("inf"),
                "tag": "train",
            }
        )
        sink.write({"step": 4, "time": 123.0})
    rows = read_jsonl(path)
    assert rows[0]["step"] == 3 and rows[0]["loss"] == 0.5 and rows[0]["nan"] is None
    assert rows[0]["inf"] is None and isinstance(rows[0]["time"], float)
    assert rows[1] == {"step": 4, "time": 123.0}


def test_an_unserialisable_metric_names_its_key(tmp_path: Path):
    with (
        JsonlMetricsSink(tmp_path / "m.jsonl") as sink,
        pytest.raises(TypeError, match="metric 'model' has a value of type object"),
    ):
        sink.write({"model": object()})


def test_metrics_reach_the_file_when_flush_is_due(tmp_path: Path):
    path = tmp_path / "m.jsonl"
    sink = JsonlMetricsSink(path, flush_every=3600)
    sink.write({"a": 1})
    assert path.read_text() == ""  # buffered
    sink.flush()
    assert read_jsonl(path)[0]["a"] == 1
    eager = JsonlMetricsSink(tmp_path / "e.jsonl", flush_every=0)
    eager.write({"b": 2})
    assert read_jsonl(tmp_path / "e.jsonl")[0]["b"] == 2
    sink.close()
    eager.close()


def test_reading_skips_a_truncated_last_line_but_not_a_corrupt_middle(tmp_path: Path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "b"')
    assert [r["a"] for r in read_jsonl(path)] == [1, 2]
    path.write_text('{"a": 1}\nnot json\n{"a": 3}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2: not a JSON object"):
        read_jsonl(path)


def test_multi_sink_fans_out(tmp_path: Path):
    a, b = JsonlMetricsSink(tmp_path / "a.jsonl"), JsonlMetricsSink(tmp_path / "b.jsonl")
    multi = MultiSink(a, b)
    multi.write({"x": 1})
    multi.close()
    assert read_jsonl(tmp_path / "a.jsonl") == read_jsonl(tmp_path / "b.jsonl")
