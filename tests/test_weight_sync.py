"""WeightPublisher and WeightReceiver over real sockets: pull, disk and dist transports,
late joiners, conflation to the newest version, pruning; the dist group forming, losing a
member, and re-forming with a replacement or a restarted trainer."""

from __future__ import annotations

import asyncio
import datetime
import multiprocessing
import os
import signal
import time
from multiprocessing.synchronize import Event
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist

from asyncrl.weights.config import GroupConfig
from asyncrl.weights.group import GroupMembership, group_name, split_address
from asyncrl.weights.sync import WeightPublisher, WeightReceiver, disk_path
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


@pytest.mark.parametrize("transport", ["pull", "disk", "ipc"])
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


async def test_a_restarted_trainers_versions_replace_its_predecessors_whatever_their_number(
    tmp_path,
):
    """It resumed from an older checkpoint: its version 3 follows the old trainer's 5
    (with dist, every member must take each version it broadcasts)."""
    endpoints = (free_tcp_endpoint(), free_tcp_endpoint())
    async with WeightReceiver(*endpoints) as rx:
        for version in (5, 3):  # the first trainer's last version, the second's first
            pub = Publisher(*endpoints, Codec(WeightVersion))
            blob = BlobServer(free_tcp_endpoint(), keep=2, chunk_bytes=1024)
            async with pub, blob:
                sync = WeightPublisher(pub, transport="pull", blob=blob)
                await sync.publish(version, weights(version))
                msg = await asyncio.wait_for(rx.next_version(after=5 if version == 3 else -1), 10)
                assert msg.version == version and msg.trainer == sync.lineage
                assert same(await rx.fetch(msg), weights(version))


async def test_after_failing_a_restarted_trainers_first_version_its_next_is_not_skipped(
    tmp_path,
):
    """The engines hold the old trainer's 5; the new trainer's 3 is gone before it is
    pulled, so they still hold 5. Its 4 must come next, not wait for a 6 (with dist, the
    trainer's broadcast of 4 would wait for this member until the group's timeout)."""
    endpoints = (free_tcp_endpoint(), free_tcp_endpoint())
    async with WeightReceiver(*endpoints) as rx:
        pub = Publisher(*endpoints, Codec(WeightVersion))
        async with pub, BlobServer(free_tcp_endpoint(), keep=1, chunk_bytes=1024) as blob:
            old = WeightPublisher(pub, transport="pull", blob=blob)
            await old.publish(5, weights(5))
            held = await asyncio.wait_for(rx.next_version(), 10)
        pub = Publisher(*endpoints, Codec(WeightVersion))
        async with pub, BlobServer(free_tcp_endpoint(), keep=1, chunk_bytes=1024) as blob:
            new = WeightPublisher(pub, transport="pull", blob=blob)
            await new.publish(3, weights(3))
            first = await asyncio.wait_for(rx.next_version(after=5, held=held.trainer), 10)
            await new.publish(4, weights(4))  # keep=1: version 3 is dropped
            with pytest.raises(RemoteError):
                await rx.fetch(first)
            msg = await asyncio.wait_for(rx.next_version(after=5, held=held.trainer), 10)
            assert (msg.version, msg.trainer) == (4, new.lineage)
            assert same(await rx.fetch(msg), weights(4))


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


async def test_ipc_versions_are_shared_on_the_host_and_pulled_from_elsewhere(tmp_path):
    pub, blob, sync = await publisher("ipc", tmp_path, keep=1)
    try:
        async with WeightReceiver(pub.endpoint, pub.snapshot_endpoint) as rx:
            msg = await sync.publish(1, weights(1))
            assert msg.handles and msg.host  # one handle per bucket, and where they live
            out = {k: torch.zeros_like(v) for k, v in weights(1).items()}
            assert same(await rx.fetch(msg, out=out), weights(1))
            elsewhere = msgspec.structs.replace(msg, host="another-host")
            assert same(await rx.fetch(elsewhere), weights(1))
            assert rx.counts == {"broadcast": 0, "shared": 1, "pulled": 1}
            # keep=1: two slots, so version 3 refills version 1's; the blob holds 3 alone.
            for version in (2, 3):
                await sync.publish(version, weights(version))
            with pytest.raises(RemoteError, match="weights-v3"):
                await rx.fetch(msg)  # the stamp says 3, not 1: not taken from there
            assert rx.counts["shared"] == 1
    finally:
        await blob.aclose()
        await pub.aclose()


