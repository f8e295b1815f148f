"""Metrics sinks: where the controller writes the run's numbers (one record per line).

``JsonlMetricsSink`` always runs; TensorBoard and W&B sinks implement the same
``MetricsSink`` protocol when asked for. JSON has no NaN or infinity: they are written as
``null``. Records are buffered and flushed every ``flush_every`` seconds, so a crash loses
at most that much.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import numpy as np

from asyncrl.observe.logs import get_logger

log = get_logger("asyncrl.metrics")


class MetricsSink(Protocol):
    """Anything that accepts metric records."""

    def write(self, record: Mapping[str, Any]) -> None:
        """Accept one record (a flat mapping of names to numbers or strings)."""

    def flush(self) -> None:
        """Make every accepted record durable."""

    def close(self) -> None:
        """Flush and release the sink."""


def _plain(key: str, value: Any) -> Any:
    if isinstance(value, (np.generic, np.ndarray)) and np.ndim(value) == 0:
        value = value.item()
    elif hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # 0-d torch tensor
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(f"{key}.{k}", v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(key, v) for v in value]
    raise TypeError(f"metric {key!r} has a value of type {type(value).__name__}")


class JsonlMetricsSink:
    """Appends records as JSON lines to ``path`` (parents created)."""

    def __init__(self, path: str | Path, *, flush_every: float = 1.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_every = flush_every
        self._file = self.path.open("a", encoding="utf-8")
        self._pending: list[str] = []
        self._last_flush = time.monotonic()

    def write(self, record: Mapping[str, Any]) -> None:
        """Buffer ``record`` (adding ``time`` when absent); flush when due."""
        row = {str(k): _plain(str(k), v) for k, v in record.items()}
        row.setdefault("time", time.time())
        self._pending.append(json.dumps(row, allow_nan=False))
        if time.monotonic() - self._last_flush >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Write buffered records and flush the file."""
        if self._pending:
            self._file.write("\n".join(self._pending) + "\n")
            self._pending.clear()
        self._file.flush()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        """Flush and close."""
        if not self._file.closed:
            self.flush()
            self._file.close()

    def __enter__(self) -> JsonlMetricsSink:
        return self

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class MultiSink:
    """Fans every call out to several sinks."""

    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = sinks

    def write(self, record: Mapping[str, Any]) -> None:
        """Write to every sink, stamped with one ``time`` so the copies agree."""
        record = {"time": time.time(), **record}
        for sink in self.sinks:
            sink.write(record)

    def flush(self) -> None:
        """Flush every sink."""
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        """Close every sink."""
        for sink in self.sinks:
            sink.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics file; a truncated last line (a crash mid-write) is skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                log.warning("skipping truncated last line", path=str(path), line=number)
                break
            raise ValueError(f"{path}:{number}: not a JSON object: {exc}") from None
    return rows
