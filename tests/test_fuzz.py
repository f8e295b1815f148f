"""Fuzz: 10,000 random and mutated messages into each channel endpoint.

Bound ends: the reliable results channel, RPC, the control server, the weights broadcast's
snapshot service, the blob server. Connecting ends: a subscriber fed by a hostile
publisher, a reliable sender fed hostile acks. Nothing crashes; every message is
accounted for (dropped with a reason, or, for a mutation that still decodes, handled as a
valid message or a duplicate); the channel serves a well-behaved peer afterwards. Found by
these: RPC handler errors were logged once per request (now the first ten, then one in a
thousand), and a sender applied acks addressed to another stream (now dropped).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import numpy as np
import torch
import zmq
import zmq.asyncio

from asyncrl.wire import framing
from asyncrl.wire.blob import BlobClient, BlobServer
from asyncrl.wire.channels import ChannelStats
from asyncrl.wire.codec import WIRE_VERSION, Codec
from asyncrl.wire.control import ControlLink, ControlServer
from asyncrl.wire.messages import (
    Command,
    CommandResult,
    FetchChunk,
    FetchDone,
    FetchManifest,
    Heartbeat,
    WeightVersion,
)
from asyncrl.wire.pubsub import Publisher, Subscriber
from asyncrl.wire.reliable import ReliableReceiver, ReliableSender
from asyncrl.wire.rpc import RpcClient, RpcServer
from tests.test_reliable import CODEC, item

N = 10_000
REQ, REP = Codec(Command), Codec(CommandResult)


def mutations(seeds: list[list[bytes]], rng: random.Random, n: int) -> list[list[bytes]]:
    """``n`` multipart messages: random bytes, and valid ones bit-flipped, truncated,
    extended, spliced or re-framed."""
    out: list[list[bytes]] = []
    for _ in range(n):
        kind = rng.randrange(6)
        if kind == 0:
            out.append([rng.randbytes(rng.randrange(0, 300))])
            continue
        frames = [bytearray(f) for f in rng.choice(seeds)]
        target = frames[rng.randrange(len(frames))]
        if kind == 1 and target:  # flip a few bits
            for _ in range(rng.randrange(1, 4)):
                target[rng.randrange(len(target))] ^= 1 << rng.randrange(8)
        elif kind == 2:  # truncate
            del target[rng.randrange(len(target) + 1) :]
        elif kind == 3:  # append junk
            target += rng.randbytes(rng.randrange(1, 64))
        elif kind == 4:  # splice random bytes in
            at = rng.randrange(len(target) + 1)
            target[at:at] = rng.randbytes(rng.randrange(1, 16))
        else:  # wrong frame count
            frames = [*frames, bytearray(rng.randbytes(8))] if rng.random() < 0.5 else []
        out.append([bytes(f) for f in frames] or [b""])
    return out


def handled(stats: ChannelStats) -> int:
    """Messages a channel took: dropped with a reason, received as valid, or recognised
    as a duplicate of one already delivered."""
    return sum(stats.dropped.values()) + stats.received + stats.duplicates


@asynccontextmanager
async def flooding(endpoint: str, messages: list[list[bytes]]) -> AsyncIterator[None]:
    """Send ``messages`` from one peer and keep it connected, reading whatever comes back,
    for the ``with`` body (closing a socket with unread replies loses its unsent queue)."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)

    async def drain() -> None:
        while True:
            await sock.recv_multipart()

    reader = asyncio.create_task(drain())
    try:
        for frames in messages:
            await sock.send_multipart(frames)
        yield
    finally:
        reader.cancel()
        sock.close()


async def until(
    condition: Callable[[], bool], limit_s: float = 60.0, stats: ChannelStats | None = None
) -> None:
    try:
        async with asyncio.timeout(limit_s):
            while True:  # polling counters: no event to wait on
                if condition():
                    return
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not reached; channel stats: {stats}") from None


def request(body: bytes, nbuf: int = 0, rid: int = 1) -> bytes:
    return framing.pack(framing.Request(v=WIRE_VERSION, id=rid, nbuf=nbuf, body=msgspec.Raw(body)))


