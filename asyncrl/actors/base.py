"""The actor lifecycle every asyncrl process follows: start, run, drain, stop.

    setup()                       open channels (``await self.open(channel, "name")``)
    run()   | heartbeats          the actor's work, beside a heartbeat loop and a
            | commands            command loop on the control channel
    drain()                       on stop (command, SIGTERM, SIGINT): take no new work,
                                  finish in-flight work, bounded by ``drain_timeout``
    teardown()                    then every opened channel is closed (LIFO)

``Actor.main()`` runs it all under one ``asyncio.TaskGroup``: a task that raises cancels
the others, sends ``Bye(ok=False, reason=...)`` and exits 1; a ``run()`` that returns
exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import msgspec

from asyncrl.actors.config import ActorConfig
from asyncrl.cores import LentThreads
from asyncrl.errors import InputError, disk_refused
from asyncrl.observe.logs import bind_context, get_logger
from asyncrl.observe.metrics import JsonlMetricsSink
from asyncrl.wire.channels import _Channel
from asyncrl.wire.config import WireConfig
from asyncrl.wire.control import BYE_LINGER_MS, ControlLink
from asyncrl.wire.messages import (
    ActorStateName,
    Bye,
    Command,
    CommandResult,
    Heartbeat,
    Hello,
    Scalar,
)

C = TypeVar("C", bound=_Channel)
R = TypeVar("R", bound=contextlib.AbstractAsyncContextManager[Any])
log = get_logger("asyncrl.actor")
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Seconds past ``drain_timeout`` a stopping child process may take before it is ended.
EXIT_GRACE_S = 10.0
#: Commands every actor answers at once, even while its setup still runs.
_ANYTIME = ("stop", "pause", "resume", "stats")


#: A trainer's heartbeat stat: the version of its newest complete checkpoint (-1: none).
#: The supervisor's restart hooks read it to know whether a restart must find one.
CHECKPOINTED_STAT = "checkpointed_version"


class Incarnation(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How this start of an actor comes about; the supervisor's restart hooks set it
    (``runtime/recovery.py``)."""

    restarted: bool = False  # the supervisor restarted it after a crash
    #: An earlier incarnation wrote durable state (a checkpoint, a journal): a restart
    #: that finds none must fail loudly instead of starting over.
    state_expected: bool = False


class ActorSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything a process needs to become an actor. Sent to the child as JSON."""

    name: str
    role: str
    cls: str  # "package.module:ClassName"
    control: str | None = None  # the controller's ControlServer endpoint
    endpoints: dict[str, str] = msgspec.field(default_factory=dict)  # channel -> address
    heartbeat_interval: float = 1.0
    drain_timeout: float = 10.0
    log_level: str = "info"
    log_format: str = "console"
    log_file: str | None = None
    wire: dict[str, Any] = msgspec.field(default_factory=dict)  # the job's ``WireConfig``
    params: dict[str, Any] = msgspec.field(default_factory=dict)  # the role's ``Config``
    incarnation: Incarnation = msgspec.field(default_factory=Incarnation)
    threads: int | None = None  # torch/OpenMP threads of this process; None: the library's
    # The local trainer's busy mark (``cores.py``): the trainer writes it, and an
    # embedded CPU engine runs on ``idle_trainer_threads`` while it is clear.
    busy_mark: str | None = None
    idle_trainer_threads: int | None = None


class Actor(ABC):
    """Base class: subclass, implement ``run()``, optionally the other hooks."""

    #: The role's settings; ``self.config`` is ``spec.params`` validated as one of these.
    Config: ClassVar[type[ActorConfig]] = ActorConfig

    def __init__(self, spec: ActorSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.config = self.Config.model_validate(spec.params)
        self.wire = WireConfig.model_validate(spec.wire)
        self.state: ActorStateName = "starting"
        self.link: ControlLink | None = None
        self.paused = asyncio.Event()
        self._version = 0
        bind_context(version=0)
        self._stop = asyncio.Event()
        self._set_up = asyncio.Event()  # setup() finished: the actor's own commands may run
        self._stop_reason = ""
        self._channels: dict[str, _Channel] = {}
        self._stack = contextlib.AsyncExitStack()
        self._loop_lag = 0.0
        #: Set by the child process (``runtime/child.py``): after SIGTERM or SIGINT the
        #: process ends within ``drain_timeout + EXIT_GRACE_S`` even if a worker thread is
        #: busy (in set-up, say) and would hold the interpreter's exit.
        self.exit_watchdog = False
        self._watchdog: threading.Timer | None = None
        self._exit_code: int | None = None  # what main() returned, once it has
        self._signalled = ""  # the signal that stopped it, when no stop was asked before

    # -- hooks for subclasses -------------------------------------------------------
    async def setup(self) -> None:  # noqa: B027 - optional hook
        """Open channels and load state. Runs before ``run()``."""

    @abstractmethod
    async def run(self) -> None:
        """The actor's work. Check ``self.stopping`` to stop taking new work."""

    async def drain(self) -> None:  # noqa: B027 - optional hook
        """Finish in-flight work after a stop request (bounded by ``drain_timeout``)."""

    async def teardown(self) -> None:  # noqa: B027 - optional hook
        """Release resources; runs after ``run()`` has ended, even on failure."""

    def stats(self) -> dict[str, float]:
        """Actor-specific numbers for heartbeats (channel stats are added by the base)."""
        return {}

    async def on_command(self, cmd: Command) -> dict[str, Scalar]:
        """Handle ``cmd``; override to add kinds, call ``super()`` for the rest."""
        if cmd.kind == "stop":
            self.request_stop("stop command")
        elif cmd.kind == "pause":
            self.paused.set()
        elif cmd.kind == "resume":
            self.paused.clear()
        elif cmd.kind == "stats":
            return dict(self.all_stats())
        return {"pid": os.getpid(), "state": self.state}

    # -- services for subclasses ----------------------------------------------------
    async def open(self, channel: C, name: str) -> C:
        """Enter ``channel``; it is closed after ``teardown()``, and its stats are reported."""
        if name in self._channels:
            raise ValueError(f"channel name {name!r} already used by {self.name}")
        await self._stack.enter_async_context(channel)
        self._channels[name] = channel
        return channel

    @property
    def stopping(self) -> bool:
        """True once a stop was requested: take no new work."""
        return self._stop.is_set()

    async def wait_stopping(self) -> None:
        """Return when a stop is requested."""
        await self._stop.wait()

    def request_stop(self, reason: str) -> None:
        """Ask the actor to drain and stop (idempotent)."""
        if not self._stop.is_set():
            self._stop_reason = reason
            log.info("stop requested", reason=reason)
            self._stop.set()

    def _on_signal(self, sig: signal.Signals) -> None:
        """A signal's stop, the one no supervisor may follow up on (an orphan's parent
        death signal, a user's kill): with ``exit_watchdog`` it ends the process in bounded
        time. A stop the actor asks for itself (a trainer's last step) is never cut short:
        its final checkpoint may take longer. Under a supervisor, a signal that comes before
        any stop was asked for is a fault (``_signal_fault``): the controller stops its
        actors by command first."""
        if not self._stop.is_set() and not _asked_to_stop(self.spec):
            self._signalled = sig.name
        self.request_stop(sig.name)
        if self.exit_watchdog and self._watchdog is None:
            self._arm_watchdog()

    def _arm_watchdog(self) -> None:
        limit = self.spec.drain_timeout + EXIT_GRACE_S

        def overdue() -> None:
            code = self._exit_code
            log.error("stop overran its time: exiting now", seconds=limit, state=self.state)
            os._exit(1 if code is None else code)

        self._watchdog = threading.Timer(limit, overdue)
        self._watchdog.daemon = True
        self._watchdog.start()

    @property
    def version(self) -> int:
        """The weight version this actor holds; bound into every log line."""
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        self._version = value
        bind_context(version=value)

    async def hold(self, resource: R) -> R:
        """Enter ``resource`` (an async context manager: engines, clients); it is closed
        after ``teardown()``, in reverse order with the channels."""
        return await self._stack.enter_async_context(resource)

    def close_later(self, close: Callable[[], object]) -> None:
        """Call ``close()`` after ``teardown()``, after the channels opened from now on are
        closed (no request handler can run by then)."""
        self._stack.callback(close)

    def lent_threads(self) -> LentThreads | None:
        """The threads this actor's embedded CPU engine runs on while the local trainer
        waits (``cores.py``); None where the job lends it none."""
        s = self.spec
        if s.busy_mark is None or s.idle_trainer_threads is None or s.threads is None:
            return None
        lent = LentThreads(Path(s.busy_mark), own=s.threads, idle=s.idle_trainer_threads)
        self.close_later(lent.close)
        return lent

    def open_metrics(self, path: str | Path, *, flush_every: float = 1.0) -> JsonlMetricsSink:
        """A JSONL metrics sink at ``path``, flushed and closed after ``teardown()``."""
        sink = JsonlMetricsSink(path, flush_every=flush_every)
        self._stack.callback(sink.close)
        return sink

    @property
    def max_frame_bytes(self) -> int:
        """The job's frame limit (``wire.max_frame_bytes``) for this actor's codecs."""
        return self.wire.max_frame_bytes

    def all_stats(self) -> dict[str, float]:
        """Actor stats plus ``<channel>.<counter>`` for every opened channel."""
        out = {"loop_lag_ms": self._loop_lag * 1000.0}
        for name, channel in self._channels.items():
            out.update({f"{name}.{k}": float(v) for k, v in channel.stats.snapshot().items()})
        out.update(self.stats())
        return out

    # -- lifecycle ------------------------------------------------------------------
    async def main(self) -> int:
        """Run the whole lifecycle; returns the process exit code (0 ok, 1 failed)."""
        loop = asyncio.get_running_loop()
        # In a Ray worker the loop runs off the main thread, where no handler can be set:
        # the runtime stops the actor through a method call instead.
        signals = _SIGNALS if threading.current_thread() is threading.main_thread() else ()
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        ok, reason, said_bye = True, "stopped", False
        try:
            async with self._stack:
                try:
                    await self._with_control()
                except* Exception as group:
                    ok, reason = False, self._failed(group)
                if ok and self._signalled and self.spec.control:
                    ok, reason = False, self._signal_fault()
                said_bye = self._say_bye(ok, reason)
        except* Exception as group:  # a channel failed, or failed to close
            ok, reason = False, self._failed(group)
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
        if not said_bye and self.spec.control:
            with contextlib.suppress(Exception):
                _send_bye(self.spec.control, self.name, self._bye(ok, reason))
        log.info("actor exiting", ok=ok, reason=reason)
        # The watchdog stays armed: the interpreter's exit waits for busy worker threads.
        self._exit_code = 0 if ok else 1
        return self._exit_code

    def _signal_fault(self) -> str:
        """A stop by a signal nobody in the job sent (a user's kill, an OOM killer's
        warning, a process manager): the actor did not finish its work, so the supervisor
        must restart it or fail the job, never count it done."""
        reason = f"stopped by {self._signalled}, which the controller did not send"
        log.error("stopped by a signal", signal=self._signalled)
        return reason

    def _failed(self, group: BaseException) -> str:
        self._permanent = is_permanent(group)
        self.state = "failed"
        reason = _describe(group)
        log.error("actor failed", error=reason, permanent=self._permanent, exc_info=group)
        return reason

    async def _with_control(self) -> None:
        if self.spec.control:
            self.link = await self.open(ControlLink(self.spec.control, self.name), "control")
            self.link.notify(
                Hello(
                    actor=self.name,
                    role=self.spec.role,
                    pid=os.getpid(),
                    host=socket.gethostname(),
                    endpoints=self.spec.endpoints,
                )
            )
        async with asyncio.TaskGroup() as tg:
            helpers = [tg.create_task(self._heartbeats(), name=f"{self.name}.heartbeats")]
            if self.link is not None:
                helpers.append(tg.create_task(self._commands(), name=f"{self.name}.commands"))
            try:
                await self._lifecycle()
            finally:
                for task in helpers:
                    task.cancel()

    async def _lifecycle(self) -> None:
        log.info("actor starting", role=self.spec.role)
        try:
            await self.setup()
            self._set_up.set()
            # Everything alive now (imports, setup) is permanent: keep it out of every
            # later collection, which would otherwise rescan it on each full GC pass.
            gc.freeze()
            self.state = "running"
            log.info("actor running")
            await self._run_until_stopped()
            self.state = "stopped"
        finally:
            await self.teardown()

    async def _run_until_stopped(self) -> None:
        async with asyncio.TaskGroup() as tg:
            work = tg.create_task(self.run(), name=f"{self.name}.run")
            stop = tg.create_task(self._stop.wait(), name=f"{self.name}.stop")
            await asyncio.wait([work, stop], return_when=asyncio.FIRST_COMPLETED)
            # A stop request always drains, even if run() noticed it and returned first.
            if self._stop.is_set():
                await self._drain()
            work.cancel()
            stop.cancel()

    async def _drain(self) -> None:
        self.state = "draining"
        log.info("draining", reason=self._stop_reason)
        try:
            async with asyncio.timeout(self.spec.drain_timeout):
                await self.drain()
        except TimeoutError:
            log.warning("drain timed out; cancelling", timeout=self.spec.drain_timeout)

    async def _heartbeats(self) -> None:
        seq, interval = 0, self.spec.heartbeat_interval
        while True:
            if self.link is not None:
                self.link.notify(
                    Heartbeat(
                        actor=self.name,
                        pid=os.getpid(),
                        seq=seq,
                        state=self.state,
                        version=self._version,
                        stats=self.all_stats(),
                    )
                )
            seq += 1
            start = time.monotonic()
            await asyncio.sleep(interval)
            # How late the loop woke us: a blocked event loop shows up here first.
            self._loop_lag = max(0.0, time.monotonic() - start - interval)

    async def _commands(self) -> None:
        """Answer commands: the built-in ones (stop, stats...) at once, in order; an
        actor's own each in a task of its own, once setup is done, so a slow one (a
        requeue during a long recovery) never holds up a stop."""
        assert self.link is not None
        async with asyncio.TaskGroup() as tg:
            while True:
                command_id, cmd = await self.link.next_command()
                if cmd.kind in _ANYTIME:
                    await self._answer(command_id, cmd)
                else:
                    tg.create_task(
                        self._answer(command_id, cmd, wait_setup=True),
                        name=f"{self.name}.command.{cmd.kind}",
                    )

    async def _answer(self, command_id: int, cmd: Command, *, wait_setup: bool = False) -> None:
        assert self.link is not None
        try:
            if wait_setup:
                await self._set_up.wait()
            data = await self.on_command(cmd)
            self.link.reply(command_id, CommandResult(ok=True, data=data))
        except Exception as exc:
            self.link.reply(command_id, CommandResult(ok=False, error=_describe(exc)))

    def _bye(self, ok: bool, reason: str) -> Bye:
        permanent = not ok and getattr(self, "_permanent", False)
        return Bye(actor=self.name, pid=os.getpid(), reason=reason, ok=ok, permanent=permanent)

    def _say_bye(self, ok: bool, reason: str) -> bool:
        """Tell the controller why we exit, through the still-open link."""
        return self.link is not None and self.link.notify(self._bye(ok, reason))


