"""Reliable delivery: at-least-once DEALER -> ROUTER with acks, redelivery and de-duplication,
for results that must not be lost (``GroupResult`` from rollout actors to the buffer).

Each message has a seq in its sender's stream (one sender incarnation; seqs from 1). The
sender keeps it until acknowledged and resends it; the receiver de-duplicates by
``(stream, seq)``. Both sides are bounded, so a stalled consumer stops its producers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections import deque
from collections.abc import Coroutine, Iterator
from typing import Any, Generic, TypeVar

import zmq
from zmq.utils.monitor import parse_monitor_message

from asyncrl.wire import framing
from asyncrl.wire.channels import ReceiveChannel, SendChannel
from asyncrl.wire.codec import WIRE_VERSION, Codec
from asyncrl.wire.errors import ChannelClosed, WireError, WouldBlock
from asyncrl.wire.ranges import RangeSet
from asyncrl.wire.sockets import abind, connect, make_socket, send_now

T = TypeVar("T")
_MAX_SEQ_AHEAD = 1 << 24  # a batch may start at most this far past a stream's newest seq
_MAX_RANGES = 4096  # a stream whose seen seqs fragment further is refused (hostile peer)


@dataclasses.dataclass(slots=True, eq=False)
class _OutBatch:
    """Consecutive messages ``first .. first + len(bodies) - 1`` awaiting their ack."""

    first: int
    bodies: list[bytes] = dataclasses.field(default_factory=list)
    buffers: list[list[memoryview]] | None = None  # None: no message has buffer frames
    nbytes: int = 0  # bodies and buffer frames: when to flush
    body_bytes: int = 0  # bodies only: the size of the envelope frame
    sent_at: float = 0.0
    attempts: int = 0
    queued: bool = False

    @property
    def last(self) -> int:
        return self.first + len(self.bodies) - 1


class ReliableSender(SendChannel[T]):
    """The sending side (DEALER; connects by default, ``IMMEDIATE`` so nothing queues on a
    half-open connection). Consecutive sends coalesce into one ``Batch`` until
    ``batch_bytes`` or the next event-loop turn: the unit of bookkeeping and resending, so
    a message costs an encode and an append. At most ``window`` messages are
    unacknowledged (``send`` waits, ``send_nowait`` raises ``WouldBlock``). A batch is
    resent after ``redeliver_after`` seconds unacknowledged (doubling per attempt up to
    ``max_redeliver_after``), and at once on a reconnect."""

    def __init__(
        self,
        endpoint: str,
        codec: Codec[T],
        *,
        window: int = 8192,
        batch_bytes: int = 256 * 1024,
        redeliver_after: float = 2.0,
        max_redeliver_after: float = 30.0,
        hwm: int = 1000,
        bind: bool = False,
        stream: str | None = None,
        name: str = "reliable",
        allow_remote: bool = False,
    ) -> None:
        super().__init__(name)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.endpoint = endpoint
        self.codec = codec
        self.window = window
        self.batch_bytes = min(batch_bytes, codec.max_frame_bytes)
        self.redeliver_after = redeliver_after
        self.max_redeliver_after = max_redeliver_after
        self.stream = stream or f"{name}-{uuid.uuid4().hex[:12]}"
        self._hwm, self._bind, self._allow_remote = hwm, bind, allow_remote
        self._open_batch: _OutBatch | None = None
        self._inflight: deque[_OutBatch] = deque()
        self._to_send: deque[_OutBatch] = deque()
        self._acked = RangeSet()
        self._unacked = 0
        self._next_seq = 1
        self._connections = 0
        self._flush_scheduled = False
        self._stalled = asyncio.Event()
        self._space = asyncio.Event()
        self._all_acked = asyncio.Event()
        self._all_acked.set()

    # -- lifecycle ------------------------------------------------------------------
    async def _open(self) -> None:
        self._sock = make_socket(
            zmq.DEALER,
            hwm=self._hwm,
            max_frame_bytes=self.codec.max_frame_bytes,
            routing_id=self.stream.encode(),
        )
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        if self._bind:
            self.endpoint = await abind(self._sock, self.endpoint, allow_remote=self._allow_remote)
        else:
            connect(self._sock, self.endpoint, allow_remote=self._allow_remote)

    def _background(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        return [
            (f"{self.stream}.acks", self._receive_each(self._sock, self._on_ack)),
            (f"{self.stream}.redeliver", self._redeliver_loop()),
            (f"{self.stream}.reconnect", self._reconnect_loop()),
            (f"{self.stream}.unstall", self._unstall_loop()),
        ]

    def _close_sockets(self) -> None:
        self._space.set()
        self._all_acked.set()  # wakes join(), which then reports what was left
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    # -- sending --------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Messages sent or queued but not yet acknowledged."""
        return self._unacked

    async def send(self, msg: T) -> None:
        """Queue ``msg``; waits while ``window`` messages are unacknowledged."""
        while self._unacked >= self.window:
            self._check_open()
            self._space.clear()
            await self._space.wait()
        self._enqueue(msg)

    def send_nowait(self, msg: T) -> None:
        """Queue ``msg`` or raise ``WouldBlock`` when the window is full."""
        if self._unacked >= self.window:
            self._check_open()
            raise WouldBlock(f"{self.stream}: {self.window} messages unacknowledged")
        self._enqueue(msg)

    async def join(self) -> None:
        """Wait until every message sent so far has been acknowledged.

        Raises ``ChannelClosed`` if the channel closes with messages still unacknowledged.
        """
        await self._all_acked.wait()
        if self._unacked:
            raise ChannelClosed(f"{self.stream} closed with {self._unacked} unacknowledged")

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelClosed(f"{self.stream} is closed")

    def _enqueue(self, msg: T) -> None:
        self._check_open()
        body, buffers = self.codec.encode_parts(msg)
        batch = self._open_batch
        if batch is not None and batch.body_bytes + len(body) > self.batch_bytes:
            self._flush()  # close it first: the envelope frame must stay within the limit
            batch = None
        if batch is None:
            batch = self._open_batch = _OutBatch(first=self._next_seq)
        if buffers and batch.buffers is None:
            batch.buffers = [[] for _ in batch.bodies]
        if batch.buffers is not None:
            batch.buffers.append(buffers)
            batch.nbytes += sum(b.nbytes for b in buffers)
        batch.bodies.append(body)
        batch.nbytes += len(body)
        batch.body_bytes += len(body)
        self._next_seq += 1
        self._unacked += 1
        self._all_acked.clear()
        if batch.nbytes >= self.batch_bytes:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Close the open batch and send every queued batch until the socket pushes back."""
        self._flush_scheduled = False
        if self._open_batch is not None:
            batch, self._open_batch = self._open_batch, None
            batch.queued = True
            self._inflight.append(batch)
            self._to_send.append(batch)
        if self._closed or self._stalled.is_set():
            return
        while self._to_send:
            if not self._transmit(self._to_send[0]):
                self._stalled.set()
                return
            self._to_send.popleft().queued = False

    def _transmit(self, batch: _OutBatch) -> bool:
        """Send the unacknowledged runs of ``batch``; False if the socket would block."""
        if not self._inflight or batch.last < self._inflight[0].first:
            return True  # acknowledged (and retired) while it waited to be resent
        runs = self._acked.missing(batch.first, batch.last) if self._acked else None
        if runs == []:
            return True
        if runs is None or runs == [(batch.first, batch.last)]:
            ok = self._send_run(batch, 0, len(batch.bodies))
        else:
            ok = all(
                self._send_run(batch, lo - batch.first, hi - batch.first + 1) for lo, hi in runs
            )
        if ok:
            if batch.attempts:
                self.stats.redelivered += len(batch.bodies)
            batch.sent_at, batch.attempts = time.monotonic(), batch.attempts + 1
        return ok

    def _send_run(self, batch: _OutBatch, start: int, stop: int) -> bool:
        bodies = batch.bodies[start:stop] if start or stop < len(batch.bodies) else batch.bodies
        buffers = batch.buffers[start:stop] if batch.buffers is not None else []
        nbufs = [len(b) for b in buffers]
        env = framing.pack_batch(self.stream, batch.first + start, nbufs, bodies)
        frames = [env, *(f for bufs in buffers for f in bufs)]
        if not send_now(self._sock, frames):
            return False
        self.stats.sent += stop - start
        self.stats.bytes_sent += len(env) + sum(f.nbytes for bufs in buffers for f in bufs)
        return True

    def _requeue(self, batches: list[_OutBatch]) -> None:
        for batch in batches:
            if not batch.queued:
                batch.queued = True
                self._to_send.append(batch)
        if batches and not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    # -- acknowledgements -----------------------------------------------------------
    def _apply_ack(self, ranges: list[tuple[int, int]]) -> None:
        if not self._inflight:
            return
        base, top = self._inflight[0].first, self._inflight[-1].last
        for lo, hi in ranges:
            # Clamp to live seqs: a hostile range like (0, 10**12) costs nothing.
            lo, hi = max(lo, base), min(hi, top)
            if lo > hi:
                continue
            self._unacked -= sum(b - a + 1 for a, b in self._acked.missing(lo, hi))
            self._acked.add(lo, hi)
        while self._inflight and self._acked.first_above(self._inflight[0].first - 1) >= (
            self._inflight[0].last
        ):
            self._inflight.popleft()
        self._acked.trim_below(self._inflight[0].first - 1 if self._inflight else top)
        if self._unacked < self.window:
            self._space.set()
        if not self._unacked:
            self._all_acked.set()

    # -- background loops -----------------------------------------------------------
    def _on_ack(self, frames: list[zmq.Frame]) -> None:
        ack = framing.unpack(frames[0].buffer, framing.Ack)
        if ack.stream != self.stream:  # not an answer to us: a stale or forged ack
            raise WireError(f"ack for stream {ack.stream!r}, this is {self.stream!r}")
        self._apply_ack(ack.ranges)

    async def _redeliver_loop(self) -> None:
        while True:
            await asyncio.sleep(self.redeliver_after / 4)
            now = time.monotonic()
            self._requeue(
                [
                    b
                    for b in self._inflight
                    if b.sent_at and now - b.sent_at >= self._timeout(b.attempts)
                ]
            )

    def _timeout(self, attempts: int) -> float:
        return min(self.redeliver_after * 2 ** max(attempts - 1, 0), self.max_redeliver_after)

    async def _reconnect_loop(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                continue
            self._connections += 1
            # The first connection needs nothing: unsent batches wait for the unstall
            # loop. On a reconnect, whatever sat in the old pipe is gone: resend it all.
            if self._connections > 1:
                self._to_send = deque(b for b in self._to_send if b.sent_at == 0.0)
                for b in self._inflight:
                    b.queued = b.sent_at == 0.0  # those kept above are queued already
                self._requeue(list(self._inflight))

    async def _unstall_loop(self) -> None:
        while True:
            await self._stalled.wait()
            await self._sock.poll(timeout=self.redeliver_after * 1000, flags=zmq.POLLOUT)
            self._stalled.clear()
            self._flush()


class Received(Generic[T]):
    """Consecutive messages of one stream (seqs ``first_seq ..``), delivered together."""

    __slots__ = ("first_seq", "msgs", "receiver", "stream")

    def __init__(
        self, msgs: list[T], stream: str, first_seq: int, receiver: ReliableReceiver[T]
    ) -> None:
        self.msgs, self.stream, self.first_seq, self.receiver = msgs, stream, first_seq, receiver

    def __len__(self) -> int:
        return len(self.msgs)

    def __iter__(self) -> Iterator[T]:
        return iter(self.msgs)

    def ack(self) -> None:
        """Release every message of the batch at the sender. Idempotent."""
        self.receiver._ack(self.stream, self.first_seq, self.first_seq + len(self.msgs) - 1)


class Delivery(Generic[T]):
    """One received message; call ``ack()`` once it has been processed."""

    __slots__ = ("msg", "receiver", "seq", "stream")

    def __init__(self, msg: T, stream: str, seq: int, receiver: ReliableReceiver[T]) -> None:
        self.msg, self.stream, self.seq, self.receiver = msg, stream, seq, receiver

    def ack(self) -> None:
        """Release the message at the sender. Idempotent."""
        self.receiver._ack(self.stream, self.seq, self.seq)


@dataclasses.dataclass(slots=True)
class _StreamState:
    seen: RangeSet = dataclasses.field(default_factory=RangeSet)  # received (maybe queued)
    delivered: RangeSet = dataclasses.field(default_factory=RangeSet)  # handed to the app
    unacked: RangeSet = dataclasses.field(default_factory=RangeSet)
    to_ack: RangeSet = dataclasses.field(default_factory=RangeSet)
    route: bytes = b""
    queued: int = 0  # received, not yet handed to the application
    last_active: float = dataclasses.field(default_factory=time.monotonic)

    def idle(self) -> bool:
        return not self.queued and not self.unacked and not self.to_ack


class ReliableReceiver(ReceiveChannel[Delivery[T]]):
    """The receiving side (ROUTER, binds): hands each message out once, in a ``Received``
    batch (``receive_batch``) or alone (``receive``); ``ack()`` after processing releases
    it at the sender, in any order. A duplicate of an acknowledged message is acknowledged
    again (the first ack was lost); a malformed one is dropped, counted and acknowledged.
    Past ``max_queued`` waiting messages the socket is not read, and zmq's HWM and the
    senders' windows stop them. For exactly-once processing across a restart, save
    ``dedup_state()`` with the state the delivered messages changed and pass it back."""

    def __init__(
        self,
        endpoint: str,
        codec: Codec[T],
        *,
        max_queued: int = 16384,
        hwm: int = 1000,
        bind: bool = True,
        name: str = "reliable",
        dedup_state: dict[str, list[tuple[int, int]]] | None = None,
        max_streams: int = 1024,
        stream_idle_seconds: float = 600.0,
        allow_remote: bool = False,
    ) -> None:
        super().__init__(name)
        self.endpoint = endpoint
        self.codec = codec
        self.max_queued = max_queued
        self.max_streams = max_streams
        self.stream_idle_seconds = stream_idle_seconds
        self._hwm, self._bind, self._allow_remote = hwm, bind, allow_remote
        self._queue: deque[Received[T]] = deque()
        self._queued = 0
        self._head = 0  # messages of self._queue[0] already handed out by receive()
        self._streams: dict[str, _StreamState] = {}
        self._dirty: set[str] = set()
        self._ack_scheduled = False
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        for stream, ranges in (dedup_state or {}).items():
            self._streams[stream] = _StreamState(seen=RangeSet(ranges), delivered=RangeSet(ranges))

    async def _open(self) -> None:
        self._sock = make_socket(
            zmq.ROUTER, hwm=self._hwm, max_frame_bytes=self.codec.max_frame_bytes
        )
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self._bind:
            self.endpoint = await abind(self._sock, self.endpoint, allow_remote=self._allow_remote)
        else:
            connect(self._sock, self.endpoint, allow_remote=self._allow_remote)

    def _background(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        return [("reliable.read", self._read_loop())]

    def _close_sockets(self) -> None:
        self._ready.set()
        self._sock.close(linger=0)

    # -- receiving ------------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Messages received and not yet handed out."""
        return self._queued

    async def receive(self) -> Delivery[T]:
        """The next message, in arrival order."""
        await self._wait_ready()
        return self.receive_nowait()

    def receive_nowait(self) -> Delivery[T]:
        """The next message or ``WouldBlock``."""
        self._check_ready()
        head = self._queue[0]
        seq, msg = head.first_seq + self._head, head.msgs[self._head]
        self._head += 1
        if self._head == len(head.msgs):
            self._queue.popleft()
            self._head = 0
        self._took(head.stream, seq, 1)
        return Delivery(msg, head.stream, seq, self)

    async def receive_batch(self) -> Received[T]:
        """The next run of consecutive messages of one stream (cheapest per message)."""
        await self._wait_ready()
        head = self._queue.popleft()
        if self._head:
            head = Received(head.msgs[self._head :], head.stream, head.first_seq + self._head, self)
            self._head = 0
        self._took(head.stream, head.first_seq, len(head.msgs))
        return head

    async def _wait_ready(self) -> None:
        while not self._queue:
            if self._closed:
                raise ChannelClosed("reliable receiver is closed")
            self._ready.clear()
            await self._ready.wait()

    def _check_ready(self) -> None:
        if not self._queue:
            if self._closed:
                raise ChannelClosed("reliable receiver is closed")
            raise WouldBlock("no message queued")

    def _took(self, stream: str, first: int, n: int) -> None:
        st = self._streams[stream]
        st.delivered.add(first, first + n - 1)
        st.queued -= n
        self._queued -= n
        if self._queued < self.max_queued:
            self._room.set()

    def dedup_state(self) -> dict[str, list[tuple[int, int]]]:
        """``{stream: seq ranges handed to the application}``.

        Save it together with the state those messages changed. Messages still queued in
        the channel are not in it: after a restart they are delivered again, once.
        """
        return {s: list(st.delivered) for s, st in self._streams.items() if st.delivered}

    # -- acks -----------------------------------------------------------------------
    def _ack(self, stream: str, lo: int, hi: int) -> None:
        st = self._streams.get(stream)
        if st is None:
            return
        st.unacked.remove(lo, hi)
        self._queue_ack(stream, st, lo, hi)

    def _queue_ack(self, stream: str, st: _StreamState, lo: int, hi: int) -> None:
        st.to_ack.add(lo, hi)
        self._dirty.add(stream)
        if not self._ack_scheduled:
            self._ack_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_acks)

    def _flush_acks(self) -> None:
        self._ack_scheduled = False
        if self._closed:
            return
        for stream in self._dirty:
            st = self._streams[stream]
            env = framing.Ack(v=WIRE_VERSION, stream=stream, ranges=list(st.to_ack))
            # A lost ack heals itself: the sender resends and the duplicate is re-acked.
            send_now(self._sock, [st.route, framing.pack(env)])
            st.to_ack = RangeSet()
        self._dirty.clear()

    # -- reading --------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            if self._queued >= self.max_queued:
                self._room.clear()
                await self._room.wait()
            frames = await self._sock.recv_multipart(copy=False)
            self._handle(frames)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        limit = self.codec.max_frame_bytes
        if len(frames) < 2 or any(len(f) > limit + framing.ENVELOPE_SLACK for f in frames[1:]):
            self._drops.drop("bad_frames", f"{len(frames)} frames or one over {limit} bytes")
            return
        before = self._queued
        self._handle_batch(frames)
        if self._queued > before:
            self._ready.set()

    def _handle_batch(self, frames: list[zmq.Frame]) -> None:
        try:
            batch = framing.unpack(frames[1].buffer, framing.Batch)
        except WireError as exc:
            self._drops.drop("malformed", str(exc))
            return
        st = self._stream(batch.stream, frames[0].bytes)
        if st is None:
            return
        if not batch.nbufs and len(frames) == 2:
            try:  # the common case: no buffer frames, the whole batch in one decode
                msgs = self.codec.decode_many(batch.items)
            except WireError:
                pass  # decode item by item below, to drop only the bad ones
            else:
                for lo, hi in self._admit(batch.stream, st, batch.first_seq, len(msgs)):
                    first = batch.first_seq
                    self._deliver(batch.stream, st, lo, msgs[lo - first : hi + 1 - first])
                return
        self._handle_items(batch, st, frames[2:])

    def _handle_items(self, batch: framing.Batch, st: _StreamState, bufs: list[zmq.Frame]) -> None:
        try:
            items = framing.batch_items(batch.items)
            nbufs = batch.nbufs or [0] * len(items)
            if len(nbufs) != len(items):
                raise WireError(f"{len(nbufs)} buffer counts for {len(items)} messages")
            parts = framing.split_buffers(bufs, nbufs)
        except WireError as exc:
            self._drops.drop("malformed", str(exc))
            return
        for lo, hi in self._admit(batch.stream, st, batch.first_seq, len(items)):
            run: list[T] = []
            for seq in range(lo, hi + 1):
                i = seq - batch.first_seq
                try:
                    buffers = [f.buffer for f in parts[i]] if parts[i] else ()
                    run.append(self.codec.decode_parts(items[i], buffers))
                except WireError as exc:
                    self._drops.drop("malformed", str(exc), stream=batch.stream, seq=seq)
                    self._deliver(batch.stream, st, seq - len(run), run)
                    self._queue_ack(batch.stream, st, seq, seq)
                    run = []
            self._deliver(batch.stream, st, hi + 1 - len(run), run)

    def _stream(self, stream: str, route: bytes) -> _StreamState | None:
        """The state of ``stream``; None when a new stream would pass ``max_streams``."""
        st = self._streams.get(stream)
        if st is None:
            if len(self._streams) >= self.max_streams and not self._evict_idle_stream():
                self._drops.drop(
                    "too_many_streams", f"{len(self._streams)} streams live", stream=stream
                )
                return None
            st = self._streams[stream] = _StreamState()
        st.route, st.last_active = route, time.monotonic()
        return st

    def _evict_idle_stream(self) -> bool:
        """Forget the longest-silent stream with nothing pending, if silent long enough.

        A sender silent for ``stream_idle_seconds`` with everything acknowledged has no
        retransmission left (redelivery backs off to 30 s at most), so its seqs cannot
        come back as duplicates.
        """
        horizon = time.monotonic() - self.stream_idle_seconds
        idle = [
            (st.last_active, name)
            for name, st in self._streams.items()
            if st.idle() and st.last_active < horizon
        ]
        if not idle:
            return False
        del self._streams[min(idle)[1]]
        return True

    def _admit(self, stream: str, st: _StreamState, first: int, n: int) -> list[tuple[int, int]]:
        """Mark ``first .. first+n-1`` seen; return the runs that are new.

        Duplicates of acknowledged messages are acknowledged again.
        """
        last, top = first + n - 1, st.seen.max()
        # A new stream (or one restored without state) is anchored where it starts.
        if first < 1 or (top is not None and last > top + _MAX_SEQ_AHEAD):
            self._drops.drop("bad_seq", f"seqs {first}..{last} outside window", stream=stream)
            return []
        if len(st.seen) > _MAX_RANGES:
            self._drops.drop("fragmented", f"{len(st.seen)} seq ranges", stream=stream)
            return []
        new = st.seen.missing(first, last)
        if new != [(first, last)]:
            self._reack_duplicates(stream, st, first, last, new)
        st.seen.add(first, last)
        return new

    def _reack_duplicates(
        self, stream: str, st: _StreamState, first: int, last: int, new: list[tuple[int, int]]
    ) -> None:
        dups = RangeSet([(first, last)])
        for lo, hi in new:
            dups.remove(lo, hi)
        self.stats.duplicates += dups.count()
        for a, b in dups:
            # Seen but not awaiting an ack from the application: the ack was lost.
            for lo, hi in st.unacked.missing(a, b):
                self._queue_ack(stream, st, lo, hi)

    def _deliver(self, stream: str, st: _StreamState, first: int, msgs: list[T]) -> None:
        if not msgs:
            return
        st.unacked.add(first, first + len(msgs) - 1)
        self.stats.received += len(msgs)
        st.queued += len(msgs)
        self._queued += len(msgs)
        self._queue.append(Received(msgs, stream, first, self))
