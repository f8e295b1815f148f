"""Local runtime: every actor is a child process of the controller on this machine.

Each child (``python -m asyncrl.runtime.child``, forked from the zygote or exec'd) leads
a process group of its own: a stop or kill reaches whatever the actor started (an SGLang
server, compile workers), and a terminal's Ctrl-C reaches only the controller, which
stops the actors in order. Leaving the runtime's ``async with`` kills every group still
alive, so a job never leaves orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import msgspec

from asyncrl.actors.base import ActorSpec, stop_marker
from asyncrl.observe.logs import get_logger
from asyncrl.runtime.forks import (
    ForkedProcess,
    Zygote,
    ZygoteUnavailable,
    acquire_zygote,
    fork_actor,
    release_zygote,
)
from asyncrl.runtime.run_dir import LOCK_FD_ENV, lock_fds
from asyncrl.runtime.topology import allocate_endpoints, endpoint_names
from asyncrl.wire.sockets import release_endpoints

log = get_logger(__name__)

_LINE_LIMIT = 1024 * 1024
_DRAIN_OUTPUT_SECONDS = 2.0


class LocalActor:
    """A child process running one actor (implements ``runtime.base.ActorHandle``)."""

    def __init__(
        self, spec: ActorSpec, proc: asyncio.subprocess.Process | ForkedProcess, tail_lines: int
    ):
        self.spec = spec
        self.proc = proc
        self._tail: deque[str] = deque(maxlen=tail_lines)
        self._drained = asyncio.Event()
        self.pump_task: asyncio.Task[None] | None = None
        self.log_error = ""  # why <actor>.out stopped growing (a full disk), if it did

    @property
    def pid(self) -> int | None:
        """The child's pid."""
        return self.proc.pid

    @property
    def exit_code(self) -> int | None:
        """None while running; negative when killed by a signal."""
        return self.proc.returncode

    @property
    def cause(self) -> str | None:
        """Always None: a process's exit code (or signal) says how it ended."""
        return None

    async def wait(self) -> int:
        """Wait for exit and (briefly) for the last output lines to be read."""
        code = await self._exited()
        # Whatever the actor started and left behind is an orphan now: end it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        # A process the actor started may still hold the pipe open: do not wait on it.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_DRAIN_OUTPUT_SECONDS):
                await self._drained.wait()
        return code

    async def _exited(self) -> int:
        """The exit code once the process has exited. Not ``proc.wait()`` alone: on Python
        3.11 it returns only once the output pipe has closed too, and a daemon the actor
        started holds that pipe as long as it lives (torch's ``torch_shm_manager``, which
        the ``ipc`` transport starts, outlives the trainer in a session of its own)."""
        waiter = asyncio.ensure_future(self.proc.wait())
        try:
            while self.proc.returncode is None and not waiter.done():
                await asyncio.wait({waiter}, timeout=0.1)
        finally:
            waiter.cancel()
        code = self.proc.returncode
        assert code is not None
        return code

    def tail(self, n: int = 40) -> list[str]:
        """The last ``n`` output lines."""
        return list(self._tail)[-n:]

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the actor's process group (it leads one) unless it is gone."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    async def pump(self, log_path: Path) -> None:
        """Copy output lines to the log file and the tail until EOF. A write the disk
        refuses ends the copying, never the reading: a child blocked on a full pipe would
        hang, and the tail still says how it ended."""
        assert self.proc.stdout is not None
        out = self._open_log(log_path)
        try:
            while line := await self._readline():
                if out is not None:
                    out = self._copy(out, line, log_path)
                self._tail.append(line.decode(errors="replace").rstrip())
        finally:
            if out is not None:
                with contextlib.suppress(OSError):
                    out.close()
            self._drained.set()

    def _open_log(self, log_path: Path) -> BinaryIO | None:
        try:
            return log_path.open("ab")
        except OSError as exc:
            self._log_refused(log_path, exc)
            return None

    def _copy(self, out: BinaryIO, line: bytes, log_path: Path) -> BinaryIO | None:
        """``out`` with ``line`` appended, or None once the disk refused a write."""
        try:
            out.write(line)
            out.flush()
            return out
        except OSError as exc:
            self._log_refused(log_path, exc)
            with contextlib.suppress(OSError):
                out.close()
            return None

    def _log_refused(self, log_path: Path, exc: OSError) -> None:
        self.log_error = f"{log_path}: {exc.strerror or exc}"
        log.warning("actor output no longer copied", actor=self.spec.name, error=self.log_error)

    async def _readline(self) -> bytes:
        assert self.proc.stdout is not None
        try:
            return await self.proc.stdout.readline()
        except ValueError:  # a line over the reader's limit; asyncio has discarded it
            return f"[asyncrl: an output line over {_LINE_LIMIT} bytes was dropped]\n".encode()


