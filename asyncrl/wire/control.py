"""The control channel: ``ControlServer`` (controller, ROUTER) and ``ControlLink`` (actor, DEALER).

Each actor's link, its actor name as zmq identity, sends notifications (``Hello``,
``Heartbeat``, ``Bye``: fire-and-forget; dropped and counted when the queue is full, since
the next heartbeat carries the news) and answers the server's ``Command``s with a
``CommandResult``. The server never blocks on one slow actor.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from typing import Any

import zmq
import zmq.asyncio
from msgspec import Raw

from asyncrl.wire import framing
from asyncrl.wire.channels import _Channel
from asyncrl.wire.codec import WIRE_VERSION, Codec
from asyncrl.wire.errors import ChannelClosed, PeerLost, RemoteError, WireError
from asyncrl.wire.messages import Bye, Command, CommandResult, Heartbeat, Hello
from asyncrl.wire.sockets import abind, connect, make_socket, send_now, term_sent

Notification = Hello | Heartbeat | Bye
_MAX_FRAME = 4 * 1024 * 1024  # control messages are small; a larger frame is refused
#: How long closing a link waits for its last notification (the actor's Bye) to leave.
BYE_LINGER_MS = 5000
_notify_codec: Codec[Notification] = Codec(Notification, max_frame_bytes=_MAX_FRAME)
_command_codec: Codec[Command] = Codec(Command, max_frame_bytes=_MAX_FRAME)
_result_codec: Codec[CommandResult] = Codec(CommandResult, max_frame_bytes=_MAX_FRAME)


class ControlServer(_Channel):
    """The controller's end: receives notifications, sends commands to named actors."""

    def __init__(self, endpoint: str, *, hwm: int = 10000, allow_remote: bool = False) -> None:
        super().__init__("control")
        self.endpoint = endpoint
        self._hwm, self._allow_remote = hwm, allow_remote
        self._inbox: asyncio.Queue[tuple[str, Notification]] = asyncio.Queue(maxsize=hwm)
        self._waiting: dict[int, tuple[str, asyncio.Future[CommandResult]]] = {}
        self._ids = itertools.count(1)

    async def _open(self) -> None:
        self._sock = make_socket(zmq.ROUTER, hwm=self._hwm)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.endpoint = await abind(self._sock, self.endpoint, allow_remote=self._allow_remote)

    def _background(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        return [("control.server", self._receive_each(self._sock, self._dispatch))]

    def _close_sockets(self) -> None:
        for _, fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(ChannelClosed("control server closed"))
        self._sock.close(linger=0)

    async def receive(self) -> tuple[str, Notification]:
        """The next ``(actor name, notification)``."""
        return await self._inbox.get()

    async def command(self, actor: str, cmd: Command) -> CommandResult:
        """Send ``cmd`` to ``actor`` and wait for its result (bound it with ``asyncio.timeout``).

        Raises ``PeerLost`` if the actor is not connected, ``RemoteError`` if it failed.
        """
        if self._closed:
            raise ChannelClosed("control server closed")
        call_id = next(self._ids)
        fut: asyncio.Future[CommandResult] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = (actor, fut)
        body, _ = _command_codec.encode_parts(cmd)
        env = framing.Request(v=WIRE_VERSION, id=call_id, nbuf=0, body=Raw(body))
        try:
            try:
                sent = send_now(self._sock, [actor.encode(), framing.pack(env)])
            except zmq.ZMQError as exc:  # EHOSTUNREACH under ROUTER_MANDATORY
                raise PeerLost(f"actor {actor!r} is not connected") from exc
            if not sent:
                raise PeerLost(f"actor {actor!r} is not reading its control channel")
            result = await fut
        finally:
            self._waiting.pop(call_id, None)
        if not result.ok:
            raise RemoteError(f"{actor}: {result.error}")
        return result

    def abandon(self, actor: str, why: str) -> None:
        """Fail the commands waiting on ``actor`` with ``PeerLost``: its incarnation that
        would have answered is gone (exited, or replaced by one that said Hello)."""
        for name, fut in list(self._waiting.values()):
            if name == actor and not fut.done():
                fut.set_exception(PeerLost(f"actor {actor!r} {why}"))

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            raise WireError(f"control message of {len(frames)} frames")
        actor = frames[0].bytes.decode(errors="replace")
        env = framing.unpack(frames[1].buffer, (framing.Request, framing.Reply))
        if isinstance(env, framing.Reply):
            expected, fut = self._waiting.get(env.id, ("", None))
            if fut is None or fut.done() or expected != actor:
                raise WireError(f"reply {env.id} from {actor!r} answers no command sent to it")
            try:
                fut.set_result(_result_codec.decode_parts(env.body))
            except WireError as exc:
                fut.set_exception(exc)  # the caller learns why instead of waiting forever
                raise
            return
        msg = _notify_codec.decode_parts(env.body)
        if isinstance(msg, Hello):  # a new incarnation: the old one answers nothing now
            self.abandon(actor, "started again before it answered")
        self.stats.received += 1
        try:
            self._inbox.put_nowait((actor, msg))
        except asyncio.QueueFull:
            self._drops.drop("inbox_full", "controller is not reading notifications")


class ControlLink(_Channel):
    """An actor's end: sends notifications, receives commands and answers them."""

    def __init__(
        self, endpoint: str, actor: str, *, hwm: int = 1000, allow_remote: bool = False
    ) -> None:
        super().__init__("control")
        self.endpoint, self.actor = endpoint, actor
        self._hwm, self._allow_remote = hwm, allow_remote
        self._commands: asyncio.Queue[tuple[int, Command]] = asyncio.Queue(maxsize=64)

    async def _open(self) -> None:
        # A context of its own: terminating it is what waits for the Bye to leave.
        self._ctx = zmq.asyncio.Context()
        self._sock = make_socket(
            zmq.DEALER, hwm=self._hwm, routing_id=self.actor.encode(), ctx=self._ctx
        )
        try:
            connect(self._sock, self.endpoint, allow_remote=self._allow_remote)
        except BaseException:
            self._sock.close(linger=0)
            self._ctx.term()
            raise

    def _background(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        return [("control.link", self._receive_each(self._sock, self._on_command))]

    def _close_sockets(self) -> None:
        """Close, and wait (up to ``BYE_LINGER_MS``) until what was sent has left: a
        process that exits at once otherwise loses its Bye, and the supervisor takes a
        finished actor's clean exit for a death and restarts it."""
        self._sock.close(linger=BYE_LINGER_MS)
        term_sent(self._ctx)

    def notify(self, msg: Notification) -> bool:
        """Send a notification (a ``Request`` with id 0) without waiting; False (and
        counted) if it was dropped."""
        body, _ = _notify_codec.encode_parts(msg)
        env = framing.Request(v=WIRE_VERSION, id=0, nbuf=0, body=Raw(body))
        if send_now(self._sock, [framing.pack(env)]):
            self.stats.sent += 1
            return True
        self._drops.drop("blocked", "controller is not reading; notification dropped")
        return False

    async def next_command(self) -> tuple[int, Command]:
        """The next ``(command id, command)`` from the controller."""
        return await self._commands.get()

    def reply(self, command_id: int, result: CommandResult) -> None:
        """Answer command ``command_id``."""
        body, _ = _result_codec.encode_parts(result)
        env = framing.Reply(v=WIRE_VERSION, id=command_id, nbuf=0, body=Raw(body), error=None)
        send_now(self._sock, [framing.pack(env)])

    def _on_command(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 1:
            raise WireError(f"command of {len(frames)} frames")
        env = framing.unpack(frames[0].buffer, framing.Request)
        cmd = _command_codec.decode_parts(env.body)
        if self._commands.full():
            self.reply(env.id, CommandResult(ok=False, error="actor command queue full"))
            return
        self._commands.put_nowait((env.id, cmd))
