"""The channel contracts: a ``SendChannel[T]`` / ``ReceiveChannel[T]`` pair.

Channels are async context managers: entering starts their background tasks in a
``TaskGroup`` owned by the entering task, leaving cancels and joins them, so a channel
never outlives the actor that opened it. Errors: ``asyncrl.wire.errors``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import structlog
import zmq
import zmq.asyncio

from asyncrl.wire.errors import ChannelClosed, EndOfStream, WireError

T = TypeVar("T")
log = structlog.get_logger("asyncrl.wire")


@dataclasses.dataclass
class ChannelStats:
    """Counters every channel keeps; ``snapshot()`` is what goes into heartbeats."""

    sent: int = 0
    received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    redelivered: int = 0
    duplicates: int = 0
    dropped: Counter[str] = dataclasses.field(default_factory=Counter)

    def snapshot(self) -> dict[str, int]:
        """Flat ``{name: count}`` including ``dropped.<reason>`` entries."""
        flat = {k: v for k, v in dataclasses.asdict(self).items() if k != "dropped"}
        flat["dropped"] = sum(self.dropped.values())
        flat.update({f"dropped.{reason}": n for reason, n in self.dropped.items()})
        return flat


class DropLog:
    """Counts dropped frames by reason and logs the first few of each, then 1 in 1000.

    A peer sending garbage must not turn the log into a denial of service.
    """

    def __init__(self, channel: str, stats: ChannelStats) -> None:
        self.channel = channel
        self.stats = stats

    def drop(self, reason: str, detail: str, **context: object) -> None:
        """Record one dropped frame or message with its reason."""
        self.stats.dropped[reason] += 1
        n = self.stats.dropped[reason]
        if n <= 5 or n % 1000 == 0:
            log.warning(
                "frame dropped",
                channel=self.channel,
                reason=reason,
                detail=detail,
                count=n,
                **context,
            )


class _Channel(ABC):
    """Shared lifecycle: background tasks under a TaskGroup entered by ``__aenter__``."""

    def __init__(self, name: str) -> None:
        self.stats = ChannelStats()
        self._drops = DropLog(name, self.stats)
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    async def __aenter__(self) -> Self:
        await self._open()
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        for name, coro in self._background():
            self._spawn(coro, name)
        return self

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Start a task that closing the channel cancels (background loops, handlers)."""
        assert self._tg is not None, "channel is not open"
        task = self._tg.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self._closed = True
        assert self._tg is not None
        for task in list(self._tasks):
            task.cancel()
        try:
            if et is not None and issubclass(et, Exception):
                # The body's own error reaches the caller unwrapped; only what the
                # channel's tasks raised would form an ExceptionGroup.
                await self._tg.__aexit__(None, None, None)
                return None
            return await self._tg.__aexit__(et, exc, tb)
        finally:
            self._close_sockets()

    async def aclose(self) -> None:
        """Close without an ``async with`` block (the block is preferred)."""
        await self.__aexit__(None, None, None)

    @property
    def closed(self) -> bool:
        """True once this side has closed the channel."""
        return self._closed

    async def _receive_each(
        self, sock: zmq.asyncio.Socket, handle: Callable[[list[zmq.Frame]], None]
    ) -> None:
        """Feed every incoming message to ``handle``; a ``WireError`` drops and counts it.

        The one place where malformed input is turned into a logged, counted drop, so that
        no frame can stop a channel's reader.
        """
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                handle(frames)
            except WireError as exc:
                self._drops.drop("malformed", str(exc))

    @abstractmethod
    async def _open(self) -> None:
        """Create and bind or connect sockets."""

    def _background(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        """Named coroutines to run while the channel is open."""
        return []

    @abstractmethod
    def _close_sockets(self) -> None:
        """Close every socket (linger 0)."""


class SendChannel(_Channel, Generic[T]):
    """The sending half: ``await send(msg)`` waits for capacity; ``send_nowait`` does not."""

    @abstractmethod
    async def send(self, msg: T) -> None:
        """Send ``msg``, waiting while the channel is at its high-water mark."""

    @abstractmethod
    def send_nowait(self, msg: T) -> None:
        """Send ``msg`` or raise ``WouldBlock`` if that would require waiting."""


class ReceiveChannel(_Channel, Generic[T]):
    """The receiving half: ``await receive()`` or ``async for item in channel``."""

    @abstractmethod
    async def receive(self) -> T:
        """The next item, waiting for one; raises ``ChannelClosed`` after close."""

    @abstractmethod
    def receive_nowait(self) -> T:
        """The next item or ``WouldBlock``."""

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except (ChannelClosed, EndOfStream):
            raise StopAsyncIteration from None