class LocalRuntime:
    """Starts actors as local child processes; use as ``async with LocalRuntime(dir)``."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tail_lines: int = 80,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        fork_server: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.host = host
        self.fork_server = fork_server
        self._zygote: Zygote | None = None  # leased while the runtime is open
        self.tail_lines = tail_lines
        self.env = {**os.environ, **(env or {})}
        self.actors: list[LocalActor] = []
        self.endpoints: dict[str, str] = {}
        self._tg = asyncio.TaskGroup()

    async def __aenter__(self) -> LocalRuntime:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        if self.fork_server:  # it imports while the job is placed
            self._zygote = await asyncio.to_thread(acquire_zygote, self.env)
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        for actor in self.actors:
            actor.signal(signal.SIGKILL)
        for actor in self.actors:
            await actor.wait()
            if actor.pump_task is not None:
                actor.pump_task.cancel()  # a surviving grandchild may hold the pipe
            # ...and then the pipe stays open past the loop, which asyncio reports when it
            # collects the transport: close our end now (Process has no public close).
            transport = getattr(actor.proc, "_transport", None)  # ForkedProcess's too
            if transport is not None:
                transport.close()
        release_endpoints(self.endpoints.values())  # no actor of ours binds them now
        if self._zygote is not None:
            release_zygote(self._zygote)
            self._zygote = None
        return await self._tg.__aexit__(et, exc, tb)

    async def place(self, specs: Sequence[ActorSpec]) -> dict[str, str]:
        """Every actor runs here: every endpoint is a free port on ``host`` (an engine's
        HTTP API, which has no key, on loopback)."""
        names = endpoint_names(specs)
        http = [n for n in names if n.endswith(".http")]
        channels = [n for n in names if n not in http]
        self.endpoints = allocate_endpoints(self.host, channels)
        self.endpoints |= allocate_endpoints("127.0.0.1", http)
        return self.endpoints

    async def start(self, spec: ActorSpec) -> LocalActor:
        """Launch a child for ``spec``: forked from the zygote, or exec'd without one."""
        proc = await self._fork(spec) if self.fork_server else None
        proc = proc or await self._exec(spec)
        actor = LocalActor(spec, proc, self.tail_lines)
        self.actors.append(actor)
        log_path = self.run_dir / "logs" / f"{spec.name}.out"
        actor.pump_task = self._tg.create_task(actor.pump(log_path), name=f"pump.{spec.name}")
        return actor

    async def _fork(self, spec: ActorSpec) -> ForkedProcess | None:
        fds = lock_fds(self.run_dir)  # the run stays claimed while any actor lives
        inherit = {LOCK_FD_ENV: fds[0]} if fds else {}
        try:
            zygote = await self._live_zygote()
            return await fork_actor(
                zygote, self.env, os.getcwd(), msgspec.json.encode(spec), inherit, _LINE_LIMIT
            )
        except ZygoteUnavailable as exc:
            log.warning("starting actors with exec: no fork server", reason=str(exc))
            self.fork_server = False
            return None

    async def _live_zygote(self) -> Zygote:
        """The leased zygote, or a new lease if that one died (its actors died with it)."""
        if self._zygote is None or not self._zygote.alive:
            if self._zygote is not None:
                release_zygote(self._zygote)
            self._zygote = None
            self._zygote = await asyncio.to_thread(acquire_zygote, self.env)
        return self._zygote

    async def _exec(self, spec: ActorSpec) -> asyncio.subprocess.Process:
        fds = lock_fds(self.run_dir)
        lock = {LOCK_FD_ENV: str(fds[0])} if fds else {}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "asyncrl.runtime.child",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self.env | lock,
            cwd=os.getcwd(),
            start_new_session=True,
            limit=_LINE_LIMIT,
            pass_fds=fds,
        )
        assert proc.stdin is not None
        proc.stdin.write(msgspec.json.encode(spec))
        proc.stdin.close()
        return proc

    async def stop(self, handle: LocalActor, grace: float) -> int:  # type: ignore[override]
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL. The stop marker first: an
        actor takes a SIGTERM without it for a fault (``actors/base.py``)."""
        marker = stop_marker(handle.spec, handle.proc.pid)
        if marker is not None and handle.proc.returncode is None:
            with contextlib.suppress(OSError):
                marker.touch()
        handle.signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace):
                return await handle.wait()
        except TimeoutError:
            handle.signal(signal.SIGKILL)
            return await handle.wait()
        finally:
            if marker is not None:  # not consumed: the actor was gone, or killed
                marker.unlink(missing_ok=True)

    def kill(self, handle: LocalActor) -> None:  # type: ignore[override]
        """SIGKILL now."""
        handle.signal(signal.SIGKILL)
