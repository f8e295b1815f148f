"""The controller's side of the fork server (``runtime/zygote.py``): start one, fork actors
from it, learn how they end.

A zygote serves every local job of this process whose environment is the one it started
with: a variable read at import time (``OMP_WAIT_POLICY``, ``HF_HUB_OFFLINE``) must not
differ between an actor and the imports it inherits. A reader thread takes the zygote's
messages, so one zygote outlives the event loops of the jobs it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import msgspec

from asyncrl.observe.logs import get_logger

log = get_logger(__name__)

#: Set per test or per job and never read at import: no reason for a zygote of their own.
IGNORED_ENV = frozenset({"PYTEST_CURRENT_TEST", "ASYNCRL_RUN_LOCK_FD"})
_MAX_MESSAGE = 1 << 20
_READY_TIMEOUT = 300.0
_REPLY_TIMEOUT = 60.0
_GONE_WAIT_S = 30.0


class ZygoteUnavailable(RuntimeError):
    """The fork server did not start, or refused a fork (the message says why)."""


class Child:
    """One forked child's record: its exit code once it ended, and who waits for it. A
    record per fork, so a pid the kernel reuses never reads an earlier child's code."""

    __slots__ = ("code", "pid", "waiters")

    def __init__(self, pid: int) -> None:
        self.pid, self.code = pid, None
        self.waiters: list[Callable[[int], None]] = []


class Zygote:
    """One fork-server process and the children it forked for us. Jobs hold a lease on
    it (``acquire``/``release``) while they run; one with no lease and no child is idle."""

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
        self.leases = 0
        self._ready = threading.Event()
        self._replies: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._request = threading.Lock()  # one request in flight: replies come in order
        self._state = threading.Lock()
        self._live: dict[int, Child] = {}
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        """Serving, or still importing."""
        return not self.error

    @property
    def idle(self) -> bool:
        """No job holds it and no child of ours runs."""
        with self._state:
            return not self._live and self.leases == 0

    def spawn(
        self, env: Mapping[str, str], cwd: str, fds: Sequence[int], fd_env: Sequence[str]
    ) -> Child:
        """Fork a child with ``fds`` = [stdin, output, *inherited], ``fd_env[i]`` naming
        inherited descriptor ``i`` in its environment. Blocks (run it in a thread)."""
        if not self._ready.wait(_READY_TIMEOUT):
            self.fail(f"the fork server did not start in {_READY_TIMEOUT:.0f}s")
        request = msgspec.json.encode({"env": dict(env), "cwd": cwd, "fd_env": list(fd_env)})
        with self._request:
            if self.error:
                raise ZygoteUnavailable(self.error)
            try:
                socket.send_fds(self.sock, [request], list(fds))
                reply = self._replies.get(timeout=_REPLY_TIMEOUT)
            except OSError as exc:
                self.fail(f"the fork server's socket failed: {exc}")
            except queue.Empty:  # a late reply would answer the next request: end it
                self.fail(f"the fork server did not answer in {_REPLY_TIMEOUT:.0f}s")
        if "error" in reply:
            raise ZygoteUnavailable(reply["error"])
        return reply["child"]

    def fail(self, reason: str) -> NoReturn:
        """Give this zygote up (its children are ended) and say why."""
        self.error = self.error or reason
        self.close()
        raise ZygoteUnavailable(reason)

    def on_exit(self, child: Child, callback: Callable[[int], None]) -> None:
        """Call ``callback(code)`` (from the reader thread, or now) once ``child`` ended."""
        with self._state:
            if child.code is None:
                child.waiters.append(callback)
                return
        callback(child.code)

    def close(self) -> None:
        """Hang up: the zygote exits, and with it any child still running."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _read(self) -> None:
        while data := self._recv():
            try:
                self._take(msgspec.json.decode(data))
            except Exception:  # one bad message must not stop the reader
                log.exception("fork server message not understood")
        self._gone()

    def _take(self, message: dict) -> None:
        if "exit" in message:
            self._exited(int(message["exit"]), int(message["code"]))
        elif "ready" in message:
            self._ready.set()
        elif not self._ready.is_set():  # the imports failed
            self.error = f"the fork server could not import: {message.get('error')}"
            self._ready.set()
        elif "pid" in message:  # recorded here, before that child's exit can arrive
            child = Child(int(message["pid"]))
            with self._state:
                self._live[child.pid] = child
            self._replies.put({"child": child})
        else:
            self._replies.put(message)

    def _recv(self) -> bytes:
        try:
            return self.sock.recv(_MAX_MESSAGE)
        except OSError:
            return b""

    def _exited(self, pid: int, code: int) -> None:
        with self._state:
            child = self._live.pop(pid, None)
            if child is None:
                return
            child.code = code
            waiters, child.waiters = child.waiters, []
        for callback in waiters:
            try:
                callback(code)
            except Exception:  # a waiter's event loop has closed, say: the others still hear
                log.debug("a fork's exit waiter failed", pid=pid, exc_info=True)

    def _gone(self) -> None:
        """The zygote exited: SIGKILL its children (the kernel only SIGTERMs them) and
        report them killed."""
        self.error = self.error or f"the fork server exited (pid {self.proc.pid})"
        self._ready.set()
        self._replies.put({"error": self.error})
        with self._state:
            live = list(self._live)
        for pid in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + _GONE_WAIT_S
        for pid in live:
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            self._exited(pid, -signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.sock.close()


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (init reaps an orphan's)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


_zygotes: dict[tuple[tuple[str, str], ...], Zygote] = {}
_registry = threading.Lock()


def acquire_zygote(env: Mapping[str, str]) -> Zygote:
    """A lease on the zygote for ``env``, started if there is none (it imports in the
    background); give it back with ``release_zygote``. Idle zygotes of other
    environments are closed."""
    own = {k: v for k, v in env.items() if k not in IGNORED_ENV}
    # An idle OpenMP thread of an actor sleeps rather than spins (runtime/child.py); libgomp
    # reads this once, when the zygote imports torch.
    own.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    key = tuple(sorted(own.items()))
    with _registry:
        zygote = _zygotes.get(key)
        if zygote is None or not zygote.alive:
            idle = _drop_idle()
            zygote = _zygotes[key] = Zygote(own)
        else:
            idle = []
        zygote.leases += 1
    for other in idle:
        other.close()
    return zygote


def release_zygote(zygote: Zygote) -> None:
    """Give back a lease from ``acquire_zygote``."""
    with _registry:
        zygote.leases -= 1


def _drop_idle() -> list[Zygote]:
    """Take the idle (or dead) zygotes out of the registry, to be closed outside its lock."""
    gone = [key for key, z in _zygotes.items() if z.idle or not z.alive]
    return [_zygotes.pop(key) for key in gone]


def prestart_zygote(env: Mapping[str, str]) -> None:
    """Start the zygote for ``env`` now, so that it imports while the controller checks
    the job (``preflight`` loads tokenizers and data); the job's runtime takes it up."""
    release_zygote(acquire_zygote(env))