def test_shared_versions_are_taken_by_several_processes_version_after_version():
    """Each engine on the host opens every version's buckets, and the ring's slots are
    refilled: no open may use up a bucket's name (torch unlinks it when its count of
    opens runs out)."""
    import json
    import subprocess
    import sys

    from asyncrl.weights.share import SharedVersions

    def ours() -> list[Path]:
        return list(Path("/dev/shm").glob(f"torch_{os.getpid()}_*"))

    before = set(ours())
    shared = SharedVersions(keep=2, bucket_bytes=1 << 20)
    takers = [
        subprocess.Popen([sys.executable, "-m", "tests.shared_taker"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
        for _ in range(2)
    ]  # fmt: skip
    try:
        for version in range(8):  # the 3 slots, each refilled twice
            tensors = weights(version)
            handles, _ = shared.share(version, tensors)
            for taker in takers:
                assert taker.stdin is not None
                taker.stdin.write(json.dumps([version, handles]) + "\n")
                taker.stdin.flush()
            expected = sum(float(t.double().sum()) for t in tensors.values())
            for taker in takers:
                assert taker.stdout is not None
                got = json.loads(taker.stdout.readline())
                assert got == {"version": version, "sum": pytest.approx(expected)}, got
    finally:
        for taker in takers:
            assert taker.stdin is not None
            taker.stdin.close()
            taker.wait(30)
        shared.close()
    assert set(ours()) <= before  # every name unlinked


def test_a_version_dev_shm_cannot_hold_is_refused_with_what_to_do(monkeypatch):
    import shutil
    from collections import namedtuple

    from asyncrl.errors import InputError
    from asyncrl.weights.share import SharedVersions

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 20, 0, 1024))
    with pytest.raises(InputError, match=r"docker --shm-size\) or use --update-weight-transport"):
        SharedVersions().share(1, weights(1))


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


GROUP = GroupConfig(world_size=3, timeout_s=20, join_timeout_s=10)
BUCKET = 1 << 20


def big_weights(version: int) -> dict[str, torch.Tensor]:
    """More than a socket buffer holds: a send to a dead rank fails before the rest go."""
    return weights(version) | {"big": torch.full((BUCKET,), float(version))}


class DistRig:
    """A trainer's WeightPublisher (rank 0) and members' receivers, in this process."""

    def __init__(self, tmp_path: Path) -> None:
        self.address = free_tcp_endpoint().removeprefix("tcp://")
        self.pub = Publisher(free_tcp_endpoint(), free_tcp_endpoint(), Codec(WeightVersion))
        self.blob = BlobServer(free_tcp_endpoint(), keep=2, chunk_bytes=256 * 1024)
        self.receivers: dict[int, WeightReceiver] = {}
        self.version = 0

    async def __aenter__(self) -> DistRig:
        await self.pub.__aenter__()
        await self.blob.__aenter__()
        self.start_trainer()
        for rank in (1, 2):
            await self.add(rank)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for rx in self.receivers.values():
            rx.group.close()
            await rx.__aexit__(None, None, None)
        self.trainer.close()
        await self.blob.aclose()
        await self.pub.aclose()

    def start_trainer(self) -> None:
        self.trainer = GroupMembership(GROUP, rank=0, address=self.address)
        self.trainer.open()
        self.sync = WeightPublisher(
            self.pub, transport="dist", blob=self.blob, group=self.trainer, bucket_bytes=BUCKET
        )

    async def add(self, rank: int) -> None:
        group = GroupMembership(GROUP, rank=rank, address=self.address)
        rx = WeightReceiver(self.pub.endpoint, self.pub.snapshot_endpoint, group=group)
        self.receivers[rank] = await rx.__aenter__()

    async def drop(self, rank: int) -> None:
        """A member goes away: its connections close, as when its process dies."""
        rx = self.receivers.pop(rank)
        rx.group.close()
        await rx.__aexit__(None, None, None)

    async def step(self, limit_s: float = 60) -> WeightVersion:
        """Publish the next version; every member takes it; all got the same tensors."""
        self.version += 1
        v = self.version

        async def take(rx: WeightReceiver) -> dict[str, torch.Tensor]:
            return await rx.fetch(await rx.next_version(after=v - 1))

        # A TimeoutError here is a hang: a member stuck on a broadcast that never comes.
        msg, *got = await asyncio.wait_for(
            asyncio.gather(self.sync.publish(v, big_weights(v)),
                           *(take(rx) for rx in self.receivers.values())),
            limit_s,
        )  # fmt: skip
        assert all(same(tensors, big_weights(v)) for tensors in got)
        await asyncio.wait_for(self.sync.settle(), limit_s)  # the trainer's send has ended
        return msg

    async def until_broadcast(self) -> WeightVersion:
        """Versions until one goes by broadcast (the group formed in the background)."""
        for _ in range(100):
            msg = await self.step()
            if msg.formed:
                return msg
            await asyncio.sleep(0.1)
        raise AssertionError("the weight group never formed")


