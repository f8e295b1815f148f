"""The reliable channel on real sockets: nothing lost or repeated, bounded memory, bad input."""

from __future__ import annotations

import asyncio
import os

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from asyncrl.wire import framing
from asyncrl.wire.codec import WIRE_VERSION, Codec, Message
from asyncrl.wire.errors import ChannelClosed, WouldBlock
from asyncrl.wire.reliable import ReliableReceiver, ReliableSender
from asyncrl.wire.sockets import free_tcp_endpoint
from tests.polling import until


class Item(Message):
    uid: int
    data: np.ndarray


CODEC = Codec(Item)


def item(uid: int, size: int = 16) -> Item:
    return Item(uid=uid, data=np.full(size, uid % 251, dtype=np.uint8))


async def collect(rx: ReliableReceiver, n: int, seen: list[int], *, ack: bool = True) -> None:
    while len(seen) < n:
        batch = await rx.receive_batch()
        seen.extend(m.uid for m in batch)
        if ack:
            batch.ack()


async def test_messages_arrive_once_in_order_with_their_arrays(endpoint: str):
    async with ReliableReceiver(endpoint, CODEC) as rx, ReliableSender(rx.endpoint, CODEC) as tx:
        for i in range(5000):
            await tx.send(item(i, size=i % 50))
        seen: list[int] = []
        async with asyncio.timeout(20):
            await collect(rx, 5000, seen)
            await tx.join()
        assert seen == list(range(5000))
        assert tx.in_flight == 0 and rx.stats.duplicates == 0


async def test_large_messages_with_buffer_frames_are_delivered(endpoint: str):
    codec = Codec(Item, inline_bytes=1024)
    async with ReliableReceiver(endpoint, codec) as rx, ReliableSender(rx.endpoint, codec) as tx:
        for i in range(20):
            await tx.send(item(i, size=100_000))
        async with asyncio.timeout(20):
            got = []
            while len(got) < 20:
                d = await rx.receive()
                got.append(d.msg)
                d.ack()
            await tx.join()
        assert [m.uid for m in got] == list(range(20))
        assert all(m.data.shape == (100_000,) and int(m.data[-1]) == m.uid % 251 for m in got)


async def test_receiver_restart_with_saved_dedup_state_loses_and_repeats_nothing():
    ep = free_tcp_endpoint()
    processed: list[int] = []  # the application's state
    async with ReliableSender(ep, CODEC, redeliver_after=0.2) as tx:
        for i in range(300):
            await tx.send(item(i))
        # First receiver: processes 120 messages and acks only the first 60, then crashes
        # (closes without flushing anything); its state is "checkpointed" with dedup state.
        async with ReliableReceiver(ep, CODEC) as rx1:
            async with asyncio.timeout(10):
                while len(processed) < 120:
                    d = await rx1.receive()
                    processed.append(d.msg.uid)
                    if d.msg.uid < 60:
                        d.ack()
                await asyncio.sleep(0.05)  # let the acks of the first 60 leave
            checkpoint = (list(processed), rx1.dedup_state())
        for i in range(300, 400):
            await tx.send(item(i))
        processed, dedup = checkpoint
        async with ReliableReceiver(ep, CODEC, dedup_state=dedup) as rx2:
            async with asyncio.timeout(20):
                while len(processed) < 400:
                    d = await rx2.receive()
                    processed.append(d.msg.uid)
                    d.ack()
                await tx.join()
            assert rx2.stats.duplicates >= 60  # 60..119 came again and were recognised
    assert sorted(processed) == list(range(400))  # nothing lost, nothing processed twice
    assert tx.stats.redelivered > 0


async def test_receiver_restart_without_state_still_delivers_everything_at_least_once():
    ep = free_tcp_endpoint()
    first: list[int] = []
    async with ReliableSender(ep, CODEC, redeliver_after=0.2) as tx:
        for i in range(200):
            await tx.send(item(i))
        async with ReliableReceiver(ep, CODEC) as rx1:
            async with asyncio.timeout(10):
                await collect(rx1, 50, first, ack=False)  # crashes before acking anything
        second: list[int] = []
        async with ReliableReceiver(ep, CODEC) as rx2:
            async with asyncio.timeout(20):
                await collect(rx2, 200, second)
                await tx.join()
    assert sorted(second) == list(range(200))


