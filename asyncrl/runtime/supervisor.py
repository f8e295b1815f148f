"""The supervisor: starts actors through a runtime and watches them over the control server.

It knows each actor from its notifications (``Hello``, ``Heartbeat``, ``Bye``) and its
process exit, and turns trouble into one exception with the evidence (``ActorDied``,
``ActorHung``: exit code, ``Bye`` reason, last log lines). ``wait_until`` raises the first
such failure, so a controller that waits for progress never waits on a dead actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType

import msgspec

from asyncrl.actors.base import ActorSpec
from asyncrl.observe.logs import get_logger
from asyncrl.runtime.base import ActorHandle, Runtime
from asyncrl.wire.control import ControlServer
from asyncrl.wire.errors import PeerLost, RemoteError
from asyncrl.wire.messages import Bye, Command, Heartbeat, Hello

log = get_logger("asyncrl.supervisor")


#: Polls of 0.1 s for the Bye of an actor that exited with code 0 (5 s in all): on a
#: loaded machine the Bye can be read seconds after the exit, which without it is a death.
_BYE_GRACE_POLLS = 50


@dataclasses.dataclass
class ActorStatus:
    """What the supervisor knows about one actor."""

    name: str
    role: str
    pid: int | None = None
    state: str = "launched"
    version: int = 0
    heartbeats: int = 0
    last_seen: float = dataclasses.field(default_factory=time.monotonic)
    stats: dict[str, float] = dataclasses.field(default_factory=dict)
    exit_code: int | None = None
    bye: Bye | None = None
    hello: bool = False
    restarts: int = 0
    hung: str = ""  # why the liveness check killed it (to restart with that reason)
    ran: bool = False  # this incarnation reported "running" (its setup finished)


class ActorDied(RuntimeError):
    """An actor exited while the job needed it."""

    def __init__(self, name: str, exit_code: int | None, reason: str, tail: Sequence[str]):
        self.name, self.exit_code, self.reason, self.tail = name, exit_code, reason, list(tail)
        lines = "\n".join(f"    {line}" for line in self.tail) or "    (no output)"
        super().__init__(
            f"actor {name} exited with code {exit_code} ({reason}); last log lines:\n{lines}"
        )


class ActorHung(ActorDied):
    """An actor stopped sending heartbeats."""


class Supervisor:
    """Launch, watch and stop a set of actors. Use as ``async with Supervisor(...)``.

    ``restarts``: role -> most restarts per actor. Within it a death or hang is kept in
    ``deaths``, ``before_restart(spec, status)`` may return the spec to start instead, the
    actor starts again on the same endpoints and must say Hello within ``startup_timeout``,
    then ``after_restart(spec)`` runs. Past the budget, or at once when its ``Bye`` says
    ``permanent``, a death fails the job. An actor being stopped (``stop``, ``stop_all``,
    ``wind_down``) is neither restarted nor a failure when it dies.
    """

    def __init__(
        self,
        runtime: Runtime,
        control: ControlServer,
        *,
        heartbeat_timeout: float = 10.0,
        startup_timeout: float = 120.0,
        restarts: Mapping[str, int] | None = None,
        before_restart: Callable[[ActorSpec, ActorStatus], Awaitable[ActorSpec | None]]
        | None = None,
        after_restart: Callable[[ActorSpec], Awaitable[None]] | None = None,
    ) -> None:
        self.runtime, self.control = runtime, control
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_timeout = startup_timeout
        self.restarts = dict(restarts or {})
        self.before_restart = before_restart
        self.after_restart = after_restart
        self.status: dict[str, ActorStatus] = {}
        self.handles: dict[str, ActorHandle] = {}
        self.specs: dict[str, ActorSpec] = {}
        self.deaths: list[ActorDied] = []  # deaths survived by a restart, oldest first
        self._restarting: dict[str, asyncio.Task[None]] = {}  # actor -> its exit watcher
        self.failure: ActorDied | None = None
        self.up = False  # every launched actor said Hello
        self._changed = asyncio.Event()
        self._stopping = False  # stop_all(): every actor is being stopped
        self._stopped: set[str] = set()  # stop(names): these actors are being stopped
        self._tg = asyncio.TaskGroup()

    async def __aenter__(self) -> Supervisor:
        await self._tg.__aenter__()
        self._tasks = [
            self._tg.create_task(self._notifications(), name="supervisor.notifications"),
            self._tg.create_task(self._liveness(), name="supervisor.liveness"),
        ]
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        if not self._stopping:
            with contextlib.suppress(Exception):
                await self.stop_all(grace=5.0)
        for task in self._tasks:
            task.cancel()
        return await self._tg.__aexit__(et, exc, tb)

    @property
    def restarting(self) -> bool:
        """True while some actor's restart is under way."""
        return bool(self._restarting)

    # -- launching ------------------------------------------------------------------
    async def launch(self, specs: Sequence[ActorSpec]) -> None:
        """Start every actor and wait until each has said Hello.

        Each spec's ``control`` is set to this supervisor's control server.
        """
        specs = [msgspec.structs.replace(s, control=self.control.endpoint) for s in specs]
        for spec in specs:
            if spec.name in self.status:
                raise ValueError(f"actor name {spec.name!r} used twice")
            self.status[spec.name] = ActorStatus(spec.name, spec.role)
            self.specs[spec.name] = spec
            handle = await self.runtime.start(spec)
            self.handles[spec.name] = handle
            self.status[spec.name].pid = handle.pid
            self._tg.create_task(self._watch_exit(handle), name=f"supervisor.exit.{spec.name}")
        names = [s.name for s in specs]
        try:
            async with asyncio.timeout(self.startup_timeout):
                await self.wait_until(lambda st: all(st[n].hello for n in names))
        except TimeoutError:
            late = [n for n in names if not self.status[n].hello]
            raise TimeoutError(
                f"actors {late} did not start within {self.startup_timeout}s"
            ) from None
        log.info("actors up", actors=names)
        self.up = True
        self._changed.set()

    # -- waiting --------------------------------------------------------------------
    async def wait_until(self, predicate: Callable[[dict[str, ActorStatus]], bool]) -> None:
        """Wait until ``predicate(status)`` holds; raises the first actor failure."""
        while True:
            if self.failure is not None:
                raise self.failure
            if predicate(self.status):
                return
            self._changed.clear()
            await self._changed.wait()

    def _fail(self, failure: ActorDied) -> None:
        if self.failure is None and not self._winding_down(failure.name):
            log.error(
                "actor lost", actor=failure.name, exit_code=failure.exit_code, reason=failure.reason
            )
            self.failure = failure
        self._changed.set()

    # -- stopping -------------------------------------------------------------------
    async def stop_all(self, grace: float = 10.0) -> dict[str, int | None]:
        """Stop every actor: stop command, then SIGTERM, then SIGKILL. Returns exit codes.

        Each step gives the actor ``grace`` seconds.
        """
        self._stopping = True
        await self._settle_restarts(grace)
        alive = [n for n, h in self.handles.items() if h.exit_code is None]
        async with asyncio.TaskGroup() as tg:
            for name in alive:
                tg.create_task(self._stop_one(name, grace), name=f"supervisor.stop.{name}")
        return {n: h.exit_code for n, h in self.handles.items()}

    def wind_down(self) -> None:
        """The job is ending early (Ctrl-C, or SIGTERM to the whole process group, as
        systemd and SLURM send it): from now on no death is restarted or a failure, and an
        actor that took the same signal for a fault is not restarted for it."""
        self._stopping = True
        self._changed.set()

    async def stop(self, names: Sequence[str], grace: float = 10.0) -> None:
        """Stop these actors (together) and wait for them; the job goes on without them.

        Used to stop producers before the buffer they talk to, so their last work lands.
        """
        self._stopped.update(names)
        await self._settle_restarts(grace, names)
        async with asyncio.TaskGroup() as tg:
            for name in names:
                handle = self.handles.get(name)  # none: a launch interrupted before it
                if handle is not None and handle.exit_code is None:
                    tg.create_task(self._stop_one(name, grace), name=f"supervisor.stop.{name}")

    def _winding_down(self, name: str) -> bool:
        """True once ``name`` is being stopped: its death is no failure, nor restarted."""
        return self._stopping or name in self._stopped

    async def _settle_restarts(self, grace: float, names: Sequence[str] | None = None) -> None:
        """Let the restarts under way of ``names`` (default all) give up (they check
        ``_winding_down``) for up to ``grace`` seconds, then cancel the rest, so that a
        stop sees every incarnation there is."""

        def settling() -> list[asyncio.Task[None]]:
            return [t for n, t in self._restarting.items() if names is None or n in names]

        self._changed.set()
        try:
            async with asyncio.timeout(grace):
                await self._until(lambda: not settling())
        except TimeoutError:
            tasks = settling()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stop_one(self, name: str, grace: float) -> None:
        handle = self.handles[name]
        if not self.status[name].hello:  # still starting (a restart): nobody to command yet
            await self.runtime.stop(handle, grace=grace)
            return
        with contextlib.suppress(PeerLost, RemoteError, TimeoutError):
            async with asyncio.timeout(min(grace, 5.0)):
                await self.control.command(name, Command(kind="stop"))
        try:
            async with asyncio.timeout(grace):
                await handle.wait()
        except TimeoutError:
            log.warning("actor ignored stop; terminating", actor=name)
            await self.runtime.stop(handle, grace=grace)

    # -- background -----------------------------------------------------------------
    async def _notifications(self) -> None:
        while True:
            actor, msg = await self.control.receive()
            st = self.status.get(actor)
            if st is None:
                log.warning("notification from unknown actor", actor=actor)
                continue
            st.last_seen = time.monotonic()
            if isinstance(msg, Hello):
                st.hello, st.pid = True, msg.pid
            elif isinstance(msg, Heartbeat):
                st.state, st.version, st.stats = msg.state, msg.version, msg.stats
                st.ran = st.ran or msg.state in ("running", "draining")
                st.heartbeats += 1
            elif isinstance(msg, Bye):
                st.bye, st.state = msg, "stopped" if msg.ok else "failed"
            self._changed.set()

    async def _watch_exit(self, handle: ActorHandle) -> None:
        code = await handle.wait()
        self._changed.set()  # a restart may be waiting on this incarnation
        self.control.abandon(handle.spec.name, f"exited ({code}) before it answered")
        st = self.status[handle.spec.name]
        if code == 0 and st.bye is None:
            # A clean exit can be seen before the goodbye sent just ahead of it has been
            # read off the control socket (Ray reports a worker's end by another path).
            for _ in range(_BYE_GRACE_POLLS):
                if st.bye is not None:
                    break
                await asyncio.sleep(0.1)
        st.exit_code = code
        if st.bye is None or st.state not in ("stopped", "failed"):
            st.state = "exited"
        reason = st.hung or (st.bye.reason if st.bye else handle.cause or signal_reason(code))
        if self._winding_down(handle.spec.name) and code != 0:
            log.warning(
                "actor stopped uncleanly", actor=handle.spec.name, exit_code=code, reason=reason
            )
        if code == 0 and st.bye is not None and st.bye.ok:
            # Finished its work (a trainer after its last step): done, not lost.
            st.state = "finished"
            log.info("actor finished", actor=handle.spec.name, reason=reason)
            self._changed.set()
            return
        death_cls = ActorHung if st.hung else ActorDied
        permanent = st.bye is not None and st.bye.permanent
        if permanent:
            reason += (
                " (an error of its input, code or disk that a restart would repeat: not restarted)"
            )
        death = death_cls(handle.spec.name, code, reason, handle.tail())
        if self._may_restart(st) and not permanent:
            await self._restart(handle.spec.name, death)
        else:
            self._fail(death)

    def _may_restart(self, st: ActorStatus) -> bool:
        return not self._winding_down(st.name) and st.restarts < self.restarts.get(st.role, 0)

    async def _restart(self, name: str, death: ActorDied) -> None:
        """Start ``name`` again after ``death`` (the restart policy: class docstring)."""
        st, spec = self.status[name], self.specs[name]
        st.restarts += 1
        self.deaths.append(death)
        log.warning(
            "actor died; restarting",
            actor=name,
            exit_code=death.exit_code,
            reason=death.reason,
            restart=st.restarts,
            budget=self.restarts.get(st.role, 0),
            last_lines=death.tail[-5:],
        )
        self._restarting[name] = asyncio.current_task()  # type: ignore[assignment]
        try:
            await self._start_again(name, spec, st)
        except Exception as exc:  # the restart itself failed: the job cannot go on
            text = str(exc) or "no detail"
            reason = f"{death.reason}; restart {st.restarts} failed: {type(exc).__name__}: {text}"
            self._fail(ActorDied(name, death.exit_code, reason, death.tail))
        finally:
            self._restarting.pop(name, None)
            self._changed.set()

    async def _start_again(self, name: str, spec: ActorSpec, st: ActorStatus) -> None:
        if self.before_restart is not None:
            spec = await self.before_restart(spec, st) or spec
            self.specs[name] = spec
        if self._winding_down(name):
            return  # it is being stopped: nothing to restart for
        st.hello, st.bye, st.hung, st.state, st.ran = False, None, "", "restarting", False
        st.exit_code, st.last_seen = None, time.monotonic()
        st.stats = {}  # the dead incarnation's; the new one's come with its heartbeats
        handle = await self.runtime.start(spec)
        self.handles[name], st.pid = handle, handle.pid
        self._tg.create_task(self._watch_exit(handle), name=f"supervisor.exit.{name}")
        try:
            async with asyncio.timeout(self.startup_timeout):
                await self._until(
                    lambda: st.hello or handle.exit_code is not None or self._winding_down(name)
                )
        except TimeoutError:
            self.runtime.kill(handle)
            raise TimeoutError(f"no Hello within {self.startup_timeout:.0f}s") from None
        if st.hello:
            log.info("actor restarted", actor=name, restart=st.restarts, pid=st.pid)
            if self.after_restart is not None:
                await self.after_restart(spec)
        # An incarnation that died starting is its own exit watcher's to handle; one still
        # starting when the job stops is stopped by stop()/stop_all(), which waited for us.

    async def _until(self, condition: Callable[[], bool]) -> None:
        """Wait until ``condition()`` holds (re-checked at every status change)."""
        while not condition():
            self._changed.clear()
            await self._changed.wait()

    async def _liveness(self) -> None:
        tick, last = self.heartbeat_timeout / 4, time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now, slept = time.monotonic(), time.monotonic() - last
            last = now
            if slept > tick + self.heartbeat_timeout / 2:
                # We did not run (SIGSTOP and fg, a suspended machine): the heartbeats that
                # wait unread are no silence of the actors. Give each a fresh window.
                log.warning(
                    "the controller was paused; actor silence is measured afresh",
                    seconds=round(slept - tick, 1),
                )
                for st in self.status.values():
                    st.last_seen = now
                continue
            for name, st in self.status.items():
                handle = self.handles.get(name)
                silent, limit = now - st.last_seen, self._silence_limit(st)
                if handle and handle.exit_code is None and st.hello and silent > limit:
                    while_ = " while setting up" if limit != self.heartbeat_timeout else ""
                    st.hung, st.hello = f"no heartbeat for {silent:.1f}s{while_}", False
                    if not self._may_restart(st):
                        self._fail(ActorHung(name, None, st.hung, handle.tail()))
                    self.runtime.kill(handle)  # its exit restarts it when the policy allows

    def _silence_limit(self, st: ActorStatus) -> float:
        """How long an actor may be silent: ``startup_timeout`` until it reports that
        its set-up is done (imports and a model load may hold its event loop for long on
        a loaded machine), ``heartbeat_timeout`` after."""
        if st.state in ("launched", "starting", "restarting"):
            return max(self.startup_timeout, self.heartbeat_timeout)
        return self.heartbeat_timeout


def signal_reason(code: int) -> str:
    """An exit code in words: 'killed by SIGKILL', 'exited'."""
    if code < 0:
        import signal

        return f"killed by {signal.Signals(-code).name}"
    return "exited without saying why" if code else "exited"