async def test_dist_pulls_while_the_group_forms_then_broadcasts_every_version(tmp_path):
    async with DistRig(tmp_path) as rig:
        first = await rig.step()
        assert first.transport == "dist" and not first.formed and first.group  # pulled
        formed = await rig.until_broadcast()
        assert formed.group == first.group  # formed at the first try: everyone was there
        for _ in range(3):
            assert (await rig.step()).formed
        for rx in rig.receivers.values():
            assert rx.counts["broadcast"] >= 4 and rx.counts["pulled"] >= 1, rx.counts
        # The manifest's chunks are the buckets; the blob (pull) keeps its own chunking.
        assert formed.manifest is not None and formed.manifest.chunk_bytes == BUCKET


async def test_a_lost_member_fails_one_broadcast_at_once_and_its_replacement_rejoins(tmp_path):
    async with DistRig(tmp_path) as rig:
        formed = await rig.until_broadcast()
        survivor = rig.receivers[2]
        before = sum(survivor.counts.values())
        await rig.drop(1)  # rank 0 sends to rank 1 first: rank 2 is left waiting
        # Rank 0's broadcast fails (the dead rank's connection is closed) and it aborts the
        # group, so the survivor's receive fails at once too, not at the 20 s collective
        # timeout: the version reaches it (by pull) well before that.
        lost = await rig.step(limit_s=GROUP.timeout_s / 2)
        assert lost.formed and lost.group == formed.group
        assert rig.trainer.group is None  # dropped: the next version re-forms
        assert sum(survivor.counts.values()) == before + 1
        reforming = await rig.step()
        assert not reforming.formed and reforming.group != formed.group  # a new id
        await rig.add(1)  # the restarted member: it learns the id from the snapshot
        again = await rig.until_broadcast()
        assert again.group != formed.group
        assert rig.receivers[1].counts["broadcast"] == 1


async def test_a_restarted_trainer_forms_a_new_group_with_the_same_members(tmp_path):
    async with DistRig(tmp_path) as rig:
        formed = await rig.until_broadcast()
        rig.trainer.close()  # the trainer process dies: its store and group go with it
        rig.start_trainer()  # a new one serves the store at the same address
        again = await rig.until_broadcast()
        incarnation = formed.group.rpartition("-")[0]
        assert again.group.rpartition("-")[0] != incarnation  # its own ids
        assert all(rx.counts["broadcast"] >= 2 for rx in rig.receivers.values())


#: Long enough that nothing below waits it out by chance.
SLOW_JOIN = GroupConfig(world_size=3, timeout_s=20, join_timeout_s=30)


def _join_when_told(address: str, ready: Event, ids: multiprocessing.Queue) -> None:
    """A member process: says it has started, joins the id it is sent at rank 1, waits."""
    member = GroupMembership(SLOW_JOIN, rank=1, address=address)
    ready.set()
    member.notice(ids.get(), formed=False)
    time.sleep(600)