async def test_acks_in_any_order_release_the_window_exactly(endpoint: str):
    async with (
        ReliableReceiver(endpoint, CODEC) as rx,
        ReliableSender(rx.endpoint, CODEC, window=100) as tx,
    ):
        for i in range(100):
            tx.send_nowait(item(i))
        with pytest.raises(WouldBlock):
            tx.send_nowait(item(100))
        async with asyncio.timeout(10):
            deliveries = [await rx.receive() for _ in range(100)]
            for d in reversed(deliveries[50:]):
                d.ack()
            await until(lambda: tx.in_flight == 50)
            for d in deliveries[:50]:
                d.ack()
                d.ack()  # idempotent
            await tx.join()
        assert tx.in_flight == 0


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_a_stalled_consumer_blocks_the_sender_and_memory_stays_flat(endpoint: str):
    payload = 64 * 1024
    async with (
        ReliableReceiver(endpoint, CODEC, max_queued=32, hwm=4) as rx,
        ReliableSender(rx.endpoint, CODEC, window=64, hwm=4) as tx,
    ):
        sent = 0

        async def flood() -> None:
            nonlocal sent
            for i in range(100_000):  # 6.4 GB if anything buffered without bound
                await tx.send(item(i, size=payload))
                sent += 1

        task = asyncio.create_task(flood())
        await asyncio.sleep(0.5)
        before = _rss_bytes()
        await asyncio.sleep(1.0)
        grown = _rss_bytes() - before
        assert sent <= 64 and tx.in_flight == 64  # blocked at the window
        assert rx.queued <= 32 + 64
        assert grown < 32 * 1024 * 1024, f"RSS grew {grown / 2**20:.1f} MB while stalled"
        # The consumer recovers: the flood resumes.
        for _ in range(10):
            (await rx.receive_batch()).ack()
        async with asyncio.timeout(10):
            await until(lambda: sent > 64)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def raw_dealer(endpoint: str, identity: bytes) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(endpoint)
    return sock


async def test_malformed_oversized_and_random_frames_are_dropped_and_counted(endpoint: str):
    codec = Codec(Item, max_frame_bytes=4096)
    async with ReliableReceiver(endpoint, codec) as rx:
        bad = await raw_dealer(rx.endpoint, b"attacker")
        good_body = codec.encode(item(7))[0]
        junk_item = msgspec.msgpack.encode(["Item", "not-an-int", None])
        frames = [
            [b"\xc1garbage"],  # not msgpack
            [framing.pack(framing.Ack(v=WIRE_VERSION, stream="s", ranges=[]))],  # wrong kind
            [framing.pack_batch("s", 1, [], [good_body])[:-3]],  # truncated
            [
                framing.pack_batch("s", 1, [], [good_body]).replace(
                    b"\x96\xa1B\x01", b"\x96\xa1B\x09"
                )
            ],
            [b"x" * 100_000],  # oversized
            [framing.pack_batch("s", 1, [1], [good_body])],  # announces a missing buffer
            [framing.pack_batch("s", 0, [], [good_body])],  # seq 0 is invalid
            [os.urandom(64)],
        ]
        for f in frames:
            await bad.send_multipart(f)
        # A batch with one bad message between two good ones: only the bad one is dropped.
        await bad.send_multipart(
            [
                framing.pack_batch(
                    "mixed", 1, [], [codec.encode(item(1))[0], junk_item, codec.encode(item(3))[0]]
                )
            ]
        )
        async with asyncio.timeout(10):
            got = [await rx.receive(), await rx.receive()]
        assert [d.msg.uid for d in got] == [1, 3]
        assert rx.stats.dropped["malformed"] >= 5
        assert rx.stats.dropped["bad_frames"] == 1 and rx.stats.dropped["bad_seq"] == 1
        # ...and it still serves a well-behaved sender.
        async with ReliableSender(rx.endpoint, codec) as tx:
            await tx.send(item(42))
            async with asyncio.timeout(10):
                d = await rx.receive()
                d.ack()
                await tx.join()
            assert d.msg.uid == 42
        bad.close()


