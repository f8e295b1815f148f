"""The live progress bar of ``asyncrl train``: step, reward, samples/s and staleness.

It reads the trainer's heartbeat, which the controller receives anyway
(``Supervisor.status``), so it costs the job nothing. Drawn with ``rich`` on a terminal;
elsewhere (CI logs, pipes) it stays silent, since the structured logs say the same.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.runtime.supervisor import ActorStatus


@dataclass
class RateMeter:
    """Samples/s since the first step it saw: ``(steps - steps0) * samples_per_step /
    seconds since``, so a resumed run counts from its first new step (``None`` until a
    second observation)."""

    samples_per_step: int
    _first: tuple[float, int] | None = field(default=None, init=False)

    def rate(self, steps: int, now: float) -> float | None:
        if self._first is None or steps < self._first[1]:
            self._first = (now, steps)
            return None
        start, steps0 = self._first
        if now <= start or steps == steps0:
            return None
        return (steps - steps0) * self.samples_per_step / (now - start)


def progress_fields(stats: Mapping[str, float], rate: float | None) -> dict[str, str]:
    """The text of each column, from the trainer's heartbeat ``stats``."""

    def fmt(key: str, spec: str) -> str:
        value = stats.get(key)
        return "-" if value is None else format(value, spec)

    return {
        "reward": fmt("reward/mean", ".3f"),
        "staleness": fmt("staleness/mean", ".2f"),
        "rate": "-" if rate is None else f"{rate:.1f}",
    }


class JobProgress:
    """A rich progress bar fed from ``Supervisor.status`` every ``interval`` seconds."""

    def __init__(self, num_steps: int, samples_per_step: int, *, interval: float = 1.0) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.meter = RateMeter(samples_per_step)
        self.interval = interval
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("step {task.completed:.0f}/{task.fields[total_text]}"),
            TextColumn("reward {task.fields[reward]}"),
            TextColumn("{task.fields[rate]} samples/s"),
            TextColumn("staleness {task.fields[staleness]}"),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
        )
        total = num_steps if num_steps > 0 else None
        self.task = self.progress.add_task(
            "train",
            total=total,
            total_text=str(num_steps or "?"),
            reward="-",
            rate="-",
            staleness="-",
        )

    def update(self, status: Mapping[str, ActorStatus]) -> None:
        trainer = status.get("trainer")
        if trainer is None:
            return
        steps = trainer.version
        rate = self.meter.rate(steps, time.monotonic())
        fields: dict[str, Any] = progress_fields(trainer.stats, rate)
        self.progress.update(self.task, completed=steps, **fields)

    async def run(self, status: Mapping[str, ActorStatus]) -> None:
        """Redraw until cancelled."""
        with self.progress:
            while True:
                self.update(status)
                await asyncio.sleep(self.interval)
