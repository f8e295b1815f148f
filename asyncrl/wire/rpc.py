"""Request/reply with credits: ``RpcClient`` (DEALER) -> ``RpcServer`` (ROUTER).

For consumers that ask for work (rollout actors and the trainer at the buffer, the blob
pull's chunks). The channel never retries a call, which may have side effects: on a
connection reset every pending call fails with ``PeerLost`` ("may or may not have run")
and the caller decides.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

import structlog
import zmq
from msgspec import Raw
from zmq.utils.monitor import parse_monitor_message

from asyncrl.wire import framing
from asyncrl.wire.channels import _Channel
from asyncrl.wire.codec import WIRE_VERSION, Codec
from asyncrl.wire.errors import ChannelClosed, PeerLost, RemoteError, WireError, WouldBlock
from asyncrl.wire.framing import ENVELOPE_SLACK
from asyncrl.wire.sockets import abind, connect, make_socket, send_now

Req = TypeVar("Req")
Rep = TypeVar("Rep")
Handler = Callable[[Req, bytes], Awaitable[Rep]]
log = structlog.get_logger("asyncrl.wire")


class RpcClient(_Channel, Generic[Req, Rep]):
    """Calls an ``RpcServer``. ``identity`` is how the server sees this client.

    At most ``max_inflight`` calls are in flight (its credits: ``call`` waits for one, so a
    client cannot flood a server); replies are matched by id, so calls may complete out
    of order. A reply after its caller gave up is dropped and counted
    (``dropped.late_reply``): a long-polling handler should bound its own wait
    (``max_wait`` in the request) rather than rely on client timeouts.
    """

    def __init__(
        self,
        endpoint: str,
        request_codec: Codec[Req],
        reply_codec: Codec[Rep],
        *,
        max_inflight: int = 64,
        identity: str | None = None,
        hwm: int = 1000,
        name: str = "rpc",
        allow_remote: bool = False,
    ) -> None:
        super().__init__(name)
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.endpoint = endpoint
        self.request_codec, self.reply_codec = request_codec, reply_codec
        self.max_inflight = max_inflight
        # A readable identity: servers log and account work per client by it.
        self.identity = identity or f"{name}-{uuid.uuid4().hex[:12]}"
        self._hwm, self._allow_remote = hwm, allow_remote
        self._credits = asyncio.Semaphore(max_inflight)
        self._waiting: dict[int, asyncio.Future[Rep]] = {}
        self._ids = itertools.count(1)

    async def _open(self) -> None:
        self._sock = make_socket(
            zmq.DEALER,
            hwm=self._hwm,
            max_frame_bytes=self.reply_codec.max_frame_bytes,
            routing_id=self.identity.encode(),
        )
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        connect(self._sock, self.endpoint, allow_remote=self._allow_remote)

    def _background(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        return [
            ("rpc.replies", self._receive_each(self._sock, self._on_reply)),
            ("rpc.monitor", self._monitor_loop()),
        ]

    def _close_sockets(self) -> None:
        self._fail_all(ChannelClosed("rpc client closed"))
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    @property
    def in_flight(self) -> int:
        """Calls sent and not yet answered."""
        return len(self._waiting)

    async def call(self, msg: Req) -> Rep:
        """Send ``msg`` and wait for its reply.

        Raises ``RemoteError`` (the handler raised), ``PeerLost`` (connection reset) or
        ``ChannelClosed``. Bound the wait with ``asyncio.timeout()`` around the call.
        """
        if self._closed:
            raise ChannelClosed("rpc client closed")
        body, buffers = self.request_codec.encode_parts(msg)
        async with self._credits:
            if self._closed:  # closed while this call waited for a credit
                raise ChannelClosed("rpc client closed")
            call_id = next(self._ids)
            fut: asyncio.Future[Rep] = asyncio.get_running_loop().create_future()
            self._waiting[call_id] = fut
            env = framing.pack(
                framing.Request(v=WIRE_VERSION, id=call_id, nbuf=len(buffers), body=Raw(body))
            )
            try:
                await self._sock.send_multipart([env, *buffers], copy=False)
                self.stats.sent += 1
                return await fut
            finally:
                self._waiting.pop(call_id, None)

    def start_call(self, msg: Req) -> asyncio.Future[Rep]:
        """Send ``msg`` now and return the future of its reply, without taking a credit.

        For callers that keep their own window of calls in flight (the blob pull sends
        request ``k + window`` the moment reply ``k`` arrives). Raises ``WouldBlock`` when
        the socket is full. Cancelling the future abandons the call.
        """
        if self._closed:
            raise ChannelClosed("rpc client closed")
        body, buffers = self.request_codec.encode_parts(msg)
        call_id = next(self._ids)
        env = framing.Request(v=WIRE_VERSION, id=call_id, nbuf=len(buffers), body=Raw(body))
        if not send_now(self._sock, [framing.pack(env), *buffers]):
            raise WouldBlock(f"{self.endpoint}: request queue full")
        self.stats.sent += 1
        fut: asyncio.Future[Rep] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = fut
        fut.add_done_callback(lambda _: self._waiting.pop(call_id, None))
        return fut

    def _on_reply(self, frames: list[zmq.Frame]) -> None:
        rep = framing.unpack(frames[0].buffer, framing.Reply)
        fut = self._waiting.get(rep.id)
        if fut is None or fut.done():
            self._drops.drop("late_reply", f"no caller waits for reply {rep.id}")
            return
        self.stats.received += 1
        self._resolve(fut, rep, frames[1:])

    def _resolve(self, fut: asyncio.Future[Rep], rep: framing.Reply, buffers: list) -> None:
        if rep.error is not None:
            fut.set_exception(RemoteError(rep.error))
        elif rep.nbuf != len(buffers):
            fut.set_exception(
                WireError(f"reply {rep.id} announces {rep.nbuf} buffers, {len(buffers)} came")
            )
        else:
            try:
                fut.set_result(self.reply_codec.decode_parts(rep.body, [f.buffer for f in buffers]))
            except WireError as exc:
                self._drops.drop("malformed", str(exc))
                fut.set_exception(exc)

    async def _monitor_loop(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and self._waiting:
                self._fail_all(
                    PeerLost(f"connection to {self.endpoint} reset; call may or may not have run")
                )

    def _fail_all(self, exc: Exception) -> None:
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(exc)
        self._waiting.clear()


class RpcServer(_Channel, Generic[Req, Rep]):
    """Serves ``handler(request, peer_identity) -> reply`` for many clients, at most
    ``max_concurrency`` at once (past that it stops reading, and zmq's HWM pushes back). A
    handler that raises, or a request that does not decode, is answered with the error
    (``RemoteError`` at the caller), and the server keeps serving."""

    def __init__(
        self,
        endpoint: str,
        request_codec: Codec[Req],
        reply_codec: Codec[Rep],
        handler: Handler[Req, Rep],
        *,
        max_concurrency: int = 64,
        hwm: int = 1000,
        name: str = "rpc",
        allow_remote: bool = False,
    ) -> None:
        super().__init__(name)
        self.endpoint = endpoint
        self.request_codec, self.reply_codec = request_codec, reply_codec
        self.handler = handler
        self.name = name
        self._hwm, self._allow_remote = hwm, allow_remote
        self._slots = asyncio.Semaphore(max_concurrency)
        self.handler_errors = 0  # requests whose handler raised (answered with the error)

    async def _open(self) -> None:
        self._sock = make_socket(
            zmq.ROUTER, hwm=self._hwm, max_frame_bytes=self.request_codec.max_frame_bytes
        )
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.endpoint = await abind(self._sock, self.endpoint, allow_remote=self._allow_remote)

    def _background(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        return [(f"{self.name}.serve", self._serve_loop())]

    def _close_sockets(self) -> None:
        self._sock.close(linger=0)

    async def _serve_loop(self) -> None:
        while True:
            await self._slots.acquire()
            frames = await self._sock.recv_multipart(copy=False)
            peer = frames[0].bytes
            request = self._parse(peer, frames)
            if request is None:
                self._slots.release()
                continue
            call_id, msg = request
            self._spawn(self._handle(peer, call_id, msg), f"{self.name}.call")

    def _parse(self, peer: bytes, frames: list[zmq.Frame]) -> tuple[int, Req] | None:
        limit = self.request_codec.max_frame_bytes
        if len(frames) < 2:
            self._drops.drop("bad_frames", f"a request of {len(frames)} frames")
            return None
        try:
            env = framing.unpack(frames[1].buffer, framing.Request)
        except WireError as exc:
            self._drops.drop("malformed", str(exc), peer=peer)
            return None
        if any(len(f) > limit + ENVELOPE_SLACK for f in frames[1:]):
            self._drops.drop("bad_frames", f"a frame over {limit} bytes", peer=peer)
            self._reply_error(peer, env.id, f"request larger than the limit of {limit} bytes")
            return None
        try:
            if env.nbuf != len(frames) - 2:
                raise WireError(f"request announces {env.nbuf} buffers, {len(frames) - 2} came")
            msg = self.request_codec.decode_parts(env.body, [f.buffer for f in frames[2:]])
        except WireError as exc:
            self._drops.drop("malformed", str(exc), peer=peer)
            self._reply_error(peer, env.id, f"bad request: {exc}")
            return None
        self.stats.received += 1
        return env.id, msg

    async def _handle(self, peer: bytes, call_id: int, msg: Req) -> None:
        try:
            reply = await self.handler(msg, peer)
            body, buffers = self.reply_codec.encode_parts(reply)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The caller gets the error; the log gets the first few and then one in a
            # thousand, so a peer sending bad requests cannot flood it.
            self.handler_errors += 1
            if self.handler_errors <= 10 or self.handler_errors % 1000 == 0:
                log.warning(
                    "rpc handler failed",
                    channel=self.name,
                    error=repr(exc),
                    count=self.handler_errors,
                )
            self._reply_error(peer, call_id, f"{type(exc).__name__}: {exc}")
            return
        finally:
            self._slots.release()
        env = framing.Reply(
            v=WIRE_VERSION, id=call_id, nbuf=len(buffers), body=Raw(body), error=None
        )
        self._send(peer, [framing.pack(env), *buffers])

    def _reply_error(self, peer: bytes, call_id: int, error: str) -> None:
        env = framing.Reply(v=WIRE_VERSION, id=call_id, nbuf=0, body=framing.NIL, error=error)
        self._send(peer, [framing.pack(env)])

    def _send(self, peer: bytes, frames: list[Any]) -> None:
        # ROUTER silently drops a reply to a vanished or full peer; that caller sees
        # PeerLost or its own timeout.
        send_now(self._sock, [peer, *frames])
        self.stats.sent += 1