async def test_duplicates_of_acknowledged_messages_are_acknowledged_again(endpoint: str):
    async with ReliableReceiver(endpoint, CODEC) as rx:
        peer = await raw_dealer(rx.endpoint, b"replayer")
        batch = framing.pack_batch("replayer-1", 1, [], [CODEC.encode(item(1))[0]])
        await peer.send_multipart([batch])
        async with asyncio.timeout(10):
            (await rx.receive()).ack()
            first_ack = framing.unpack((await peer.recv_multipart())[0], framing.Ack)
            await peer.send_multipart([batch])  # as if the ack had been lost
            second_ack = framing.unpack((await peer.recv_multipart())[0], framing.Ack)
        assert first_ack.ranges == second_ack.ranges == [(1, 1)]
        assert rx.queued == 0 and rx.stats.duplicates == 1
        peer.close()


async def test_a_hostile_ack_range_costs_nothing(endpoint: str):
    async with ReliableReceiver(endpoint, CODEC) as rx, ReliableSender(rx.endpoint, CODEC) as tx:
        await tx.send(item(1))
        await asyncio.sleep(0.05)  # the batch leaves on the next loop turn
        tx._apply_ack([(-(10**15), 10**15)])  # clamped to live seqs
        assert tx.in_flight == 0
        async with asyncio.timeout(5):
            (await rx.receive()).ack()


async def test_a_batch_never_grows_past_the_frame_limit(endpoint: str):
    codec = Codec(Item, max_frame_bytes=1 << 20, inline_bytes=1 << 21)
    async with (
        ReliableReceiver(endpoint, codec) as rx,
        ReliableSender(rx.endpoint, codec, batch_bytes=1 << 20) as tx,
    ):
        tx.send_nowait(item(1, size=200_000))
        tx.send_nowait(item(2, size=(1 << 20) - 4096))  # alone it fits; together they would not
        async with asyncio.timeout(10):
            got = [await rx.receive(), await rx.receive()]
            for d in got:
                d.ack()
            await tx.join()
        assert [d.msg.uid for d in got] == [1, 2] and rx.stats.dropped["bad_frames"] == 0


async def test_a_fresh_receiver_accepts_a_long_running_stream(endpoint: str):
    async with ReliableReceiver(endpoint, CODEC) as rx:
        peer = await raw_dealer(rx.endpoint, b"veteran")
        first = 40_000_000  # a stream that sent 40M messages before the receiver restarted
        await peer.send_multipart(
            [framing.pack_batch("veteran-1", first, [], [CODEC.encode(item(9))[0]])]
        )
        async with asyncio.timeout(5):
            d = await rx.receive()
        assert (d.seq, d.msg.uid) == (first, 9)
        peer.close()


async def test_join_after_close_reports_what_was_left_unacknowledged():
    tx = ReliableSender(free_tcp_endpoint(), CODEC)  # nobody listens
    async with tx:
        await tx.send(item(1))
    with pytest.raises(ChannelClosed, match="1 unacknowledged"):
        await tx.join()


async def test_new_streams_past_the_limit_are_refused_until_an_idle_one_is_forgotten(endpoint: str):
    async with ReliableReceiver(endpoint, CODEC, max_streams=2, stream_idle_seconds=3600) as rx:
        peer = await raw_dealer(rx.endpoint, b"many")
        body = CODEC.encode(item(1))[0]
        for name in ("s1", "s2", "s3"):
            await peer.send_multipart([framing.pack_batch(name, 1, [], [body])])
        async with asyncio.timeout(5):
            for _ in range(2):
                (await rx.receive()).ack()
            await until(lambda: rx.stats.dropped["too_many_streams"] == 1)
        rx.stream_idle_seconds = 0  # s1 and s2 are fully acknowledged: forgettable
        await asyncio.sleep(0.05)
        await peer.send_multipart([framing.pack_batch("s3", 1, [], [body])])
        async with asyncio.timeout(5):
            d = await rx.receive()
        assert d.stream == "s3" and len(rx.dedup_state()) == 2
        peer.close()
