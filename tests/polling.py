"""Waiting in tests for a condition no event signals (counters, files, another actor's view)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path


async def until(condition: Callable[[], bool], seconds: float = 30.0, poll: float = 0.05) -> None:
    """Return once ``condition()`` holds; ``TimeoutError`` after ``seconds``."""
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110 - nothing to await: the condition is polled
            await asyncio.sleep(poll)


def alive(pid: int) -> bool:
    """True while ``pid`` runs: a zombie (dead, not yet reaped by init) is not alive."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # after the name, which may hold spaces