def _in_gloo(address: str, group_id: str, rank: int) -> bool:
    """Rank ``rank`` has written its address into gloo's rendezvous for ``group_id``
    (torch 2.13's keys under ``sglang_layout``)."""
    host, port = split_address(address)
    store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=5))
    name = group_name(group_id)
    return store.check([f"{name}/{name}//cpu//0/{rank}"])


async def test_a_member_killed_in_its_join_does_not_hold_the_group_or_its_successor():
    """SIGKILL a member inside its join: gloo keeps the dead one's address at its rank.
    Its restarted successor must not join that id (it waited on the dead socket with
    rank 0, past both timeouts, and a server engine stopped generating meanwhile): it is
    refused at once and marks the id stale, so rank 0 gives the id up at its next version,
    before its own rendezvous ends, and the next id forms with the successor."""
    address = free_tcp_endpoint().removeprefix("tcp://")
    ctx = multiprocessing.get_context("spawn")
    ready, ids = ctx.Event(), ctx.Queue()
    killed = ctx.Process(target=_join_when_told, args=(address, ready, ids))
    killed.start()
    trainer = GroupMembership(SLOW_JOIN, rank=0, address=address)
    trainer.open()
    doomed_forming = None
    try:
        # A spawned process starts slowly: rank 0's join timeout starts after it has.
        assert await asyncio.to_thread(ready.wait, 120)
        assert trainer.usable() is None
        doomed, doomed_forming = trainer.id, trainer._forming
        assert doomed_forming is not None
        ids.put(doomed)
        for _ in range(300):
            if _in_gloo(address, doomed, 1):
                break
            await asyncio.sleep(0.1)
        assert _in_gloo(address, doomed, 1), "the member never reached gloo's rendezvous"
        os.kill(killed.pid, signal.SIGKILL)  # inside the join, waiting for rank 2
        killed.join()
        successor = GroupMembership(SLOW_JOIN, rank=1, address=address)
        successor.notice(doomed, formed=False)
        refused = successor._forming
        assert refused is not None
        with pytest.raises(RuntimeError, match="taken by an earlier join"):
            refused.result(timeout=10)
        assert trainer.usable() is None and trainer.id != doomed
        assert not doomed_forming.done()  # given up on the mark, not on its timeout
        fresh, other = trainer.id, GroupMembership(SLOW_JOIN, rank=2, address=address)
        for member in (successor, other):
            member.notice(fresh, formed=False)
        group = None
        for _ in range(int(SLOW_JOIN.join_timeout_s * 10)):
            if (group := trainer.usable()) is not None:
                break
            await asyncio.sleep(0.1)
        assert group is not None and trainer.id == fresh, "the next id did not form"
        groups = [await m.for_version(fresh, formed=True) for m in (successor, other)]
        assert None not in groups
        sent = [torch.arange(4.0), torch.zeros(4), torch.zeros(4)]
        await asyncio.gather(*(asyncio.to_thread(g.broadcast, [t])
                               for g, t in zip([group, *groups], sent, strict=True)))  # fmt: skip
        assert all(torch.equal(t, sent[0]) for t in sent)
        for g in (group, *groups):
            g.abort()
    finally:
        if killed.is_alive():
            killed.kill()
        if doomed_forming is not None:  # no torch thread at exit
            doomed_forming.exception(timeout=3 * SLOW_JOIN.join_timeout_s)
        trainer.close()


def test_dist_needs_rank_0_and_the_blob_server_and_a_host_port(tmp_path):
    pub = Publisher(free_tcp_endpoint(), free_tcp_endpoint(), Codec(WeightVersion))
    blob = BlobServer(free_tcp_endpoint())
    member = GroupMembership(GROUP, rank=1, address="127.0.0.1:1")
    with pytest.raises(ValueError, match="rank 0"):
        WeightPublisher(pub, transport="dist", blob=blob, group=member)
    with pytest.raises(ValueError, match="BlobServer"):
        WeightPublisher(pub, transport="dist", group=member)
    with pytest.raises(ValueError, match="host:port"):
        GroupMembership(GROUP, rank=0, address="nowhere")
    with pytest.raises(ValueError, match="outside a group of 3"):
        GroupMembership(GROUP, rank=3, address="127.0.0.1:1")
