"""ZeroMQ socket construction: one place that sets the options every channel relies on.

Every socket gets ``linger=0``, explicit high-water marks and a ``MAXMSGSIZE`` hard cap.
Endpoints are loopback unless a caller opts in with ``allow_remote=True`` or CurveZMQ is
enabled (``asyncrl.wire.security``); ports drawn ahead are claimed machine-wide.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import ipaddress
import os
import random
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from asyncrl.wire import security

DEFAULT_HWM = 1000
#: libzmq disconnects a peer whose frame exceeds max_frame_bytes + this. Below it, the
#: channels count and log the oversized frame themselves.
HARD_CAP_SLACK = 1024 * 1024


def context() -> zmq.asyncio.Context:
    """The process-wide asyncio zmq context (created on first use)."""
    return zmq.asyncio.Context.instance()


def make_socket(
    kind: int,
    *,
    hwm: int = DEFAULT_HWM,
    max_frame_bytes: int | None = None,
    routing_id: bytes | None = None,
    ctx: zmq.asyncio.Context | None = None,
) -> zmq.asyncio.Socket:
    """Create an asyncio socket with the project's standard options."""
    sock = (ctx or context()).socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # close never blocks: reliable channels keep an outbox
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if max_frame_bytes is not None:
        # Hard cap only: the channels refuse oversize frames with a counted, logged drop;
        # libzmq's cap (which disconnects the peer) is for frames far beyond that.
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + HARD_CAP_SLACK)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    return sock


def term_sent(ctx: zmq.Context) -> None:
    """Terminate ``ctx``, which waits, up to its sockets' linger, until what they sent has
    left. The stop signals are held off meanwhile: one arriving would end the wait (EINTR,
    which pyzmq's ``term`` swallows) with the message still queued."""
    if threading.current_thread() is not threading.main_thread():
        ctx.term()  # signals are delivered to the main thread, not this one
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        ctx.term()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)


def check_endpoint(endpoint: str, *, allow_remote: bool = False) -> None:
    """Refuse a tcp endpoint on a non-loopback interface unless ``allow_remote``."""
    parts = urlsplit(endpoint)
    if parts.scheme in ("inproc", "ipc"):
        return
    if parts.scheme != "tcp" or not parts.hostname:
        raise ValueError(f"endpoint {endpoint!r} is not tcp://HOST:PORT, ipc:// or inproc://")
    if allow_remote or is_loopback(parts.hostname):
        return
    raise ValueError(
        f"endpoint {endpoint!r} is not on loopback; pass allow_remote=True "
        "(and configure CurveZMQ keys) to expose a channel beyond this host"
    )


def is_loopback(host: str) -> bool:
    """``host`` (an IPv6 literal may keep its brackets) is this machine's loopback; a
    host name other than ``localhost`` may resolve anywhere, so it is not."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bind(sock: zmq.asyncio.Socket, endpoint: str, *, allow_remote: bool = False) -> str:
    """Bind ``endpoint`` (``tcp://127.0.0.1:0`` picks a free port); return the real address.

    With CurveZMQ enabled (``security.enable``) the socket is a CURVE server and may bind a
    non-loopback address."""
    keys = security.active()
    check_endpoint(endpoint, allow_remote=allow_remote or keys is not None)
    if keys is not None:
        keys.server(sock)
    if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] in ("0", "*"):
        endpoint = endpoint.rsplit(":", 1)[0] + ":*"
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


async def abind(
    sock: zmq.asyncio.Socket, endpoint: str, *, allow_remote: bool = False, retry_for: float = 5.0
) -> str:
    """``bind``, retrying while the address is still held by a socket being closed.

    libzmq closes sockets asynchronously, so an actor restarted on its old address (or a
    channel reopened in-process) can briefly see EADDRINUSE.
    """
    deadline = time.monotonic() + retry_for
    while True:
        try:
            return bind(sock, endpoint, allow_remote=allow_remote)
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def connect(sock: zmq.asyncio.Socket, endpoint: str, *, allow_remote: bool = False) -> None:
    """Connect to ``endpoint`` after the same loopback check as ``bind`` (a CURVE client of
    the job's key when CurveZMQ is enabled)."""
    keys = security.active()
    check_endpoint(endpoint, allow_remote=allow_remote or keys is not None)
    if keys is not None:
        keys.client(sock)
    sock.connect(endpoint)


def send_now(sock: zmq.asyncio.Socket, frames: Sequence[object]) -> bool:
    """Send without waiting. True if queued; False if the socket would block (EAGAIN).

    pyzmq resolves a DONTWAIT send on an asyncio socket synchronously and keeps the
    edge-triggered FD state consistent, so the caller's loop never awaits on the hot path.
    """
    fut = sock.send_multipart(frames, flags=zmq.DONTWAIT, copy=False)
    if not fut.done():  # pragma: no cover - only when an awaited send is pending
        return True
    exc = fut.exception()
    if exc is None:
        return True
    if isinstance(exc, zmq.Again):
        return False
    raise exc


#: Ports this process has claimed -> the descriptor that holds the claim (-1: unchecked).
_claims: dict[int, int] = {}
#: One file per claimed port, shared by this user's asyncrl processes.
_CLAIMS_DIR = Path(tempfile.gettempdir()) / f"asyncrl-ports-{os.getuid()}"


def free_tcp_endpoint(host: str = "127.0.0.1") -> str:
    """A ``tcp://host:port`` whose port was free a moment ago and is now claimed by this
    process (for pre-assigned addresses, bound later by an actor).

    The port is drawn below the kernel's ephemeral range: a port the kernel picked
    (``bind(0)``) can be handed, before the actor's bind, to any outgoing connection on the
    machine as its local port, and the bind then fails with "Address already in use".
    Until the bind, the claim (``_claim``) keeps every other asyncrl process of this user
    from drawing the same port. ``release_endpoints`` gives the claims back.
    """
    low, high = _fixed_port_range()
    rng = random.SystemRandom()
    for _ in range(200 if low < high else 0):
        port = rng.randrange(low, high)
        if port not in _claims and _claim(port):
            if _bindable(host, port):
                return f"tcp://{host}:{port}"
            _release(port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def release_endpoints(endpoints: Iterable[str]) -> None:
    """Give back this process's claims on the ports of ``endpoints`` (a job's end)."""
    for endpoint in endpoints:
        port = urlsplit(endpoint).port
        if port is not None and port in _claims:
            _release(port)


def _claim(port: int) -> bool:
    """Claim ``port`` machine-wide: an exclusive ``flock`` on a file named after it, held
    until released or this process ends (the kernel drops it however the process dies,
    so a crash leaves no stale claim). The files are never deleted: unlinking a locked
    file would let a second process lock a new file of the same name."""
    try:
        _CLAIMS_DIR.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(_CLAIMS_DIR / str(port), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:  # no usable temp directory: claims within this process only
        _claims[port] = -1
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _claims[port] = fd
    return True


def _release(port: int) -> None:
    fd = _claims.pop(port)
    if fd >= 0:
        os.close(fd)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _fixed_port_range() -> tuple[int, int]:
    """``[low, high)`` just below the ephemeral range (``ip_local_port_range``)."""
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768  # the Linux default; elsewhere a guess that is still below IANA's 49152
    return max(1024, first - 12000), first