def stop_marker(spec: ActorSpec, pid: int) -> Path | None:
    """The file a runtime writes before it signals the actor of ``spec`` (process
    ``pid``) to stop: that signal was asked for, not a fault. None without a log file."""
    return Path(f"{spec.log_file}.stopping-{pid}") if spec.log_file else None


def _asked_to_stop(spec: ActorSpec) -> bool:
    """The runtime's stop (``stop_marker``), or an actor no supervisor watches, which a
    signal stops as usual; the marker is consumed."""
    marker = stop_marker(spec, os.getpid())
    if marker is None or not spec.control:
        return True
    try:
        marker.unlink()
    except OSError:
        return False
    return True


def _send_bye(endpoint: str, actor: str, bye: Bye) -> None:
    """Fallback when the link is already closed: a one-shot socket with the same identity."""
    import zmq

    from asyncrl.wire import framing
    from asyncrl.wire.codec import WIRE_VERSION, Codec

    body, _ = Codec(Bye).encode_parts(bye)
    env = framing.Request(v=WIRE_VERSION, id=0, nbuf=0, body=msgspec.Raw(body))
    from asyncrl.wire import security
    from asyncrl.wire.sockets import term_sent

    ctx = zmq.Context()  # its own: terminating it waits for the goodbye to leave
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, actor.encode())
    if (keys := security.active()) is not None:
        keys.client(sock)
    sock.connect(endpoint)
    sock.send(framing.pack(env))
    sock.close(linger=BYE_LINGER_MS)
    term_sent(ctx)


def is_permanent(exc: BaseException) -> bool:
    """True when restarting would fail the same way: an ``InputError`` (bad data, config
    or user code; ``asyncrl/errors.py``) or a write the disk refused, among the errors or
    their causes."""
    return any(_is_input_error(e) for e in _exceptions(exc))


def _is_input_error(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 8:  # the cause chain (a wrapped InputError counts)
        if isinstance(exc, InputError):
            return True
        if disk_refused(exc):
            return True
        context = None if exc.__suppress_context__ else exc.__context__
        exc, seen = exc.__cause__ or context, seen + 1
    return False


def _exceptions(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from _exceptions(e)
    else:
        yield exc


def _describe(exc: BaseException) -> str:
    """One line per distinct error: a group of 96 identical failures (every request to a
    dead engine) reads as one, with its count."""
    counts: dict[str, int] = {}
    for text in _leaves(exc):
        counts[text] = counts.get(text, 0) + 1
    return "; ".join(t if n == 1 else f"{t} (x{n})" for t, n in counts.items())


def _leaves(exc: BaseException) -> list[str]:
    if isinstance(exc, BaseExceptionGroup):
        return [text for e in exc.exceptions for text in _leaves(e)]
    return [f"{type(exc).__name__}: {exc}"]
