"""Latest-wins pub/sub: join snapshots, gap detection, conflation, publisher restarts."""

from __future__ import annotations

import asyncio

from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import WeightVersion
from asyncrl.wire.pubsub import Publisher, Subscriber
from asyncrl.wire.sockets import free_tcp_endpoint

CODEC = Codec(WeightVersion)


def wv(v: int) -> WeightVersion:
    return WeightVersion(version=v, transport="disk", location=f"/ckpt/{v}")


async def test_a_late_joiner_gets_the_latest_state_at_once(endpoint: str):
    async with Publisher(endpoint, endpoint, CODEC, beat_interval=10) as pub:
        for v in range(1, 4):
            pub.publish("weights", wv(v))
        async with Subscriber(pub.endpoint, pub.snapshot_endpoint, CODEC, ["weights"]) as sub:
            async with asyncio.timeout(5):
                update = await sub.receive()
        assert (update.seq, update.msg.version, update.skipped) == (3, 3, 0)


async def test_updates_arrive_in_order_and_only_for_subscribed_topics(endpoint: str):
    async with (
        Publisher(endpoint, endpoint, CODEC) as pub,
        Subscriber(pub.endpoint, pub.snapshot_endpoint, CODEC, ["weights"]) as sub,
    ):
        await asyncio.sleep(0.3)  # connected; nothing published yet
        seen = []
        for v in range(1, 6):
            pub.publish("weights", wv(v))
            pub.publish("weights2", wv(100 + v))  # prefix of no interest: never delivered
            async with asyncio.timeout(5):
                seen.append((await sub.receive()).msg.version)
        assert seen == [1, 2, 3, 4, 5]
        assert sub.gaps == 0


async def test_a_lost_update_is_reported_as_skipped_never_silently(endpoint: str):
    async with (
        Publisher(endpoint, endpoint, CODEC) as pub,
        Subscriber(pub.endpoint, pub.snapshot_endpoint, CODEC, ["weights"]) as sub,
    ):
        pub.publish("weights", wv(1))
        async with asyncio.timeout(5):
            assert (await sub.receive()).seq == 1
        sub._sub.setsockopt(__import__("zmq").UNSUBSCRIBE, b"weights\x00")  # drop 2 and 3
        await asyncio.sleep(0.2)
        pub.publish("weights", wv(2))
        pub.publish("weights", wv(3))
        await asyncio.sleep(0.2)
        sub._sub.setsockopt(__import__("zmq").SUBSCRIBE, b"weights\x00")
        await asyncio.sleep(0.2)
        pub.publish("weights", wv(4))
        async with asyncio.timeout(5):
            update = await sub.receive()
        assert (update.seq, update.skipped) == (4, 2)
        assert sub.gaps == 1


async def test_when_the_newest_update_is_lost_the_beat_fetches_it(endpoint: str):
    async with (
        Publisher(endpoint, endpoint, CODEC, beat_interval=0.1) as pub,
        Subscriber(
            pub.endpoint, pub.snapshot_endpoint, CODEC, ["weights"], snapshot_retry=0.05
        ) as sub,
    ):
        await asyncio.sleep(0.3)
        sub._sub.setsockopt(__import__("zmq").UNSUBSCRIBE, b"weights\x00")
        await asyncio.sleep(0.2)
        pub.publish("weights", wv(7))  # never reaches the SUB socket
        async with asyncio.timeout(5):
            update = await sub.receive()
        assert update.msg.version == 7


async def test_a_consumer_that_lags_sees_only_the_latest_with_a_skip_count(endpoint: str):
    async with (
        Publisher(endpoint, endpoint, CODEC) as pub,
        Subscriber(pub.endpoint, pub.snapshot_endpoint, CODEC, ["weights"]) as sub,
    ):
        await asyncio.sleep(0.3)
        for v in range(1, 11):
            pub.publish("weights", wv(v))
        await asyncio.sleep(0.3)
        update = sub.receive_nowait()
        assert (update.seq, update.skipped) == (10, 9)
        assert sub.latest("weights").seq == 10


async def test_a_restarted_publisher_is_recognised_by_its_new_epoch():
    pub_ep, snap_ep = free_tcp_endpoint(), free_tcp_endpoint()
    async with Subscriber(pub_ep, snap_ep, CODEC, ["weights"], snapshot_retry=0.05) as sub:
        async with Publisher(pub_ep, snap_ep, CODEC, beat_interval=0.1) as pub:
            for v in range(1, 6):
                pub.publish("weights", wv(v))
            async with asyncio.timeout(5):
                while (await sub.receive()).seq != 5:
                    pass
        async with Publisher(pub_ep, snap_ep, CODEC, beat_interval=0.1) as pub2:
            pub2.publish("weights", wv(50))  # seq 1 again, new epoch
            async with asyncio.timeout(5):
                update = await sub.receive()
        assert (update.seq, update.msg.version, update.epoch) == (1, 50, pub2.epoch)


async def test_updates_missed_across_a_publisher_restart_are_counted(endpoint: str):
    from msgspec import Raw

    from asyncrl.wire import framing

    async with (
        Publisher(endpoint, endpoint, CODEC, beat_interval=10) as pub,
        Subscriber(pub.endpoint, pub.snapshot_endpoint, CODEC, ["weights"]) as sub,
    ):
        body = Raw(CODEC.encode(wv(1))[0])

        def update(epoch: int, seq: int) -> framing.Publish:
            return framing.Publish(v=1, epoch=epoch, topic="weights", seq=seq, nbuf=0, body=body)

        sub._on_publish(update(epoch=11, seq=4), [])  # first sight: nothing counts as missed
        assert sub.receive_nowait().skipped == 0
        sub._on_publish(update(epoch=22, seq=3), [])  # restarted; seqs 1 and 2 never seen
        assert sub.receive_nowait().skipped == 2 and sub.gaps == 1