async def test_the_reliable_channel_survives_and_counts_every_fuzzed_message(endpoint: str):
    rng = random.Random(1)
    body = CODEC.encode(item(7))[0]
    seeds = [[framing.pack_batch(f"s{i}", 1 + i, [], [body] * (1 + i % 3))] for i in range(4)]
    async with ReliableReceiver(endpoint, CODEC) as rx:
        seen: list[int] = []

        async def consume() -> None:  # the receiver stops reading when its queue is full
            while True:
                batch = await rx.receive_batch()
                seen.extend(m.uid for m in batch)
                batch.ack()

        consumer = asyncio.create_task(consume())
        try:
            async with flooding(rx.endpoint, mutations(seeds, rng, N)):
                # Each fuzzed message is dropped whole, or a mutation that still decodes
                # delivers its messages (a batch holds up to 3): at least one count each.
                await until(lambda: handled(rx.stats) >= N, stats=rx.stats)
            async with ReliableSender(rx.endpoint, CODEC) as tx:
                await tx.send(item(42))
                await until(lambda: 42 in seen)
        finally:
            consumer.cancel()


async def echo(cmd: Command, peer: bytes) -> CommandResult:
    return CommandResult(ok=True, data={"kind": cmd.kind})


async def test_rpc_survives_and_counts_every_fuzzed_message(endpoint: str):
    rng = random.Random(2)
    seeds = [[request(REQ.encode_parts(Command(kind=k))[0], rid=i)] for i, k in enumerate("abc")]
    async with RpcServer(endpoint, REQ, REP, echo) as server:
        async with flooding(server.endpoint, mutations(seeds, rng, N)):
            await until(lambda: handled(server.stats) >= N, stats=server.stats)
        assert handled(server.stats) == N
        async with RpcClient(server.endpoint, REQ, REP) as client:
            assert (await client.call(Command(kind="ping"))).data == {"kind": "ping"}


async def test_the_control_server_survives_and_counts_every_fuzzed_message(endpoint: str):
    rng = random.Random(3)
    beat = Heartbeat(actor="a", pid=1, seq=1, state="running", version=0, stats={})
    notify = Codec(type(beat)).encode_parts(beat)[0]
    seeds = [[b"a", request(notify)], [b"b", request(b"\x90")]]
    # The hub's ROUTER adds the sender's identity frame itself: send the envelope only.
    seeds = [[s[1]] for s in seeds]
    async with ControlServer(endpoint, hwm=N + 10) as hub:
        async with flooding(hub.endpoint, mutations(seeds, rng, N)):
            await until(lambda: handled(hub.stats) >= N, stats=hub.stats)
        assert handled(hub.stats) == N
        async with ControlLink(hub.endpoint, "good") as link:
            assert link.notify(beat)
            async with asyncio.timeout(10):
                while (await hub.receive())[0] != "good":
                    pass


@asynccontextmanager
async def publisher(endpoint: str) -> AsyncIterator[Publisher[Any]]:
    async with Publisher(endpoint, endpoint, Codec(WeightVersion)) as pub:
        pub.publish("weights", WeightVersion(version=3, transport="disk", location="/w"))
        yield pub


