"""The runtime seam: how actors are started, stopped and watched.

``LocalRuntime`` (child processes, ``runtime/local.py``) and ``RayRuntime`` (Ray actors,
``runtime/ray.py``) implement it; ``open_runtime`` picks one from the config. The
``Supervisor`` only talks to this protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from asyncrl.actors.base import ActorSpec

if TYPE_CHECKING:
    from asyncrl.config import RuntimeConfig
    from asyncrl.runtime.local import LocalRuntime
    from asyncrl.runtime.ray import RayRuntime


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

    @property
    def cause(self) -> str | None:
        """How the runtime saw the actor end when its exit code does not say (a Ray
        worker lost with its node); None otherwise."""

    def tail(self, n: int = 40) -> list[str]:
        """The actor's last ``n`` output lines, for reports of a death."""


class Runtime(Protocol):
    """Starts and stops actors."""

    async def place(self, specs: Sequence[ActorSpec]) -> dict[str, str]:
        """Decide where ``specs`` run (before any starts) and return the job's endpoints
        (``topology.ENDPOINTS``), each bindable where the actor that binds it will run."""

    async def start(self, spec: ActorSpec) -> ActorHandle:
        """Launch ``spec``; returns once the process exists (not once it is ready)."""

    async def stop(self, handle: ActorHandle, grace: float) -> int:
        """Ask to stop (SIGTERM), wait ``grace`` seconds, then kill; returns the exit code."""

    def kill(self, handle: ActorHandle) -> None:
        """Kill at once (SIGKILL)."""


def open_runtime(config: RuntimeConfig, run_dir: Path) -> LocalRuntime | RayRuntime:
    """The runtime ``config.type`` names, for ``async with`` (Ray is imported only here)."""
    if config.type == "ray":
        from asyncrl.runtime.ray import RayRuntime

        return RayRuntime(run_dir, config.ray, host=config.host)
    from asyncrl.runtime.local import LocalRuntime

    return LocalRuntime(run_dir, host=config.host, fork_server=config.fork_server)


class PlacementFailed(RuntimeError):
    """The runtime could not place the job (the cluster cannot hold it, or is unreachable)."""


async def place_job(runtime: Runtime, specs: Sequence[ActorSpec]) -> dict[str, str]:
    """Place ``specs`` and give each the job's endpoints; ``PlacementFailed`` says why not."""
    try:
        endpoints = await runtime.place(specs)
    except Exception as exc:  # Ray's and the runtime's own errors alike
        raise PlacementFailed(
            f"cannot place the job's actors: {type(exc).__name__}: {exc}"
        ) from exc
    for spec in specs:
        spec.endpoints = dict(endpoints)
    return endpoints
