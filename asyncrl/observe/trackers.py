"""Experiment trackers: the run's JSONL metrics, forwarded to TensorBoard and W&B.

The JSONL files stay the record; the controller follows them and forwards each new row, so
a job has one TensorBoard log and one W&B run however many processes it has, and a tracker
that fails cannot stop an actor. Only numbers go, except the trained samples (a table a
step). Each family has its own step axis (in W&B a ``define_metric`` step metric, since
W&B's own step may only grow)::

    RUN_DIR/metrics.jsonl            -> train/<key>        step: the row's ``step``
    RUN_DIR/metrics/eval.jsonl       -> eval/<set>/<key>   step: the row's ``version``
    RUN_DIR/metrics/buffer.jsonl     -> buffer/<key>       step: ``buffer.version``
    RUN_DIR/metrics/rollout-N.jsonl  -> rollout-N/<key>    step: the last train step seen
    RUN_DIR/samples.jsonl            -> samples (text)      step: the row's ``step``
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import netrc
import os
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from asyncrl.observe.logs import get_logger

log = get_logger("asyncrl.trackers")


@dataclass(frozen=True)
class Point:
    """Scalars of one metrics row: ``family`` names the source (``train``, ``eval/test``,
    ``buffer``, ``rollout-0``); ``step`` is its position on that family's axis."""

    family: str
    step: int
    scalars: dict[str, float]
    table: list[dict[str, Any]] | None = None  # rows of text (the samples family)


