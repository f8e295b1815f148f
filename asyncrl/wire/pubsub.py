"""Publish/subscribe of latest-wins state with sequence numbers: ``Publisher`` and ``Subscriber``.

PUB/SUB is lossy by design (a subscriber's queue past ``hwm``, a late joiner), so each
topic's updates carry seqs ``1, 2, ...`` and the publisher an ``epoch`` (random at start):
a subscriber knows what it missed (``Update.skipped``), and the newest update of a topic
can always be fetched again from the publisher's snapshot socket. Nothing is missed silently.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from typing import Any, Generic, TypeVar

import msgspec
import zmq
from msgspec import Raw

from asyncrl.wire import framing
from asyncrl.wire.channels import ReceiveChannel, _Channel
from asyncrl.wire.codec import WIRE_VERSION, Codec
from asyncrl.wire.errors import ChannelClosed, WireError, WouldBlock
from asyncrl.wire.sockets import abind, connect, make_socket, send_now

T = TypeVar("T")
_BEAT_TOPIC = b"\x00beat"
_topic_encoder = msgspec.msgpack.Encoder()
_topic_decoder = msgspec.msgpack.Decoder(str)


def _topic_frame(topic: str) -> bytes:
    if not topic or "\x00" in topic:
        raise ValueError(f"topic must be a non-empty string without NUL, got {topic!r}")
    # NUL-terminated so that SUB's prefix match is an exact match ("w" never gets "w2").
    return topic.encode() + b"\x00"


@dataclasses.dataclass(frozen=True, slots=True)
class Update(Generic[T]):
    """One delivered update of ``topic``; ``skipped`` updates before it were never delivered."""

    topic: str
    seq: int
    msg: T
    skipped: int
    epoch: int


class Publisher(_Channel, Generic[T]):
    """Publishes latest-wins updates per topic and serves the latest on request (ROUTER,
    the snapshot endpoint); a ``Beat`` every ``beat_interval`` carries each topic's seq."""

    def __init__(
        self,
        endpoint: str,
        snapshot_endpoint: str,
        codec: Codec[T],
        *,
        beat_interval: float = 1.0,
        hwm: int = 1000,
        name: str = "pub",
        allow_remote: bool = False,
    ) -> None:
        super().__init__(name)
        self.endpoint, self.snapshot_endpoint = endpoint, snapshot_endpoint
        self.codec = codec
        self.beat_interval = beat_interval
        self.epoch = int.from_bytes(os.urandom(6), "big")
        self._hwm, self._allow_remote, self._name = hwm, allow_remote, name
        self._latest: dict[str, tuple[int, bytes, list[memoryview]]] = {}

    async def _open(self) -> None:
        self._pub = make_socket(zmq.PUB, hwm=self._hwm)
        # Only small topic requests ever come in on the snapshot socket.
        self._snap = make_socket(zmq.ROUTER, hwm=self._hwm, max_frame_bytes=64 * 1024)
        self.endpoint = await abind(self._pub, self.endpoint, allow_remote=self._allow_remote)
        self.snapshot_endpoint = await abind(
            self._snap, self.snapshot_endpoint, allow_remote=self._allow_remote
        )

    def _background(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        return [
            (f"{self._name}.beat", self._beat_loop()),
            (f"{self._name}.snap", self._receive_each(self._snap, self._on_snapshot_request)),
        ]

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        self._snap.close(linger=0)

    def publish(self, topic: str, msg: T) -> int:
        """Publish ``msg`` as the new state of ``topic``; returns its seq. Never blocks."""
        if self._closed:
            raise ChannelClosed("publisher is closed")
        frame = _topic_frame(topic)
        body, buffers = self.codec.encode_parts(msg)
        seq = self._latest.get(topic, (0,))[0] + 1
        self._latest[topic] = (seq, body, buffers)
        self._send(self._pub, [frame, *self._publish_frames(topic)])
        return seq

    def _publish_frames(self, topic: str) -> list[Any]:
        seq, body, buffers = self._latest.get(topic, (0, b"\xc0", []))
        env = framing.Publish(
            v=WIRE_VERSION,
            epoch=self.epoch,
            topic=topic,
            seq=seq,
            nbuf=len(buffers),
            body=Raw(body),
        )
        return [framing.pack(env), *buffers]

    def _send(self, sock: zmq.asyncio.Socket, frames: list[Any]) -> None:
        if send_now(sock, frames):
            self.stats.sent += 1
        else:  # pragma: no cover - PUB never blocks; ROUTER drops unroutable replies
            self._drops.drop("blocked", "socket would block")

    async def _beat_loop(self) -> None:
        while True:
            seqs = {topic: entry[0] for topic, entry in self._latest.items()}
            beat = framing.Beat(v=WIRE_VERSION, epoch=self.epoch, seqs=seqs)
            send_now(self._pub, [_BEAT_TOPIC, framing.pack(beat)])
            await asyncio.sleep(self.beat_interval)

    def _on_snapshot_request(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            raise WireError(f"snapshot request of {len(frames)} frames")
        req = framing.unpack(frames[1].buffer, framing.Request)
        try:
            topic = _topic_decoder.decode(req.body)
        except (msgspec.MsgspecError, UnicodeDecodeError) as exc:
            raise WireError(f"bad snapshot topic: {exc}") from None
        self._send(self._snap, [frames[0].bytes, *self._publish_frames(topic)])


@dataclasses.dataclass(slots=True)
class _TopicState:
    epoch: int = 0
    seq: int = 0
    asked_at: float = 0.0


class Subscriber(ReceiveChannel[Update[T]]):
    """Receives the updates of ``topics``.

    It asks for a topic's latest update on joining (no slow-joiner window) and whenever a
    ``Beat`` shows a newer seq than it saw (the newest update itself was lost). Delivery is
    conflated: at most one pending update per topic, a newer one replaces it (its
    ``skipped`` grows), so memory is bounded by the number of topics. A new ``epoch`` (the
    publisher restarted) resets a topic's seq.
    """

    def __init__(
        self,
        endpoint: str,
        snapshot_endpoint: str,
        codec: Codec[T],
        topics: Sequence[str],
        *,
        hwm: int = 1000,
        snapshot_retry: float = 1.0,
        name: str = "sub",
        allow_remote: bool = False,
    ) -> None:
        super().__init__(name)
        if not topics:
            raise ValueError("a subscriber needs at least one topic")
        self.endpoint, self.snapshot_endpoint = endpoint, snapshot_endpoint
        self.codec = codec
        self.topics = list(topics)
        self.snapshot_retry = snapshot_retry
        self.gaps = 0
        self._hwm, self._allow_remote, self._name = hwm, allow_remote, name
        self._state = {t: _TopicState() for t in self.topics}
        self._pending: OrderedDict[str, Update[T]] = OrderedDict()
        self._latest: dict[str, Update[T]] = {}
        self._ready = asyncio.Event()

    async def _open(self) -> None:
        self._sub = make_socket(zmq.SUB, hwm=self._hwm, max_frame_bytes=self.codec.max_frame_bytes)
        self._snap = make_socket(
            zmq.DEALER, hwm=self._hwm, max_frame_bytes=self.codec.max_frame_bytes
        )
        for topic in self.topics:
            self._sub.setsockopt(zmq.SUBSCRIBE, _topic_frame(topic))
        self._sub.setsockopt(zmq.SUBSCRIBE, _BEAT_TOPIC)
        connect(self._sub, self.endpoint, allow_remote=self._allow_remote)
        connect(self._snap, self.snapshot_endpoint, allow_remote=self._allow_remote)
        for topic in self.topics:  # late joiners start from the latest state
            self._ask_snapshot(topic)

    def _background(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        return [
            (
                f"{self._name}.updates",
                self._receive_each(self._sub, lambda frames: self._on_update(frames[1:])),
            ),
            (f"{self._name}.snapshots", self._receive_each(self._snap, self._on_update)),
        ]

    def _close_sockets(self) -> None:
        self._ready.set()
        self._sub.close(linger=0)
        self._snap.close(linger=0)

    # -- receiving ------------------------------------------------------------------
    async def receive(self) -> Update[T]:
        """The oldest pending update (one per topic at most)."""
        while not self._pending:
            if self._closed:
                raise ChannelClosed("subscriber is closed")
            self._ready.clear()
            await self._ready.wait()
        return self._pending.popitem(last=False)[1]

    def receive_nowait(self) -> Update[T]:
        """The oldest pending update or ``WouldBlock``."""
        if not self._pending:
            if self._closed:
                raise ChannelClosed("subscriber is closed")
            raise WouldBlock("no pending update")
        return self._pending.popitem(last=False)[1]

    def latest(self, topic: str) -> Update[T] | None:
        """The newest update of ``topic`` received so far, delivered or not."""
        return self._latest.get(topic)

    # -- internals --------------------------------------------------------------------
    def _ask_snapshot(self, topic: str) -> None:
        st = self._state[topic]
        now = time.monotonic()
        if now - st.asked_at < self.snapshot_retry:
            return  # one outstanding request per topic and retry period
        st.asked_at = now
        req = framing.Request(v=WIRE_VERSION, id=0, nbuf=0, body=Raw(_topic_encoder.encode(topic)))
        send_now(self._snap, [framing.pack(req)])

    def _on_update(self, frames: list[zmq.Frame]) -> None:
        """A PUB message (topic frame first) or a snapshot reply (no topic frame)."""
        if not frames:
            raise WireError("empty message")
        env = framing.unpack(frames[0].buffer, (framing.Publish, framing.Beat))
        if isinstance(env, framing.Beat):
            self._on_beat(env)
        else:
            self._on_publish(env, frames[1:])

    def _on_beat(self, beat: framing.Beat) -> None:
        for topic, st in self._state.items():
            if beat.epoch != st.epoch or beat.seqs.get(topic, 0) > st.seq:
                if beat.seqs.get(topic, 0) > 0:
                    self._ask_snapshot(topic)

    def _on_publish(self, env: framing.Publish, buffers: list[zmq.Frame]) -> None:
        st = self._state.get(env.topic)
        if st is None or env.seq == 0:
            return  # not ours, or a snapshot of a topic with nothing published yet
        if env.epoch == st.epoch and env.seq <= st.seq:
            self.stats.duplicates += 1
            return
        if env.nbuf != len(buffers):
            raise WireError(f"update announces {env.nbuf} buffers, {len(buffers)} came")
        msg = self.codec.decode_parts(env.body, [f.buffer for f in buffers])
        if env.epoch == st.epoch:
            skipped = env.seq - st.seq - 1 if st.seq else 0
        else:  # the publisher restarted: its updates before this one were never seen
            skipped = env.seq - 1 if st.epoch else 0
        if skipped:
            self.gaps += 1
        st.epoch, st.seq = env.epoch, env.seq
        previous = self._pending.pop(env.topic, None)
        if previous is not None:  # conflated: the app never saw `previous`
            skipped += previous.skipped + 1
        update = Update(env.topic, env.seq, msg, skipped, env.epoch)
        self._pending[env.topic] = update
        self._latest[env.topic] = update
        self.stats.received += 1
        self._ready.set()
