"""TensorBoard and W&B forwarding (``asyncrl.observe.trackers``): the follower turns each
metrics file's new rows into points on the right axis; the real TensorBoard writer and an
offline W&B run hold what was sent; a failing tracker is dropped, not fatal."""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from asyncrl.config import LogConfig
from asyncrl.observe.trackers import (
    MetricsFollower,
    Point,
    TensorBoardTracker,
    WandbTracker,
    scalars,
)


class Recorder:
    """A Tracker that keeps what it is given."""

    def __init__(self) -> None:
        self.points: list[Point] = []
        self.closed = False

    def log(self, point: Point) -> None:
        self.points.append(point)

    def close(self) -> None:
        self.closed = True


class Broken(Recorder):
    def log(self, point: Point) -> None:
        raise ConnectionError("tracker service unreachable")


def append(path: Path, *rows: dict, partial: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + partial)


def test_each_file_becomes_a_family_on_its_own_step_axis(tmp_path):
    append(tmp_path / "metrics.jsonl", {"actor": "trainer", "step": 7, "loss": 0.5, "time": 1.0})
    append(tmp_path / "metrics" / "eval.jsonl", {"set": "test", "version": 5, "pass@1": 0.4})
    append(tmp_path / "metrics" / "buffer.jsonl", {"buffer.version": 7, "buffer.consumed": 56})
    append(tmp_path / "metrics" / "rollout-0.jsonl", {"rollout/groups": 9, "busy": [[1, 2]]})
    rec = Recorder()
    follower = MetricsFollower(tmp_path, [rec])
    assert follower.poll() == 4
    assert rec.points == [
        Point("train", 7, {"loss": 0.5}),
        Point("eval/test", 5, {"pass@1": 0.4}),
        Point("buffer", 7, {"consumed": 56.0}),
        Point("rollout-0", 7, {"rollout/groups": 9.0}),  # on the last train step seen
    ]


def test_only_complete_new_lines_are_forwarded_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append(path, {"step": 1, "loss": 1.0}, partial='{"step": 2, "lo')
    rec = Recorder()
    follower = MetricsFollower(tmp_path, [rec])
    assert follower.poll() == 1
    assert follower.poll() == 0  # the half-written row waits
    with path.open("a") as f:
        f.write('ss": 0.5}\nnot json\n')
    follower.close()
    assert [p.step for p in rec.points] == [1, 2] and rec.closed


def test_a_failing_tracker_is_dropped_and_the_others_go_on(tmp_path):
    append(tmp_path / "metrics.jsonl", {"step": 1, "loss": 1.0})
    good, bad = Recorder(), Broken()
    follower = MetricsFollower(tmp_path, [bad, good])
    follower.poll()
    append(tmp_path / "metrics.jsonl", {"step": 2, "loss": 0.9})
    follower.poll()
    assert [p.step for p in good.points] == [1, 2] and follower.trackers == [good]


class SlowWriter(Recorder):
    """Like TensorBoard's writer: slow to log, and refuses after close."""

    def log(self, point: Point) -> None:
        time.sleep(0.1)
        if self.closed:
            raise OSError("Writer is closed")
        super().log(point)


def test_closing_waits_for_a_poll_still_forwarding(tmp_path):
    # The controller cancels the poll task while its worker thread may still be forwarding;
    # close() must not shut the writer under it (the last rows were lost that way).
    append(tmp_path / "metrics.jsonl", *({"step": i, "loss": 1.0} for i in (1, 2, 3)))
    slow = SlowWriter()
    follower = MetricsFollower(tmp_path, [slow])
    polling = threading.Thread(target=follower.poll)
    polling.start()
    time.sleep(0.05)  # the poll has taken the rows and is logging the first
    follower.close()
    polling.join()
    assert [p.step for p in slow.points] == [1, 2, 3] and slow.closed
    assert follower.trackers == [slow]


def test_scalars_keep_finite_numbers_only():
    row = {"a": 1, "b": True, "c": None, "d": "x", "e": float("nan"), "f": [1], "time": 3.0}
    assert scalars(row) == {"a": 1.0, "b": 1.0}


def test_tensorboard_holds_every_scalar_at_its_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = TensorBoardTracker(tmp_path / "tb")
    for step, loss in [(1, 0.5), (2, 0.25)]:
        tracker.log(Point("train", step, {"loss": loss}))
    tracker.log(Point("eval/test", 1, {"pass@1": 0.75}))
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("eval/test/pass@1")] == [(1, 0.75)]


def wandb_history(
    run_file: Path, until: Callable[[list[dict]], bool], timeout: float = 30.0
) -> list[dict[str, float]]:
    """The history rows of an offline W&B run file, once ``until(rows)`` holds (or what it
    holds after ``timeout`` s): wandb's core process, shared by every run of this pytest
    process, writes the file on its own schedule, and ``finish()`` may return first."""
    deadline = time.monotonic() + timeout
    while True:
        rows = _read_history(run_file)
        if until(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def _read_history(run_file: Path) -> list[dict[str, float]]:
    """The file is a 7-byte header and a LevelDB-style log (32 KiB blocks of records:
    crc32, length, type, data) of protobuf ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, rows, pos, pending = run_file.read_bytes(), [], 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block trailer
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last fragment of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in record.history.item
                    }
                )
    return rows


def test_an_offline_wandb_run_holds_each_family_with_its_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbTracker(
        project="asyncrl-test", name="t", directory=tmp_path, config={"seed": 3}, mode="offline"
    )
    tracker.log(Point("train", 1, {"loss": 0.5}))
    tracker.log(Point("train", 2, {"loss": 0.25}))
    tracker.log(Point("eval/test", 1, {"pass@1": 0.75}))  # an older step than train's
    tracker.close()
    [run_file] = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    rows = [
        {k: v for k, v in r.items() if not k.startswith("_")}
        for r in wandb_history(run_file, lambda rows: len(rows) >= 3)
    ]
    assert rows == [
        {"train/loss": 0.5, "train/step": 1},
        {"train/loss": 0.25, "train/step": 2},
        {"eval/test/pass@1": 0.75, "eval/test/step": 1},
    ], f"{run_file} ({run_file.stat().st_size} bytes)"


def test_trackers_that_cannot_start_are_refused_before_launch(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a W&B key
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    with pytest.raises(ValidationError, match="--wandb-mode offline"):
        LogConfig(use_wandb=True)
    LogConfig(use_wandb=True, wandb_mode="offline", use_tensorboard=True)