class Tracker(Protocol):
    """Where points go: TensorBoard, W&B, or anything with these two methods."""

    def log(self, point: Point) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars as ``<family>/<key>`` into a TensorBoard event file under ``log_dir``."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, point: Point) -> None:
        for key, value in point.scalars.items():
            self.writer.add_scalar(f"{point.family}/{key}", value, point.step)
        if point.table:
            self.writer.add_text(point.family, _markdown(point.table), point.step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One W&B run per job; each family is plotted against its own step metric."""

    def __init__(
        self,
        *,
        project: str,
        name: str,
        directory: Path,
        config: Mapping[str, Any],
        mode: str = "online",
        group: str | None = None,
    ) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=name,
            group=group,
            dir=str(directory),
            config=dict(config),
            mode=mode,  # type: ignore[arg-type]
        )
        self._families: set[str] = set()

    def log(self, point: Point) -> None:
        axis = f"{point.family}/step"
        if point.family not in self._families:
            self.run.define_metric(axis)
            self.run.define_metric(f"{point.family}/*", step_metric=axis)
            self._families.add(point.family)
        row: dict[str, Any] = {f"{point.family}/{k}": v for k, v in point.scalars.items()}
        if point.table:
            import wandb

            # Text cells: W&B fixes a column's type from its first row, and a reward
            # may be a number in one row and a dict of terms in the next.
            columns = list(point.table[0])
            data = [[str(_cell(r.get(c))) for c in columns] for r in point.table]
            row[f"{point.family}/table"] = wandb.Table(columns=columns, data=data)
        self.run.log({**row, axis: point.step})

    def close(self) -> None:
        self.run.finish()


@dataclass
class _Tail:
    """A JSONL file read incrementally from ``offset``."""

    path: Path
    offset: int = 0

    def new_rows(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a half-written line waits
        self.offset += len(complete)
        rows = []
        for line in complete.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                log.warning("metrics line skipped: not JSON", path=str(self.path))
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows


@dataclass
class MetricsFollower:
    """Follows a run directory's metrics files and hands new rows to ``trackers``."""

    run_dir: Path
    trackers: list[Tracker]
    _tails: dict[Path, _Tail] = field(default_factory=dict)
    _train_step: int = 0
    # Polls run in worker threads, and cancelling the task that awaits one does not stop
    # it: without the lock, close() could shut a writer under a poll still forwarding the
    # last rows, and the tracker would be dropped with those rows.
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def poll(self) -> int:
        """Forward every complete row written since the last call; returns how many. A
        tracker that raises is logged and dropped: the job and the JSONL files go on."""
        with self._lock:
            return self._poll()

    def _poll(self) -> int:
        points = [p for path in self._files() for p in self._points(path)]
        for tracker in list(self.trackers):
            try:
                for point in points:
                    tracker.log(point)
            except Exception as exc:
                name, error = type(tracker).__name__, f"{type(exc).__name__}: {exc}"
                log.error("tracker failed and is dropped", tracker=name, error=error)
                self.trackers.remove(tracker)
        return len(points)

    def close(self) -> None:
        """A last poll (after any poll still running), then close every tracker."""
        with self._lock:
            self._poll()
            for tracker in self.trackers:
                try:
                    tracker.close()
                except Exception as exc:
                    name = type(tracker).__name__
                    log.error("tracker failed to close", tracker=name, error=str(exc))

    def _files(self) -> list[Path]:
        metrics = self.run_dir / "metrics"
        rollouts = sorted(metrics.glob("rollout-*.jsonl")) if metrics.is_dir() else []
        # The trainer's file first, so the other rows of this poll see its latest step.
        names = [self.run_dir / "metrics.jsonl", metrics / "eval.jsonl", metrics / "buffer.jsonl"]
        return [*names, *rollouts, self.run_dir / "samples.jsonl"]

    def _points(self, path: Path) -> list[Point]:
        tail = self._tails.setdefault(path, _Tail(path))
        if path.name == "samples.jsonl":
            return _sample_points(tail.new_rows())
        return [self._point(path, row) for row in tail.new_rows()]

    def _point(self, path: Path, row: dict[str, Any]) -> Point:
        if path.name == "metrics.jsonl" and path.parent == self.run_dir:
            self._train_step = int(row.get("step", self._train_step))
            return Point("train", self._train_step, scalars(row, drop=("step",)))
        if path.name == "eval.jsonl":
            family = f"eval/{row.get('set', 'eval')}"
            return Point(family, int(row.get("version", 0)), scalars(row, drop=("version",)))
        if path.name == "buffer.jsonl":
            row = {k.removeprefix("buffer."): v for k, v in row.items()}
            return Point("buffer", int(row.get("version", 0)), scalars(row, drop=("version",)))
        return Point(path.stem, self._train_step, scalars(row))


@contextlib.asynccontextmanager
async def following(
    run_dir: Path, trackers: Sequence[Tracker], interval: float
) -> AsyncIterator[MetricsFollower | None]:
    """Forward ``run_dir``'s metrics to ``trackers`` every ``interval`` seconds while the
    body runs, and everything left once it ends (then close them). No trackers: nothing."""
    if not trackers:
        yield None
        return
    follower = MetricsFollower(run_dir, list(trackers))
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(_poll_forever(follower, interval), name="controller.trackers")
        try:
            yield follower
        finally:
            task.cancel()
    await asyncio.to_thread(follower.close)


async def _poll_forever(follower: MetricsFollower, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        await asyncio.to_thread(follower.poll)


def _sample_points(rows: list[dict[str, Any]]) -> list[Point]:
    """One ``samples`` point per step, its rows as the table (``time`` dropped)."""
    steps: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        steps.setdefault(int(row.get("step", 0)), []).append(
            {k: v for k, v in row.items() if k != "time"}
        )
    return [Point("samples", step, {}, table) for step, table in steps.items()]


def _cell(value: Any) -> Any:
    """A table cell: numbers and text as they are, anything else as JSON."""
    return value if isinstance(value, str | int | float) or value is None else json.dumps(value)


def _markdown(rows: list[dict[str, Any]]) -> str:
    """``rows`` as a markdown table (TensorBoard's text plugin renders it)."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = (str(_cell(row.get(c))).replace("|", "\\|").replace("\n", "<br>") for c in columns)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scalars(row: Mapping[str, Any], drop: Sequence[str] = ()) -> dict[str, float]:
    """The finite numbers of ``row`` (bools as 0/1), without ``time`` and ``drop``."""
    out = {}
    for key, value in row.items():
        if key in drop or key == "time" or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def check_tracker_setup(*, tensorboard: bool, wandb: bool, wandb_mode: str) -> list[str]:
    """Problems that would make a tracker fail after launch; called by config validation."""
    problems = [
        f"use_{name} needs the {name} package: pip install 'asyncrl[tracking]'"
        for name, wanted in (("tensorboard", tensorboard), ("wandb", wandb))
        if wanted and not _importable(name)
    ]
    if wandb and wandb_mode == "online" and not _has_wandb_key():
        problems.append(
            "use_wandb in online mode needs an API key (WANDB_API_KEY or `wandb login`); "
            "or log locally with --wandb-mode offline and `wandb sync` later"
        )
    return problems


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False
