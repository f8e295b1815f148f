"""Envelopes: the channel-level frame kinds that wrap encoded messages.

A zmq message on any asyncrl socket is ``[envelope, *buffers]`` (a ROUTER prepends the
peer's routing id). Message bodies sit in the envelope as ``Raw`` bytes, decoded apart by
the channel's ``Codec``, so one malformed message in a batch is dropped alone.

| kind       | socket pattern       | carries                                           |
|------------|----------------------|---------------------------------------------------|
| ``Batch``  | DEALER -> ROUTER     | consecutive reliable messages of one stream       |
| ``Ack``    | ROUTER -> DEALER     | processed seq ranges of one stream                |
| ``Request``| DEALER -> ROUTER     | an RPC call with its id                           |
| ``Reply``  | ROUTER -> DEALER     | the result or the error text for that id          |
| ``Publish``| PUB -> SUB           | ``(epoch, topic, seq, body)`` latest-wins updates |
| ``Beat``   | PUB -> SUB           | current seq per topic, so a lost tail is detected |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from msgspec import Raw, msgpack

from asyncrl.wire.codec import WIRE_VERSION
from asyncrl.wire.errors import WireError


class Envelope(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """Base of the frame kinds; ``v`` is the framing version."""

    v: int


class Batch(Envelope, tag="B"):
    """Consecutive reliable messages of one sender stream, seqs ``first_seq + i``.

    ``nbufs[i]`` is the number of buffer frames of message ``i``; an empty list means
    none has any (the common case, which the receiver decodes in a single call).
    ``items`` is the undecoded MessagePack array of message bodies (``batch_items`` splits
    it when the messages must be decoded one by one).
    """

    stream: str
    first_seq: int
    nbufs: list[int]
    items: Raw


class Ack(Envelope, tag="A"):
    """Seqs of ``stream`` that the receiver has processed, as inclusive ranges."""

    stream: str
    ranges: list[tuple[int, int]]


class Request(Envelope, tag="Q"):
    """An RPC call; ``id`` is unique among the caller's outstanding calls."""

    id: int
    nbuf: int
    body: Raw


class Reply(Envelope, tag="R"):
    """The answer to ``Request.id``: a body, or an error text when the handler raised.

    ``body`` is MessagePack nil when ``error`` is set (msgspec cannot union ``Raw``).
    """

    id: int
    nbuf: int
    body: Raw
    error: str | None


class Publish(Envelope, tag="P"):
    """A pub/sub update. ``epoch`` changes when the publisher restarts."""

    epoch: int
    topic: str
    seq: int
    nbuf: int
    body: Raw


class Beat(Envelope, tag="H"):
    """Publisher liveness: the newest seq of every topic."""

    epoch: int
    seqs: dict[str, int]


def pack_batch(stream: str, first_seq: int, nbufs: list[int], bodies: Sequence[bytes]) -> bytes:
    """Encode a ``Batch`` by joining already-encoded bodies (no per-message objects).

    Equal to ``pack(Batch(..., items=Raw(pack([Raw(b) for b in bodies]))))``, byte for byte.
    """
    head = _encoder.encode(("B", WIRE_VERSION, stream, first_seq, nbufs))
    n = len(bodies)
    if n < 16:
        count = bytes((0x90 | n,))
    elif n < 1 << 16:
        count = b"\xdc" + n.to_bytes(2, "big")
    else:
        count = b"\xdd" + n.to_bytes(4, "big")
    # head is a 5-element fixarray (0x95); the batch is the same array with 6 elements.
    return b"\x96" + head[1:] + count + b"".join(bodies)


NIL = Raw(b"\xc0")
#: How far an envelope frame may exceed ``max_frame_bytes``: the envelope's own fields.
ENVELOPE_SLACK = 64 * 1024
AnyEnvelope = Batch | Ack | Request | Reply | Publish | Beat
_encoder = msgpack.Encoder()
_decoder = msgpack.Decoder(AnyEnvelope)
_items_decoder = msgpack.Decoder(list[Raw])


def pack(env: Envelope) -> bytes:
    """Encode an envelope."""
    return _encoder.encode(env)


def unpack(frame: Any, expected: type | tuple[type, ...]) -> Any:
    """Decode and type-check an envelope; raises ``WireError`` with the reason."""
    try:
        env = _decoder.decode(frame)
    except (msgspec.MsgspecError, UnicodeDecodeError) as exc:
        raise WireError(f"malformed envelope: {exc}") from None
    if env.v != WIRE_VERSION:
        raise WireError(f"peer speaks wire version {env.v}, this side {WIRE_VERSION}")
    if not isinstance(env, expected):
        raise WireError(f"unexpected {type(env).__name__} frame on this socket")
    return env


def batch_items(items: Raw) -> list[Raw]:
    """The message bodies of a ``Batch``, one ``Raw`` each; raises ``WireError``."""
    try:
        return _items_decoder.decode(items)
    except msgspec.MsgspecError as exc:
        raise WireError(f"malformed batch items: {exc}") from None


def split_buffers(frames: Sequence[Any], counts: Sequence[int]) -> list[Sequence[Any]]:
    """Cut the buffer frames after an envelope into per-message slices by ``counts``."""
    total = sum(counts)
    if total != len(frames) or min(counts, default=0) < 0:
        raise WireError(f"envelope announces {total} buffers, {len(frames)} arrived")
    if not total:
        return [()] * len(counts)
    out, start = [], 0
    for n in counts:
        out.append(frames[start : start + n])
        start += n
    return out
