"""The runtime seam: how actors are started, stopped and watched.

``LocalRuntime`` (child processes, ``runtime/local.py``) implements it today; the Ray
runtime implements the same protocol. The ``Supervisor`` only talks to this protocol.
"""

from __future__ import annotations

from typing import Protocol

from asyncrl.actors.base import ActorSpec


class ActorHandle(Protocol):
    """One started actor, as the supervisor sees it."""

    spec: ActorSpec

    @property
    def pid(self) -> int | None:
        """OS process id where known."""

    @property
    def exit_code(self) -> int | None:
        """None while running; the exit code (negative: killed by that signal) after."""

    async def wait(self) -> int:
        """Wait for the actor to exit; returns its exit code."""

    def tail(self, n: int = 40) -> list[str]:
        """The actor's last ``n`` output lines, for reports of a death."""


class Runtime(Protocol):
    """Starts and stops actors."""

    async def start(self, spec: ActorSpec) -> ActorHandle:
        """Launch ``spec``; returns once the process exists (not once it is ready)."""

    async def stop(self, handle: ActorHandle, grace: float) -> int:
        """Ask to stop (SIGTERM), wait ``grace`` seconds, then kill; returns the exit code."""

    def kill(self, handle: ActorHandle) -> None:
        """Kill at once (SIGKILL)."""