def zygote_pids() -> set[int]:
    """The pids of this process's zygotes (each outlives the jobs it served, to serve the
    next job with its environment, until this process exits or ``close_idle_zygotes``)."""
    with _registry:
        return {z.proc.pid for z in _zygotes.values() if z.alive}


def close_idle_zygotes() -> None:
    """End every zygote no job holds and no child uses (its memory back, say, between the
    jobs of a notebook); the next local job starts one again."""
    with _registry:
        idle = _drop_idle()
    for zygote in idle:
        zygote.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            zygote.proc.wait(timeout=5)


class ForkedProcess:
    """A child of a zygote, as much of ``asyncio.subprocess.Process`` as the local runtime
    uses: ``pid``, ``returncode``, ``stdout``, ``wait()``."""

    def __init__(
        self, zygote: Zygote, child: Child, stdout: asyncio.StreamReader, transport: Any
    ) -> None:
        self.zygote, self.child, self.pid, self.stdout = zygote, child, child.pid, stdout
        self._transport = transport

    @property
    def returncode(self) -> int | None:
        """None while running; negative when killed by a signal."""
        return self.child.code

    async def wait(self) -> int:
        """The exit code, once the child has exited."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()

        def settle(code: int) -> None:
            if not done.done():
                done.set_result(code)

        self.zygote.on_exit(self.child, lambda code: loop.call_soon_threadsafe(settle, code))
        return await done

    def close(self) -> None:
        """Close our end of the output pipe."""
        self._transport.close()


async def fork_actor(
    zygote: Zygote,
    env: Mapping[str, str],
    cwd: str,
    stdin: bytes,
    inherit: Mapping[str, int],
    line_limit: int,
) -> ForkedProcess:
    """A child of ``zygote`` reading ``stdin`` and writing its output to a pipe we read;
    ``inherit`` maps an environment variable to a descriptor the child keeps (the variable
    names it there). ``ZygoteUnavailable`` if the zygote cannot fork it. Cancelled at any
    point, it leaves no child and no descriptor behind."""
    loop = asyncio.get_running_loop()
    forked = loop.run_in_executor(None, _fork_with_pipes, zygote, env, cwd, stdin, inherit)
    try:
        child, out_r = await asyncio.shield(forked)
    except asyncio.CancelledError:
        forked.add_done_callback(_undo_fork)
        raise
    # The pipe's descriptor belongs to the transport from the moment the loop takes it
    # (asyncio closes the file object, uvloop's libuv the number itself, each on a later
    # loop turn): closing it here too could close whatever reused the number by then. So
    # the connect is never cut short, and a transport made is closed only as a transport.
    reader = asyncio.StreamReader(limit=line_limit, loop=loop)
    connect = asyncio.ensure_future(
        loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=loop), os.fdopen(out_r, "rb", 0)
        )
    )
    try:
        transport, _ = await asyncio.shield(connect)
    except BaseException:
        connect.add_done_callback(functools.partial(_undo_connect, child))
        raise
    return ForkedProcess(zygote, child, reader, transport)


def _fork_with_pipes(
    zygote: Zygote, env: Mapping[str, str], cwd: str, stdin: bytes, inherit: Mapping[str, int]
) -> tuple[Child, int]:
    """In a thread: the pipes, the fork, the spec written; the child and our output end."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        child = zygote.spawn(env, cwd, [in_r, out_w, *inherit.values()], list(inherit))
    except BaseException:
        _close_fds(in_w, out_r)
        raise
    finally:
        _close_fds(in_r, out_w)
    _write_and_close(in_w, stdin)
    return child, out_r


def _undo_fork(forked: asyncio.Future[tuple[Child, int]]) -> None:
    """A fork its caller gave up on: end the child, close our end of its output."""
    if forked.cancelled() or forked.exception() is not None:
        return
    child, out_r = forked.result()
    _kill(child)
    _close_fds(out_r)


def _undo_connect(child: Child, connect: asyncio.Future[tuple[Any, Any]]) -> None:
    """A connect its caller gave up on: end the child, close the transport if one was
    made (a failed connect closed its own)."""
    _kill(child)
    if not connect.cancelled() and connect.exception() is None:
        connect.result()[0].close()


def _kill(child: Child) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _write_and_close(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BrokenPipeError:  # the child died first: its exit code says how
        pass
    finally:
        os.close(fd)
