"""Metrics sinks: where the controller and trainer write the run's numbers, one record a line.

The JSONL files are the record; TensorBoard and W&B are fed from them by the controller
(``trackers.py``), so no actor process talks to a tracker. Values are plain JSON:
non-finite floats are written as ``null`` (JSON has no NaN), so a reader sees a missing
number, not a string.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self

from asyncrl.observe.logs import get_logger

log = get_logger("asyncrl.metrics")


class MetricsSink(Protocol):
    """Anything that accepts metric records; the controller writes through this."""

    def write(self, record: Mapping[str, Any]) -> None:
        """Accept one record: a flat mapping of names to numbers or strings."""

    def flush(self) -> None:
        """Hand every accepted record to durable storage."""

    def close(self) -> None:
        """Flush and release the sink; later writes are errors."""


def _plain(key: str, value: Any) -> Any:
    """``value`` as a JSON-ready Python value; ``key`` names it in the error."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # numpy scalar, 0-d array or 0-d torch tensor
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(f"{key}.{k}", v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(f"{key}[{i}]", v) for i, v in enumerate(value)]
    raise TypeError(
        f"metric {key!r} has a value of type {type(value).__name__}, which JSON cannot "
        "hold; log a number, string, list or dict (call .item() on a tensor element)"
    )


def _encode(record: Mapping[str, Any], now: float) -> str:
    """One JSON line (no newline) for ``record``, with ``time`` set to ``now`` if absent."""
    row = {str(k): _plain(str(k), v) for k, v in record.items()}
    row.setdefault("time", now)
    return json.dumps(row, allow_nan=False)


class _ClosesOnExit:
    """``with sink:`` closes it on the way out."""

    def close(self) -> None:
        """Release the sink (subclasses flush first)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class JsonlMetricsSink(_ClosesOnExit):
    """Appends records as JSON lines to ``path`` (parents created, never truncated).

    ``write`` only buffers; a daemon thread writes the buffer every ``flush_every``
    seconds, and ``flush()``/``close()`` write it at once. ``flush_every=0`` writes on
    every call. Use it as a context manager or call ``close()``; an unclosed sink is
    flushed at interpreter exit, but a killed process loses its last ``flush_every``
    seconds. Thread-safe.
    """

    def __init__(self, path: str | Path, *, flush_every: float = 1.0) -> None:
        if not flush_every >= 0:
            raise ValueError(f"flush_every must be >= 0 seconds, got {flush_every!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_every = flush_every
        self._file = self.path.open("a", encoding="utf-8")
        self._pending: list[str] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._flusher: threading.Thread | None = None
        atexit.register(self.close)

    def write(self, record: Mapping[str, Any]) -> None:
        """Buffer ``record``, adding ``time`` (unix seconds) when absent."""
        line = _encode(record, time.time())
        with self._lock:
            if self._closed.is_set():
                raise ValueError(f"metrics sink {self.path} is closed")
            self._pending.append(line)
        if self.flush_every == 0:
            self.flush()
        elif self._flusher is None:
            self._start_flusher()

    def _start_flusher(self) -> None:
        """Start the thread that bounds how long a record waits in memory."""
        self._flusher = threading.Thread(
            target=self._flush_periodically, name=f"metrics-flush:{self.path.name}", daemon=True
        )
        self._flusher.start()

    def _flush_periodically(self) -> None:
        while not self._closed.wait(self.flush_every):
            self.flush()

    def flush(self) -> None:
        """Write buffered records to the file and flush it to the OS (no fsync)."""
        with self._lock:
            if self._file.closed:
                return
            if self._pending:
                self._file.write("\n".join(self._pending) + "\n")
                self._pending.clear()
            self._file.flush()

    def close(self) -> None:
        """Flush, stop the flusher thread and close the file; idempotent."""
        self._closed.set()
        self.flush()
        with self._lock:
            self._file.close()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join()
        atexit.unregister(self.close)


class MultiSink(_ClosesOnExit):
    """Fans every call out to several sinks; the controller builds one from the config."""

    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = sinks

    def write(self, record: Mapping[str, Any]) -> None:
        """Write to every sink, stamped with one ``time`` so the copies agree."""
        stamped = {"time": time.time(), **record}
        for sink in self.sinks:
            sink.write(stamped)

    def flush(self) -> None:
        """Flush every sink."""
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        """Close every sink, even when one fails (its error is raised afterwards)."""
        with contextlib.ExitStack() as stack:
            for sink in self.sinks:
                stack.callback(sink.close)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics file written by ``JsonlMetricsSink`` (strictly: for tools and tests).

    A last line without its newline that does not parse is what a crash mid-write leaves:
    it is skipped with a warning. Any other bad line raises ``ValueError`` naming the file
    and line number.
    """
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    # The text after the final newline: "" for a complete file, else an unfinished line.
    *complete, tail = lines
    rows = [
        _parse_line(path, number, line) for number, line in enumerate(complete, 1) if line.strip()
    ]
    if tail.strip():
        try:
            rows.append(_parse_line(path, len(lines), tail))
        except ValueError:
            log.warning("skipping truncated last line", path=str(path), line=len(lines))
    return rows


def _parse_line(path: str | Path, number: int, line: str) -> dict[str, Any]:
    """One JSON object from ``line``; ValueError names ``path:number``."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{number}: not a JSON object: {exc}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{number}: not a JSON object: {type(row).__name__}")
    return row
