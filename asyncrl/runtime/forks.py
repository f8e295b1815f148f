"""The controller's side of the fork server (``runtime/zygote.py``): start one, fork actors
from it, learn how they end.

A zygote serves every local job of this process whose environment is the one it started
with: a variable read at import time (``OMP_WAIT_POLICY``, ``HF_HUB_OFFLINE``) must not
differ between an actor and the imports it inherits. A job with another environment gets
a zygote of its own; idle ones are closed then. A reader thread takes the zygote's
messages, so one zygote outlives the event loops of the jobs it serves.

If the zygote itself dies, its actors are SIGKILLed (the kernel would SIGTERM them) and
reported as killed. A zygote outlives the jobs it served (about 0.4 GB, shared with its
actors while they run) until this process exits; ``close_idle_zygotes`` ends it sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import msgspec

from asyncrl.observe.logs import get_logger

log = get_logger(__name__)

#: Set per test or per job and never read at import: no reason for a zygote of their own.
IGNORED_ENV = frozenset({"PYTEST_CURRENT_TEST", "ASYNCRL_RUN_LOCK_FD"})
_MAX_MESSAGE = 1 << 20
_READY_TIMEOUT = 300.0
_REPLY_TIMEOUT = 60.0


class ZygoteUnavailable(RuntimeError):
    """The fork server did not start, or refused a fork (the message says why)."""


class Zygote:
    """One fork-server process and the children it forked for us."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.runtime.zygote", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self.error = ""
        self._ready = threading.Event()
        self._replies: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._request = threading.Lock()  # one request in flight: replies come in order
        self._state = threading.Lock()
        self._codes: dict[int, int] = {}
        self._live: set[int] = set()
        self._waiters: dict[int, list[Callable[[int], None]]] = {}
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        """Serving, or still importing."""
        return not self.error

    @property
    def idle(self) -> bool:
        """No child of ours is running."""
        with self._state:
            return not self._live

    def spawn(
        self, env: Mapping[str, str], cwd: str, fds: Sequence[int], fd_env: Sequence[str]
    ) -> int:
        """Fork a child with ``fds`` = [stdin, output, *inherited], ``fd_env[i]`` naming
        inherited descriptor ``i`` in its environment; its pid. Blocks (run in a thread)."""
        if not self._ready.wait(_READY_TIMEOUT):
            raise ZygoteUnavailable(f"the fork server did not start in {_READY_TIMEOUT:.0f}s")
        request = {"env": dict(env), "cwd": cwd, "fd_env": list(fd_env)}
        with self._request:
            if self.error:
                raise ZygoteUnavailable(self.error)
            socket.send_fds(self.sock, [msgspec.json.encode(request)], list(fds))
            try:
                reply = self._replies.get(timeout=_REPLY_TIMEOUT)
            except queue.Empty:
                raise ZygoteUnavailable("the fork server did not answer") from None
        if "error" in reply:
            raise ZygoteUnavailable(reply["error"])
        pid = int(reply["pid"])
        with self._state:
            if pid not in self._codes:
                self._live.add(pid)
        return pid

    def exit_code(self, pid: int) -> int | None:
        """How child ``pid`` ended (negative: killed by that signal); None while it runs."""
        with self._state:
            return self._codes.get(pid)

    def on_exit(self, pid: int, callback: Callable[[int], None]) -> None:
        """Call ``callback(code)`` (from the reader thread) once ``pid`` has ended."""
        with self._state:
            code = self._codes.get(pid)
            if code is None:
                self._waiters.setdefault(pid, []).append(callback)
                return
        callback(code)

    def close(self) -> None:
        """Hang up: the zygote exits, and with it any child still running."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)

    def _read(self) -> None:
        while data := self._recv():
            message = msgspec.json.decode(data)
            if "exit" in message:
                self._exited(int(message["exit"]), int(message["code"]))
            elif "ready" in message:
                self._ready.set()
            elif not self._ready.is_set():  # the imports failed
                self.error = f"the fork server could not import: {message.get('error')}"
                self._ready.set()
            else:
                self._replies.put(message)
        self._gone()

    def _recv(self) -> bytes:
        try:
            return self.sock.recv(_MAX_MESSAGE)
        except OSError:
            return b""

    def _exited(self, pid: int, code: int) -> None:
        with self._state:
            self._codes[pid] = code
            self._live.discard(pid)
            waiters = self._waiters.pop(pid, [])
        for callback in waiters:
            callback(code)

    def _gone(self) -> None:
        """The zygote exited: its children get SIGTERM from the kernel; end them now."""
        self.error = self.error or f"the fork server exited (pid {self.proc.pid})"
        self._ready.set()
        self._replies.put({"error": self.error})
        with self._state:
            live = list(self._live)
        for pid in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for pid in live:
            while _running(pid):
                time.sleep(0.05)
            self._exited(pid, -signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (init reaps an orphan's)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


_zygotes: dict[tuple[tuple[str, str], ...], Zygote] = {}
_registry = threading.Lock()


def zygote_for(env: Mapping[str, str]) -> Zygote:
    """The zygote for ``env``, started if there is none (it imports in the background).
    Zygotes of other environments that have no child running are closed."""
    own = {k: v for k, v in env.items() if k not in IGNORED_ENV}
    # An idle OpenMP thread of an actor sleeps rather than spins (runtime/child.py); libgomp
    # reads this once, when the zygote imports torch.
    own.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    key = tuple(sorted(own.items()))
    with _registry:
        zygote = _zygotes.get(key)
        if zygote is not None and zygote.alive:
            return zygote
        for other_key, other in list(_zygotes.items()):
            if other.idle or not other.alive:
                other.close()
                del _zygotes[other_key]
        zygote = _zygotes[key] = Zygote(own)
        return zygote


def zygote_pids() -> set[int]:
    """The pids of this process's zygotes (each outlives the jobs it served, to serve the
    next job with its environment, until this process exits or ``close_idle_zygotes``)."""
    with _registry:
        return {z.proc.pid for z in _zygotes.values() if z.alive}


def close_idle_zygotes() -> None:
    """End every zygote with no child running (its memory back, say, between the jobs of
    a notebook); the next local job starts one again."""
    with _registry:
        for key, zygote in list(_zygotes.items()):
            if zygote.idle or not zygote.alive:
                zygote.close()
                del _zygotes[key]


class ForkedProcess:
    """A child of a zygote, as much of ``asyncio.subprocess.Process`` as the local runtime
    uses: ``pid``, ``returncode``, ``stdout``, ``wait()``."""

    def __init__(
        self,
        zygote: Zygote,
        pid: int,
        stdout: asyncio.StreamReader,
        transport: asyncio.BaseTransport,
    ) -> None:
        self.zygote, self.pid, self.stdout = zygote, pid, stdout
        self._transport = transport

    @property
    def returncode(self) -> int | None:
        """None while running; negative when killed by a signal."""
        return self.zygote.exit_code(self.pid)

    async def wait(self) -> int:
        """The exit code, once the child has exited."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()

        def settle(code: int) -> None:
            if not done.done():
                done.set_result(code)

        self.zygote.on_exit(self.pid, lambda code: loop.call_soon_threadsafe(settle, code))
        return await done

    def close(self) -> None:
        """Close our end of the output pipe."""
        self._transport.close()


async def fork_actor(
    env: Mapping[str, str], cwd: str, stdin: bytes, inherit: Mapping[str, int], line_limit: int
) -> ForkedProcess:
    """A forked child reading ``stdin`` and writing its output to a pipe we read;
    ``inherit`` maps an environment variable to a descriptor the child keeps (the variable
    names it there). ``ZygoteUnavailable`` if the zygote cannot fork it."""
    zygote = await asyncio.to_thread(zygote_for, env)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        pid = await asyncio.to_thread(
            zygote.spawn, env, cwd, [in_r, out_w, *inherit.values()], list(inherit)
        )
    except BaseException:
        for fd in (in_w, out_r):
            os.close(fd)
        raise
    finally:
        os.close(in_r)
        os.close(out_w)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=line_limit, loop=loop)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader, loop=loop), os.fdopen(out_r, "rb", 0)
    )
    await asyncio.to_thread(_write_and_close, in_w, stdin)
    return ForkedProcess(zygote, pid, reader, transport)


def _write_and_close(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BrokenPipeError:  # the child died first: its exit code says how
        pass
    finally:
        os.close(fd)
