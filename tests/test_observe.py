"""Logs and metrics: context on every line, one pipeline for all records, safe JSONL."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
import torch

from asyncrl.observe import (
    JsonlMetricsSink,
    MultiSink,
    adopt_library_loggers,
    bind_context,
    bind_task_context,
    configure_logging,
    get_logger,
    read_jsonl,
    reset_logging,
    unbind_context,
)


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Undo each test's global logging set-up (structlog config, root handlers, context)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    reset_logging()  # includes structlog.reset_defaults()
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)


def json_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def wait_until(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


# -- logs -------------------------------------------------------------------------------


def test_json_lines_carry_level_event_timestamp_and_the_bound_context():
    out = io.StringIO()
    configure_logging(fmt="json", stream=out, actor="rollout-1", pid=99)
    bind_context(version=4)
    get_logger("asyncrl.test").info("sampled", n=3)
    [line] = json_lines(out)
    assert line == {
        "event": "sampled",
        "level": "info",
        "logger": "asyncrl.test",
        "actor": "rollout-1",
        "pid": 99,
        "version": 4,
        "n": 3,
        "timestamp": line["timestamp"],
    }
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z", line["timestamp"])


def test_http_clients_request_lines_stay_out_below_warning_unless_debugging():
    out = io.StringIO()
    configure_logging(fmt="json", stream=out)
    logging.getLogger("httpx2").info("HTTP Request: POST /v1/chat/completions")
    logging.getLogger("httpx2").warning("retrying")
    assert [line["event"] for line in json_lines(out)] == ["retrying"]
    configure_logging(fmt="json", stream=out, level="debug")
    assert logging.getLogger("httpx2").getEffectiveLevel() == logging.DEBUG


def test_unbinding_removes_a_key_from_later_lines():
    out = io.StringIO()
    configure_logging(fmt="json", stream=out, actor="trainer")
    bind_context(version=4)
    unbind_context("version", "never-bound")
    get_logger("t").info("after")
    assert "version" not in json_lines(out)[-1]
    assert json_lines(out)[-1]["actor"] == "trainer"


async def test_a_version_bound_in_one_task_reaches_lines_from_a_sibling_task():
    out = io.StringIO()
    configure_logging(fmt="json", stream=out, actor="rollout-0")
    learned = asyncio.Event()

    async def sampler() -> None:
        await learned.wait()
        get_logger("t").info("sampled")

    async def weight_sync() -> None:
        bind_context(version=5)
        learned.set()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(sampler())
        tg.create_task(weight_sync())
    assert json_lines(out)[-1]["version"] == 5


def test_task_context_overrides_process_context_and_call_site_overrides_both():
    out = io.StringIO()
    configure_logging(fmt="json", stream=out, uid="process")
    bind_task_context(uid="s-1")
    get_logger("t").info("in task")
    get_logger("t").info("explicit", uid="s-2")
    assert [line["uid"] for line in json_lines(out)] == ["s-1", "s-2"]


def test_console_format_renders_timestamp_level_event_and_key_values_without_colour():
    out = io.StringIO()
    configure_logging(fmt="console", stream=out, actor="buffer")
    get_logger("t").warning("queue full", size=10)
    text = out.getvalue()
    assert re.match(r"\d{4}-\d\d-\d\dT\S+Z \[warning\s*\] queue full", text)
    assert "size=10" in text and "actor=buffer" in text
    assert "\x1b[" not in text  # no colour codes off a terminal
    assert text.count("\n") == 1


def test_standard_logging_goes_through_the_same_pipeline_and_level():
    out = io.StringIO()
    configure_logging(level="info", fmt="json", stream=out, actor="trainer")
    logging.getLogger("aiohttp.client").info("loaded %d layers", 4, extra={"shard": 2})
    logging.getLogger("aiohttp.client").debug("noise")
    lines = json_lines(out)
    assert [line["event"] for line in lines] == ["loaded 4 layers"]
    assert lines[0]["actor"] == "trainer" and lines[0]["shard"] == 2
    assert lines[0]["logger"] == "aiohttp.client" and lines[0]["level"] == "info"


def test_the_level_filters_structlog_events_and_debug_opens_them():
    out = io.StringIO()
    configure_logging(level="info", fmt="json", stream=out)
    get_logger("t").debug("hidden")
    configure_logging(level="debug", fmt="json", stream=out)
    get_logger("t").debug("shown")
    logging.getLogger("lib").debug("shown too")
    assert [line["event"] for line in json_lines(out)] == ["shown", "shown too"]


def test_library_loggers_that_stop_propagation_are_adopted():
    theirs = io.StringIO()
    library = logging.getLogger("transformers")  # what importing transformers does
    library.addHandler(logging.StreamHandler(theirs))
    library.propagate = False
    library.setLevel(logging.WARNING)
    out = io.StringIO()
    configure_logging(fmt="json", stream=out, actor="trainer")
    library.info("config dump")  # a library's chatter stays out below warning
    library.warning("loading weights")
    late = logging.getLogger("late_lib")
    late.propagate = False
    adopt_library_loggers("late_lib")
    late.warning("imported after configure")
    assert [line["event"] for line in json_lines(out)] == [
        "loading weights",
        "imported after configure",
    ]
    assert theirs.getvalue() == ""
    configure_logging(level="debug", fmt="json", stream=out)
    library.info("shown when debugging")
    assert json_lines(out)[-1]["event"] == "shown when debugging"


def test_exceptions_are_rendered_into_json_as_a_string():
    out = io.StringIO()
    configure_logging(fmt="json", stream=out)
    try:
        raise KeyError("missing-shard")
    except KeyError:
        get_logger("t").exception("load failed")
        logging.getLogger("lib").error("lib failed", exc_info=True)
    lines = json_lines(out)
    assert [line["level"] for line in lines] == ["error", "error"]
    for line in lines:
        assert line["exception"].startswith("Traceback (most recent call last)")
        assert "KeyError: 'missing-shard'" in line["exception"]


def test_exceptions_are_rendered_as_a_traceback_on_the_console():
    out = io.StringIO()
    configure_logging(fmt="console", stream=out)
    try:
        raise KeyError("missing-shard")
    except KeyError:
        get_logger("t").exception("load failed")
    text = out.getvalue()
    assert "load failed" in text and "Traceback (most recent call last)" in text
    assert "KeyError: 'missing-shard'" in text


def test_a_log_file_always_gets_json_lines_even_with_console_format(tmp_path: Path):
    out = io.StringIO()
    path = tmp_path / "logs" / "actor.jsonl"
    configure_logging(fmt="console", stream=out, file=path, actor="x")
    get_logger("t").info("hello", n=1)
    logging.getLogger("lib").warning("from a library")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["event"], line["actor"]) for line in lines] == [
        ("hello", "x"),
        ("from a library", "x"),
    ]
    assert "n=1" in out.getvalue() and not out.getvalue().startswith("{")


def test_reconfiguring_twice_does_not_duplicate_lines_and_appends_to_the_file(tmp_path: Path):
    out = io.StringIO()
    path = tmp_path / "a.jsonl"
    configure_logging(fmt="console", stream=out, file=path, actor="x")
    get_logger("t").info("first")
    configure_logging(fmt="console", stream=out, file=path, actor="x")
    configure_logging(fmt="console", stream=out, file=path, actor="x")
    get_logger("t").info("once")
    assert out.getvalue().count("once") == 1
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["event"] for line in lines] == ["first", "once"]


def test_a_logger_used_before_reconfiguring_follows_the_new_configuration():
    first, second = io.StringIO(), io.StringIO()
    log = get_logger("asyncrl.cached")
    configure_logging(fmt="json", stream=first, actor="a")
    log.info("one")  # cached here
    configure_logging(level="warning", fmt="console", stream=second, actor="b")
    log.info("filtered")
    log.warning("two")
    assert [line["event"] for line in json_lines(first)] == ["one"]
    assert "two" in second.getvalue() and "actor=b" in second.getvalue()
    assert "filtered" not in second.getvalue()


def test_bad_level_or_format_is_refused():
    with pytest.raises(ValueError, match="log level must be one of"):
        configure_logging(level="loud")
    with pytest.raises(ValueError, match="log format must be"):
        configure_logging(fmt="xml")  # type: ignore[arg-type]


def test_reset_logging_removes_our_handlers_and_the_context():
    out = io.StringIO()
    configure_logging(fmt="json", stream=out, actor="x")
    bind_task_context(uid="u")
    reset_logging()
    assert not [h for h in logging.getLogger().handlers if getattr(h, "stream", None) is out]
    assert structlog.contextvars.get_contextvars() == {}
    configure_logging(fmt="json", stream=out)
    get_logger("t").info("clean")
    assert "actor" not in json_lines(out)[-1] and "uid" not in json_lines(out)[-1]


# -- metrics ----------------------------------------------------------------------------


def test_metrics_are_json_lines_with_plain_numbers_and_a_time(tmp_path: Path):
    path = tmp_path / "m" / "metrics.jsonl"
    before = time.time()
    with JsonlMetricsSink(path) as sink:
        sink.write(
            {
                "step": np.int64(3),
                "loss": torch.tensor(0.5),
                "lr": np.float32(0.25),
                "kl": np.array(1.5),
                "ok": np.bool_(True),
                "tag": "train",
                "hist": [np.int32(1), 2],
            }
        )
        sink.write({"step": 4, "time": 123.0})
    rows = read_jsonl(path)
    assert rows[0] == {
        "step": 3,
        "loss": 0.5,
        "lr": 0.25,
        "kl": 1.5,
        "ok": True,
        "tag": "train",
        "hist": [1, 2],
        "time": rows[0]["time"],
    }
    assert isinstance(rows[0]["time"], float) and before <= rows[0]["time"] <= time.time()
    assert rows[1] == {"step": 4, "time": 123.0}


def test_non_finite_metrics_are_written_as_null(tmp_path: Path):
    path = tmp_path / "m.jsonl"
    with JsonlMetricsSink(path) as sink:
        sink.write({"nan": math.nan, "inf": np.float64("inf"), "t": torch.tensor(-math.inf)})
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()
    assert read_jsonl(path)[0] | {"time": 0} == {"nan": None, "inf": None, "t": None, "time": 0}


def test_an_unserialisable_metric_names_its_key(tmp_path: Path):
    with JsonlMetricsSink(tmp_path / "m.jsonl") as sink:
        with pytest.raises(TypeError, match="metric 'model' has a value of type object"):
            sink.write({"model": object()})
        with pytest.raises(TypeError, match=r"metric 'hist\[1\]' has a value of type Tensor"):
            sink.write({"hist": [1, torch.ones(2)]})
    assert (tmp_path / "m.jsonl").read_text() == ""  # a refused record leaves no partial line


def test_metrics_stay_buffered_until_flush_or_close(tmp_path: Path):
    path = tmp_path / "m.jsonl"
    sink = JsonlMetricsSink(path, flush_every=3600)
    sink.write({"a": 1})
    assert path.read_text() == ""
    sink.flush()
    assert [r["a"] for r in read_jsonl(path)] == [1]
    sink.write({"a": 2})
    sink.close()
    sink.close()  # idempotent
    assert [r["a"] for r in read_jsonl(path)] == [1, 2]
    with pytest.raises(ValueError, match="is closed"):
        sink.write({"a": 3})


def test_buffered_metrics_reach_the_file_within_flush_every_without_another_write(
    tmp_path: Path,
):
    path = tmp_path / "m.jsonl"
    with JsonlMetricsSink(path, flush_every=0.05) as sink:
        sink.write({"a": 1})
        assert wait_until(lambda: path.read_text() != "")
        assert [r["a"] for r in read_jsonl(path)] == [1]


def test_flush_every_zero_writes_on_every_call_and_reopening_appends(tmp_path: Path):
    path = tmp_path / "e.jsonl"
    with JsonlMetricsSink(path, flush_every=0) as eager:
        eager.write({"b": 1})
        assert [r["b"] for r in read_jsonl(path)] == [1]
    with JsonlMetricsSink(path, flush_every=0) as again:
        again.write({"b": 2})
    assert [r["b"] for r in read_jsonl(path)] == [1, 2]
    with pytest.raises(ValueError, match="flush_every must be >= 0"):
        JsonlMetricsSink(path, flush_every=-1)


def test_reading_skips_a_truncated_last_line_with_a_warning(tmp_path: Path):
    out = io.StringIO()
    configure_logging(fmt="json", stream=out)
    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3, "b"')
    assert [r["a"] for r in read_jsonl(path)] == [1, 2]
    [warning] = json_lines(out)
    assert (warning["level"], warning["line"]) == ("warning", 4)
    assert "truncated" in warning["event"]


def test_reading_raises_with_the_line_number_for_a_corrupt_line(tmp_path: Path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\nnot json\n{"a": 3}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2: not a JSON object"):
        read_jsonl(path)
    path.write_text('{"a": 1}\n{"a": 2, "b"\n')  # has its newline: corrupt, not truncated
    with pytest.raises(ValueError, match=r"m\.jsonl:2: not a JSON object"):
        read_jsonl(path)
    path.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2: not a JSON object: list"):
        read_jsonl(path)


def test_multi_sink_fans_out_one_record_with_one_time(tmp_path: Path):
    a, b = JsonlMetricsSink(tmp_path / "a.jsonl"), JsonlMetricsSink(tmp_path / "b.jsonl")
    with MultiSink(a, b) as multi:
        multi.write({"x": 1})
        multi.write({"x": 2, "time": 7.0})
        multi.flush()
        assert [r["x"] for r in read_jsonl(tmp_path / "a.jsonl")] == [1, 2]
    rows_a, rows_b = read_jsonl(tmp_path / "a.jsonl"), read_jsonl(tmp_path / "b.jsonl")
    assert rows_a == rows_b and rows_a[1]["time"] == 7.0
    with pytest.raises(ValueError, match="is closed"):
        b.write({"x": 3})


def test_multi_sink_closes_every_sink_even_when_one_fails(tmp_path: Path):
    class Broken:
        def write(self, record: Any) -> None: ...

        def flush(self) -> None: ...

        def close(self) -> None:
            raise OSError("disk gone")

    good = JsonlMetricsSink(tmp_path / "good.jsonl", flush_every=3600)
    good.write({"x": 1})
    with pytest.raises(OSError, match="disk gone"):
        MultiSink(good, Broken()).close()  # closed last-first: Broken goes first
    assert [r["x"] for r in read_jsonl(tmp_path / "good.jsonl")] == [1]
