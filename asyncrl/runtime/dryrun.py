"""``asyncrl train --dry-run``: start the job's actors, prove every channel, stop cleanly.

A ``ProbeActor`` in each role of the real topology, on the configured runtime and under
the real supervisor, moves traffic on every channel; one row per actor comes back. It
catches in seconds what would otherwise fail an hour into a job: ports, imports, a
config that does not load in a child process, a firewall between actors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

from asyncrl.actors.base import ActorSpec
from asyncrl.actors.config import ProbeActorConfig
from asyncrl.config import RunConfig
from asyncrl.runtime.base import ActorHandle, PlacementFailed, open_runtime, place_job
from asyncrl.runtime.supervisor import ActorStatus, Supervisor
from asyncrl.runtime.topology import job_specs
from asyncrl.wire import security
from asyncrl.wire.control import ControlServer

PROBE = "asyncrl.actors.probe:ProbeActor"


@dataclasses.dataclass
class DryRunResult:
    """Outcome of a dry run: ``ok`` and one row per actor."""

    ok: bool
    seconds: float
    rows: list[dict[str, Any]]
    error: str = ""


async def dry_run(cfg: RunConfig, *, count: int = 64, deadline: float = 120.0) -> DryRunResult:
    """Run the probe topology for ``cfg``; never raises for actor failures (see ``error``)."""
    start = time.monotonic()
    run_dir = cfg.resolved_output_dir()
    specs = _specs(cfg, run_dir, count)
    with security.enabled_for(cfg.wire):
        return await _dry_run(cfg, run_dir, specs, deadline, start)


async def _dry_run(
    cfg: RunConfig, run_dir: Path, specs: list[ActorSpec], deadline: float, start: float
) -> DryRunResult:
    error, codes, rows = "", {}, []
    async with open_runtime(cfg.runtime, run_dir) as runtime:
        try:
            endpoints = await place_job(runtime, specs)
        except PlacementFailed as exc:
            return DryRunResult(ok=False, seconds=time.monotonic() - start, rows=[], error=str(exc))
        async with ControlServer(endpoints["control"]) as control:
            sup = Supervisor(
                runtime,
                control,
                heartbeat_timeout=cfg.runtime.heartbeat_timeout,
                startup_timeout=deadline,
            )
            async with sup:
                try:
                    async with asyncio.timeout(deadline):
                        await sup.launch(specs)
                        await sup.wait_until(_all_done)
                except TimeoutError:
                    late = [n for n, s in sup.status.items() if s.stats.get("probe.done") != 1.0]
                    error = f"actors {late} did not finish their traffic within {deadline:.0f}s"
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
                codes = await sup.stop_all(cfg.runtime.stop_timeout)
                rows = [
                    _row(sup.status[s.name], codes.get(s.name), sup.handles[s.name])
                    for s in specs
                    if s.name in sup.handles
                ]
    ok = not error and all(code == 0 for code in codes.values())
    return DryRunResult(ok=ok, seconds=time.monotonic() - start, rows=rows, error=error)


def _specs(cfg: RunConfig, run_dir: Path, count: int) -> list[ActorSpec]:
    common = {
        "heartbeat_interval": cfg.runtime.heartbeat_interval,
        "drain_timeout": cfg.runtime.stop_timeout,
        "log_level": cfg.log.level,
        "log_format": cfg.log.format,
    }
    n = cfg.rollout.num_actors
    params = {
        role: ProbeActorConfig(role=role, count=count, rollouts=n)
        for role in ("buffer", "rollout", "trainer")
    }
    return job_specs(
        classes={"buffer": PROBE, "rollout": PROBE, "trainer": PROBE},
        num_rollout_actors=n,
        endpoints={},
        run_dir=run_dir,
        wire=cfg.wire.model_dump(mode="json"),
        common=common,
        params=params,
    )


def _all_done(status: dict[str, ActorStatus]) -> bool:
    return all(st.stats.get("probe.done") == 1.0 for st in status.values())


def _row(st: ActorStatus, code: int | None, handle: ActorHandle) -> dict[str, Any]:
    probe = {
        k.removeprefix("probe."): int(v)
        for k, v in st.stats.items()
        if k.startswith("probe.") and k != "probe.done"
    }
    probe["blob_kib"] = probe.pop("blob_bytes", 0) // 1024
    return {
        "actor": st.name,
        "role": st.role,
        "node": getattr(handle, "node_id", "")[:8] or "local",
        "pid": st.pid,
        "version": st.version,
        **probe,
        "heartbeats": st.heartbeats,
        "exit_code": code,
        "bye": st.bye.reason if st.bye else "",
    }
