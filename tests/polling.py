"""Waiting in tests for a condition no event signals (counters, files, another actor's view)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(condition: Callable[[], bool], seconds: float = 30.0, poll: float = 0.05) -> None:
    """Return once ``condition()`` holds; ``TimeoutError`` after ``seconds``."""
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110 - nothing to await: the condition is polled
            await asyncio.sleep(poll)
