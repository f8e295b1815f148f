"""Chaos: SIGKILL the actors of a running job on a schedule, then prove nothing was lost.

``Chaos`` runs the kills (``asyncrl chaos --kill TARGET@WHEN[:SIGNAL]``) one at a time,
each once the job is calm; ``audit_run`` then checks the run's accounting, independently
of the buffer's own counters where it can (``docs/reliability.md``, "Chaos").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.observe.logs import get_logger
from asyncrl.runtime.supervisor import ActorDied, Supervisor
from asyncrl.wire.errors import PeerLost, RemoteError
from asyncrl.wire.messages import Command

if TYPE_CHECKING:
    from asyncrl.job import JobResult

log = get_logger("asyncrl.chaos")
_WHEN = re.compile(r"^(?:(\d+(?:\.\d+)?)s|step(\d+))$")
#: The signals a kill may send; SIGKILL through the runtime, the others to the pid.
SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT", "SIGSTOP")
_POLL_S = 0.1
#: A new incarnation in one of these states came back: past running, too, since one
#: with little left (a trainer 5 steps from the end) can finish between two polls.
_BACK = ("running", "draining", "stopped", "finished")


@dataclasses.dataclass(frozen=True)
class KillAt:
    """One scheduled kill: ``target`` at ``seconds`` after every actor is up, or once the
    trainer's heartbeat reports version ``step`` or more.

    ``target``: an actor (``rollout-1``), a role (one of its actors at random), or
    ``random`` (any actor of a role that may be restarted).
    """

    target: str
    seconds: float | None = None
    step: int | None = None
    signal: str = "SIGKILL"

    @classmethod
    def parse(cls, text: str) -> KillAt:
        """``TARGET@30s`` or ``TARGET@step20``, then ``:SIGTERM`` (or ``:TERM``) for
        another signal than SIGKILL; ``ValueError`` saying what is wrong."""
        target, sep, rest = text.partition("@")
        when, _, sig = rest.partition(":")
        match = _WHEN.match(when)
        if not sep or not target or match is None:
            raise ValueError(
                f"chaos kill {text!r}: expected TARGET@SECONDSs or TARGET@stepN[:SIGNAL], "
                "e.g. trainer@30s or rollout@step20:SIGTERM"
            )
        name = sig.upper() if sig.upper().startswith("SIG") else f"SIG{sig.upper()}"
        if sig and name not in SIGNALS:
            raise ValueError(
                f"chaos kill {text!r}: signal {sig!r} is not one of {', '.join(SIGNALS)}"
            )
        seconds = float(match.group(1)) if match.group(1) is not None else None
        step = int(match.group(2)) if match.group(2) is not None else None
        return cls(target, seconds=seconds, step=step, signal=name if sig else "SIGKILL")


def check_targets(
    kills: list[KillAt], roles: dict[str, str], budgets: dict[str, int], runtime: str = "local"
) -> None:
    """Refuse a kill whose target is not in the job (``roles``: actor -> role), or whose
    role is never restarted (``budgets``): the kill would end the job, not test it; and a
    signal other than SIGKILL outside the local runtime (a Ray worker has no pid of ours)."""
    for kill in kills:
        if kill.signal != "SIGKILL" and runtime != "local":
            raise ValueError(
                f"chaos kill {kill.target!r}: {kill.signal} needs the local "
                f"runtime (this job runs on {runtime}); use SIGKILL"
            )
        if kill.target == "random":
            continue
        role = roles.get(kill.target) or (kill.target if kill.target in roles.values() else None)
        if role is None:
            known = ", ".join(sorted({*roles, *roles.values()}))
            raise ValueError(
                f"chaos kill {kill.target!r}: not an actor or role of this job ({known}, random)"
            )
        if budgets.get(role, 0) < 1:
            why = " (the trainer needs --save-interval N)" if role == "trainer" else ""
            raise ValueError(
                f"chaos kill {kill.target!r}: {role} actors are not restarted "
                f"in this job{why}; set --runtime.max-restarts N"
            )


@dataclasses.dataclass
class Kill:
    """A kill that happened: victim, pid, when (seconds since start), the trainer's
    version then, and when the victim was running again (None: it never came back)."""

    actor: str
    pid: int | None
    at_s: float
    step: int
    back_s: float | None = None
    signal: str = "SIGKILL"


class Chaos:
    """Runs a kill schedule against a supervisor's actors.

    ``every``: a ``random`` kill every that many seconds until the job ends. ``duration``
    stops the trainer after that many seconds, ``stop_when_back`` once the last scheduled
    victim is back; either way it checkpoints and the job winds down as after its last
    step. Each kill waits until its victim is running (it said Hello since its last
    restart, and no other restart is under way) and records when it was back.
    """

    def __init__(
        self,
        schedule: list[KillAt],
        *,
        every: float | None = None,
        duration: float | None = None,
        seed: int = 0,
        roles: tuple[str, ...] = ("buffer", "trainer", "rollout", "engine", "eval"),
        stop_when_back: bool = False,
    ) -> None:
        if stop_when_back and every is not None:
            raise ValueError(
                "chaos: every kills until the job ends; stop_when_back ends it "
                "after the schedule: give one"
            )
        # Due order can mix a time and a step; within each kind, earliest first.
        self.schedule = sorted(schedule, key=_due_order)
        self.every = every
        self.duration = duration
        self.stop_when_back = stop_when_back
        self.rng = random.Random(seed)
        self.roles = roles
        self.kills: list[Kill] = []
        self._start = time.monotonic()

    async def run(self, sup: Supervisor) -> None:
        """Once every actor is up, kill on schedule until the trainer has finished, and
        stamp the victims' returns until cancelled (the job's end cancels it)."""
        try:
            await sup.wait_until(lambda _: sup.up)
        except ActorDied:
            return  # the job failed before it was up: nothing to kill
        self._start = time.monotonic()
        async with asyncio.TaskGroup() as tg:
            # The watcher runs until the job cancels us: the block waits for it.
            tg.create_task(self._watch_back(sup), name="chaos.back")
            if self.duration is not None:
                tg.create_task(self._end_after(sup), name="chaos.end")
            await self._kill_on_schedule(sup)
            if self.stop_when_back:
                await self._until_all_back(sup)
                await self._stop_trainer(sup, "every victim is back")

    async def _kill_on_schedule(self, sup: Supervisor) -> None:
        for kill in self.schedule:
            await self._until_due(sup, kill)
            await self._kill(sup, kill.target, kill.signal)
        while self.every is not None and not self._ending(sup):
            await asyncio.sleep(self.every)
            await self._kill(sup, "random")

    def _ending(self, sup: Supervisor) -> bool:
        over = self.duration is not None and self._elapsed() >= self.duration
        return over or _trainer_finished(sup)

    async def _end_after(self, sup: Supervisor) -> None:
        await asyncio.sleep(self.duration or 0.0)
        await self._stop_trainer(sup, f"{self.duration} s reached")

    async def _until_all_back(self, sup: Supervisor) -> None:
        while True:  # _watch_back stamps the returns
            if self._ending(sup) or all(k.back_s is not None for k in self.kills):
                return
            await asyncio.sleep(_POLL_S)

    async def _stop_trainer(self, sup: Supervisor, why: str) -> None:
        """Tell the trainer to stop (again while it is restarting) unless it finished."""
        log.warning("chaos: stopping the trainer", why=why)
        while not _trainer_finished(sup):
            with contextlib.suppress(PeerLost, RemoteError, TimeoutError):
                async with asyncio.timeout(10.0):
                    await sup.control.command("trainer", Command(kind="stop"))
                return
            await asyncio.sleep(1.0)

    def _elapsed(self) -> float:
        return time.monotonic() - self._start

    async def _until_due(self, sup: Supervisor, kill: KillAt) -> None:
        while True:
            if kill.seconds is not None and self._elapsed() >= kill.seconds:
                return
            if kill.step is not None and _trainer_version(sup) >= kill.step:
                return
            await asyncio.sleep(_POLL_S)

    async def _kill(self, sup: Supervisor, target: str, sig: str = "SIGKILL") -> None:
        """Wait until the job is calm (the last victim is back, no restart under way) and
        ``target`` resolves to a running actor; send it ``sig``."""
        while True:
            if self._ending(sup):
                return  # the job is ending: a kill now tests nothing
            calm = not sup.restarting and all(k.back_s is not None for k in self.kills)
            victim = self._victim(sup, target) if calm else None
            if victim is not None:
                break
            await asyncio.sleep(_POLL_S)
        handle = sup.handles[victim]
        kill = Kill(victim, handle.pid, round(self._elapsed(), 2), _trainer_version(sup), None, sig)
        self.kills.append(kill)
        log.warning(f"chaos: {sig}", actor=victim, pid=handle.pid, step=kill.step)
        if sig == "SIGKILL":
            sup.runtime.kill(handle)
        elif handle.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(handle.pid, signal.Signals[sig])

    def _victim(self, sup: Supervisor, target: str) -> str | None:
        running = [
            name
            for name, st in sup.status.items()
            if st.hello and sup.handles[name].exit_code is None and st.state == "running"
        ]
        if target in sup.status:
            return target if target in running else None
        roles = self.roles if target == "random" else (target,)
        pool = sorted(n for n in running if sup.status[n].role in roles)
        return self.rng.choice(pool) if pool else None

    async def _watch_back(self, sup: Supervisor) -> None:
        """Stamp each kill with the time its victim was running again."""
        while True:
            for kill in self.kills:
                if kill.back_s is None:
                    st, handle = sup.status[kill.actor], sup.handles[kill.actor]
                    if handle.pid != kill.pid and st.hello and st.state in _BACK:
                        kill.back_s = round(self._elapsed(), 2)
            await asyncio.sleep(_POLL_S)


def _due_order(kill: KillAt) -> tuple[bool, float]:
    return (kill.step is not None, kill.seconds if kill.seconds is not None else kill.step or 0)


def _trainer_finished(sup: Supervisor) -> bool:
    st = sup.status.get("trainer")
    return st is not None and st.state == "finished"


def _trainer_version(sup: Supervisor) -> int:
    st = sup.status.get("trainer")
    return st.version if st is not None else 0


@dataclasses.dataclass
class Audit:
    """What ``audit_run`` found; ``ok`` when nothing was lost or repeated."""

    admitted: int
    consumed: int
    in_flight: int
    partial: int
    buffered: int
    filtered: int
    failed: int
    lost: int  # admitted but in no state of the ledger
    duplicated: int  # groups trained in two different batches
    untrained: int  # consumed groups neither trained nor held for the trainer
    held: int  # consumed groups in batches the trainer has not acknowledged (served again)
    batches_trained: int  # distinct batches that made a version
    final_version: int
    expected_version: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        """Nothing lost, nothing repeated, the step count right."""
        return not self.problems


def audit_run(run_dir: Path, expected_version: int) -> Audit:
    """Check a finished run's accounting: the buffer's ledger adds up (``lost``: admitted
    minus everything accounted for); ``trained.jsonl`` (the trainer's audit log, one row
    per batch with its group uids) has no group in two batches (``duplicated``) and every
    consumed group trained or held for the trainer (``untrained``); as many batches made
    a version as the final version says, and it is ``expected_version``."""
    row = _last_row(run_dir / "metrics" / "buffer.jsonl")
    counts = {
        k: int(row.get(f"buffer.{k}", 0))
        for k in ("admitted", "consumed", "in_flight", "partial", "buffered")
    }
    filtered = int(sum(v for k, v in row.items() if k.startswith("buffer.filtered.")))
    failed = int(sum(v for k, v in row.items() if k.startswith("buffer.failed.")))
    live = counts["in_flight"] + counts["partial"] + counts["buffered"]
    lost = counts["admitted"] - (live + counts["consumed"] + filtered + failed)
    batches, trained_versions, changed = _trained(run_dir / "trained.jsonl")
    owners: dict[str, set[int]] = defaultdict(set)
    for batch_id, groups in batches.items():
        for uid in groups:
            owners[uid].add(batch_id)
    duplicated = sum(1 for ids in owners.values() if len(ids) > 1)
    # Taken by the trainer and not acknowledged at the end (a stop mid-step): the buffer
    # keeps them and serves them again when the run resumes; some may be trained already.
    held = int(row.get("buffer.unacked_groups", 0))
    held_trained = sum(
        len(batches[i]) for i in row.get("buffer.unacked_batch_ids", ()) if i in batches
    )
    untrained = counts["consumed"] - (len(owners) + held - held_trained)
    final = _last_step(run_dir / "metrics.jsonl")
    problems = _problems(lost, duplicated, untrained, final, expected_version, batches)
    if batches and len(trained_versions) != final:
        problems.append(f"{len(trained_versions)} batches made a version, yet it is {final}")
    if changed:
        problems.append(f"batches {sorted(changed)} were served again with other groups")
    return Audit(
        **counts,
        filtered=filtered,
        failed=failed,
        lost=lost,
        duplicated=duplicated,
        untrained=untrained,
        held=held,
        batches_trained=len(trained_versions),
        final_version=final,
        expected_version=expected_version,
        problems=problems,
    )


def _problems(
    lost: int,
    duplicated: int,
    untrained: int,
    final: int,
    expected: int,
    batches: dict[int, list[str]],
) -> list[str]:
    out = []
    if lost:
        out.append(f"{lost} admitted groups are in no state of the ledger")
    if duplicated:
        out.append(f"{duplicated} groups were trained in two different batches")
    if untrained:
        out.append(f"{untrained} consumed groups were neither trained nor kept for it")
    if not batches:
        out.append("the trainer's audit log (trained.jsonl) is empty or missing")
    if expected and final != expected:
        out.append(f"the final version is {final}, not {expected}")
    return out


def _trained(path: Path) -> tuple[dict[int, list[str]], set[int], set[int]]:
    """Batch id -> its groups, the ids of batches that made a version, and the ids of
    batches trained again with other groups (a batch served again must be the same)."""
    batches: dict[int, list[str]] = {}
    made_version: set[int] = set()
    changed: set[int] = set()
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        row = json.loads(line)
        batch_id = int(row["batch"])
        if batches.setdefault(batch_id, list(row["groups"])) != row["groups"]:
            changed.add(batch_id)
        if row.get("trained", True):
            made_version.add(batch_id)
    return batches, made_version, changed


def _last_row(path: Path) -> dict[str, float]:
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1]) if lines else {}


def _last_step(path: Path) -> int:
    return int(_last_row(path).get("step", 0))


def chaos_report(result: JobResult, chaos: Chaos, audit: Audit) -> dict[str, Any]:
    """The run, its kills and the audit as one JSON-able record."""
    return {
        "ok": result.ok and audit.ok,
        "job": {
            "ok": result.ok,
            "error": result.error,
            "seconds": round(result.seconds, 1),
            "steps": result.steps,
        },
        "kills": [dataclasses.asdict(k) for k in chaos.kills],
        "restarts": result.restarts,
        "audit": {**dataclasses.asdict(audit), "ok": audit.ok},
    }


def print_report(console: Any, report: dict[str, Any]) -> None:
    """The report as tables, for people."""
    from rich.table import Table

    kills = Table("victim", "pid", "killed at s", "trainer step", "back at s", title="kills")
    for k in report["kills"]:
        back = "never" if k["back_s"] is None else f"{k['back_s']:.1f}"
        kills.add_row(k["actor"], str(k["pid"]), f"{k['at_s']:.1f}", str(k["step"]), back)
    console.print(kills)
    a = report["audit"]
    audit = Table(
        "admitted",
        "consumed",
        "filtered",
        "failed",
        "waiting",
        "lost",
        "duplicated",
        "untrained",
        "final version",
        title="accounting",
    )
    waiting = a["in_flight"] + a["partial"] + a["buffered"]
    counts = [a[k] for k in ("admitted", "consumed", "filtered", "failed")]
    counts += [waiting, a["lost"], a["duplicated"], a["untrained"]]
    audit.add_row(*map(str, counts), f"{a['final_version']}/{a['expected_version']}")
    console.print(audit)
    verdict = "[green]chaos ok[/green]" if report["ok"] else "[red]chaos failed[/red]"
    problems = "; ".join(a["problems"]) or report["job"]["error"]
    console.print(
        f"{verdict}: {len(report['kills'])} kills, {len(report['restarts'])} restarts"
        + (f"; {problems}" if problems else "")
    )