async def test_the_snapshot_service_survives_fuzzed_requests(endpoint: str):
    rng = random.Random(4)
    seeds = [[request(msgspec.msgpack.encode("weights"))], [request(msgspec.msgpack.encode("x"))]]
    async with publisher(endpoint) as pub:
        async with flooding(pub.snapshot_endpoint, mutations(seeds, rng, N)):
            # A request that still decodes is answered (a snapshot, or nothing for an unknown
            # topic), not dropped; the rest are dropped and counted.
            await until(lambda: sum(pub.stats.dropped.values()) >= N // 2)
        codec = Codec(WeightVersion)
        async with Subscriber(pub.endpoint, pub.snapshot_endpoint, codec, ["weights"]) as sub:
            async with asyncio.timeout(10):
                assert (await sub.receive()).msg.version == 3


async def test_the_blob_server_survives_fuzzed_requests(endpoint: str):
    rng = random.Random(5)
    tensors = {"w": torch.arange(1000, dtype=torch.float32)}
    async with BlobServer(endpoint) as server:
        server.put("v1", tensors)
        codec = Codec(FetchManifest | FetchChunk | FetchDone)
        seeds = [
            [request(codec.encode_parts(m)[0], rid=i)]
            for i, m in enumerate([FetchManifest(blob="v1"), FetchChunk(blob="v1", index=0),
                                   FetchDone(blob="v1", by="x")])
        ]  # fmt: skip
        async with flooding(server.endpoint, mutations(seeds, rng, N)):
            await until(lambda: handled(server.stats) >= N, stats=server.stats)
        out = {"w": torch.empty(1000)}
        async with BlobClient(server.endpoint) as client:
            await client.fetch("v1", out=out)
        assert np.array_equal(out["w"].numpy(), tensors["w"].numpy())


async def test_a_subscriber_survives_a_hostile_publisher(endpoint: str):
    """The connecting side: a PUB and a snapshot ROUTER that send garbage and mutations
    of real updates on the subscribed topic; the subscriber drops them and still takes
    a good update."""
    rng = random.Random(6)
    codec = Codec(WeightVersion)
    async with Publisher(endpoint, endpoint, codec) as real:  # only to build real frames
        real.publish("weights", WeightVersion(version=5, transport="disk", location="/w"))
        good = [bytes(f) for f in real._publish_frames("weights")]
    ctx = zmq.asyncio.Context.instance()
    pub, snap = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    for sock in (pub, snap):
        sock.linger = 0
        sock.sndhwm = 0  # no queue limit: zmq would drop what a loaded receiver has not read
    pub_ep = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    snap_ep = f"tcp://127.0.0.1:{snap.bind_to_random_port('tcp://127.0.0.1')}"
    topic = b"weights\x00"
    try:
        async with Subscriber(pub_ep, snap_ep, codec, ["weights"]) as sub:
            peer = (await snap.recv_multipart())[0]  # its snapshot request: who it is
            for frames in mutations([good], rng, N):
                await pub.send_multipart([topic, *frames])
                if rng.random() < 0.1:
                    await snap.send_multipart([peer, *frames])
            await until(lambda: sum(sub.stats.dropped.values()) > N // 2, stats=sub.stats)
            # A publisher restart (new epoch) with version 99 must still get through.
            body = codec.encode_parts(WeightVersion(version=99, transport="disk", location="/w"))[0]
            fresh = framing.Publish(v=WIRE_VERSION, epoch=123456789, topic="weights", seq=1,
                                    nbuf=0, body=msgspec.Raw(body))  # fmt: skip
            seen: list[int] = []

            async def watch() -> None:
                while True:
                    seen.append((await sub.receive()).msg.version)

            watcher = asyncio.create_task(watch())
            try:
                for _ in range(200):  # PUB/SUB may drop under load: repeat it
                    await pub.send_multipart([topic, framing.pack(fresh)])
                    if 99 in seen:
                        break
                    await asyncio.sleep(0.02)
            finally:
                watcher.cancel()
            assert 99 in seen
    finally:
        pub.close()
        snap.close()


async def test_a_sender_survives_hostile_acks(endpoint: str):
    """A receiver that answers with garbage and mutated acks: the sender drops them, and
    a real ack still releases its message."""
    rng = random.Random(7)
    router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    router.linger = 0
    router.sndhwm = 0  # no queue limit: zmq would drop what a loaded sender has not read
    ep = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        async with ReliableSender(ep, CODEC) as tx:
            await tx.send(item(1))
            peer, batch = await router.recv_multipart()
            stream = framing.unpack(batch, framing.Batch).stream
            ack = framing.pack(framing.Ack(v=WIRE_VERSION, stream=stream, ranges=[(1, 1)]))
            # Acks for another stream, mutated: a hostile peer cannot guess ours.
            nope = framing.pack(framing.Ack(v=WIRE_VERSION, stream="other", ranges=[(1, 9)]))
            for frames in mutations([[nope]], rng, N):
                await router.send_multipart([peer, *frames])
            await until(lambda: sum(tx.stats.dropped.values()) > N // 2, stats=tx.stats)
            assert tx.in_flight == 1  # no garbage released it
            await router.send_multipart([peer, ack])
            async with asyncio.timeout(10):
                await tx.join()
    finally:
        router.close()
