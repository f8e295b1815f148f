"""WeightPublisher and WeightReceiver over real sockets: pull and disk transports, late
joiners, conflation to the newest version, pruning."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from asyncrl.trainers.weight_sync import WeightPublisher, WeightReceiver, disk_path
from asyncrl.wire.blob import BlobServer
from asyncrl.wire.codec import Codec
from asyncrl.wire.errors import RemoteError
from asyncrl.wire.messages import WeightVersion
from asyncrl.wire.pubsub import Publisher
from asyncrl.wire.sockets import free_tcp_endpoint


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g),
        "model.norm.weight": torch.full((16,), float(version)),
        "lm_head.bias": torch.arange(5, dtype=torch.bfloat16) * version,
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def publisher(transport: str, tmp_path: Path, keep: int = 2):
    pub = Publisher(free_tcp_endpoint(), free_tcp_endpoint(), Codec(WeightVersion))
    blob = BlobServer(free_tcp_endpoint(), keep=keep, chunk_bytes=1024)
    await pub.__aenter__()
    await blob.__aenter__()
    sync = WeightPublisher(
        pub, transport=transport, blob=blob, disk_dir=tmp_path / "weights", keep=keep
    )
    return pub, blob, sync


@pytest.mark.parametrize("transport", ["pull", "disk"])
async def test_a_subscriber_fetches_each_announced_version_exactly(transport, tmp_path):
    pub, blob, sync = await publisher(transport, tmp_path)
    try:
        async with WeightReceiver(pub.endpoint, pub.snapshot_endpoint) as rx:
            for version in (1, 2):
                await sync.publish(version, weights(version))
                msg = await asyncio.wait_for(rx.next_version(after=version - 1), 10)
                assert msg.version == version and msg.transport == transport
                assert same(await rx.fetch(msg), weights(version))
    finally:
        await blob.aclose()
        await pub.aclose()


async def test_a_late_joiner_gets_the_newest_version_and_older_ones_are_conflated(tmp_path):
    pub, blob, sync = await publisher("pull", tmp_path, keep=1)
    try:
        for version in (1, 2, 3):
            await sync.publish(version, weights(version))
        async with WeightReceiver(pub.endpoint, pub.snapshot_endpoint) as rx:
            msg = await asyncio.wait_for(rx.next_version(), 10)
            assert msg.version == 3
            assert same(await rx.fetch(msg), weights(3))
            old = WeightVersion(
                version=1, transport="pull", location=blob.endpoint, blob="weights-v1"
            )
            with pytest.raises(RemoteError, match="weights-v3"):  # names what it still has
                await rx.fetch(old)
    finally:
        await blob.aclose()
        await pub.aclose()


async def test_fetch_into_preallocated_tensors_copies_in_place(tmp_path):
    pub, blob, sync = await publisher("pull", tmp_path)
    try:
        async with WeightReceiver(pub.endpoint, pub.snapshot_endpoint) as rx:
            msg = await sync.publish(4, weights(4))
            out = {k: torch.zeros_like(v) for k, v in weights(4).items()}
            got = await rx.fetch(msg, out=out)
            assert got is out and same(out, weights(4))
    finally:
        await blob.aclose()
        await pub.aclose()


async def test_disk_versions_are_written_whole_and_old_ones_pruned(tmp_path):
    pub, blob, sync = await publisher("disk", tmp_path, keep=2)
    try:
        for version in (1, 2, 3):
            await sync.publish(version, weights(version))
        root = tmp_path / "weights"
        assert sorted(p.name for p in root.iterdir()) == ["weight_v000002", "weight_v000003"]
        async with WeightReceiver(pub.endpoint, pub.snapshot_endpoint) as rx:
            gone = WeightVersion(version=1, transport="disk", location=str(disk_path(root, 1)))
            with pytest.raises(FileNotFoundError, match="weight_v000001"):
                await rx.fetch(gone)
    finally:
        await blob.aclose()
        await pub.aclose()


def test_a_transport_without_its_store_is_refused():
    pub = Publisher(free_tcp_endpoint(), free_tcp_endpoint(), Codec(WeightVersion))
    with pytest.raises(ValueError, match="BlobServer"):
        WeightPublisher(pub, transport="pull")
    with pytest.raises(ValueError, match="disk_dir"):
        WeightPublisher(pub, transport="disk")


async def test_dist_transport_broadcasts_each_version_to_every_subscriber(tmp_path):
    from asyncrl.trainers.weight_group import BroadcastGroup

    address = free_tcp_endpoint().removeprefix("tcp://")
    joins = [asyncio.to_thread(BroadcastGroup.join, address, r, 3) for r in range(3)]
    groups = await asyncio.gather(*joins)
    pub = Publisher(free_tcp_endpoint(), free_tcp_endpoint(), Codec(WeightVersion))
    async with pub:
        sync = WeightPublisher(pub, transport="dist", group=groups[0], bucket_bytes=256)
        receivers = [
            WeightReceiver(pub.endpoint, pub.snapshot_endpoint, group=g) for g in groups[1:]
        ]
        for rx in receivers:
            await rx.__aenter__()
        try:

            async def take(rx: WeightReceiver, version: int) -> dict[str, torch.Tensor]:
                return await rx.fetch(await rx.next_version(after=version - 1))

            for version in (1, 2):
                got = await asyncio.wait_for(
                    asyncio.gather(
                        sync.publish(version, weights(version)),
                        *(take(rx, version) for rx in receivers),
                    ),
                    30,
                )
                assert all(same(tensors, weights(version)) for tensors in got[1:])
                assert got[0].transport == "dist" and got[0].version == version
        finally:
            for rx in receivers:
                await rx.__aexit__(None, None, None)
    with pytest.raises(ValueError, match="rank 0"):
        WeightPublisher(pub, transport="dist", group=groups[1])
    with pytest.raises(ValueError, match="host:port"):
        BroadcastGroup.join("nowhere", 0, 1)
