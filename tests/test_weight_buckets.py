"""Weight buckets for the ``dist`` transport: the plan both ends compute from a manifest,
flattening and the views a receiver copies out, and a bucketed broadcast over gloo."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl.weights.buckets import (
    Bucket,
    empty_bucket,
    flatten,
    manifest_buckets,
    plan_buckets,
    views,
)
from asyncrl.wire.blob import layout
from asyncrl.wire.sockets import free_tcp_endpoint


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(40, 8, generator=g),  # 1280 bytes
        "norm1": torch.randn(8, generator=g),  # 32
        "proj": torch.randn(8, 8, generator=g),  # 256
        "half": torch.randn(4, 4, generator=g).to(torch.bfloat16),  # 32, another dtype
        "norm2": torch.randn(8, generator=g),  # 32
        "head": torch.randn(8, 3, generator=g),  # 96
    }


def test_a_plan_covers_every_tensor_once_in_order_one_dtype_per_bucket():
    entries = layout(model(), chunk_bytes=1, blob="b").entries
    plan = plan_buckets(entries, bucket_bytes=300)
    assert plan == [
        Bucket(0, 1, "float32", 320),  # larger than a bucket: alone
        Bucket(1, 3, "float32", 72),  # 32 + 256 fit 300
        Bucket(3, 4, "bfloat16", 16),  # a dtype change starts a bucket
        Bucket(4, 6, "float32", 32),
    ]
    covered = [i for b in plan for i in range(b.start, b.end)]
    assert covered == list(range(len(entries)))
    assert plan_buckets(entries, 1 << 30) == [
        Bucket(0, 3, "float32", 392), Bucket(3, 4, "bfloat16", 16), Bucket(4, 6, "float32", 32),
    ]  # fmt: skip
    assert plan_buckets([], 100) == []
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(entries, 0)


def test_views_of_a_flattened_bucket_are_the_tensors_again():
    tensors = model()
    manifest = layout(tensors, chunk_bytes=300, blob="b")
    for bucket in manifest_buckets(manifest):
        flat = flatten(bucket, manifest.entries, tensors)
        assert flat.dim() == 1 and flat.numel() == bucket.numel
        received = empty_bucket(bucket)
        received.copy_(flat)
        for name, view in views(bucket, manifest.entries, received):
            assert torch.equal(view, tensors[name]) and view.dtype == tensors[name].dtype


async def test_a_bucketed_broadcast_delivers_every_tensor_to_every_rank():
    from asyncrl.weights.group import BroadcastGroup

    address = free_tcp_endpoint().removeprefix("tcp://")
    groups = await asyncio.gather(
        *(asyncio.to_thread(BroadcastGroup.join, address, r, 3) for r in range(3))
    )
    tensors = model(7)
    manifest = layout(tensors, chunk_bytes=300, blob="b")  # four buckets, two dtypes
    got: list[dict[str, torch.Tensor]] = [{}, {}]

    def receive(rank: int) -> None:
        sink = got[rank - 1]
        groups[rank].receive_buckets(manifest, lambda n, v: sink.__setitem__(n, v.clone()))

    await asyncio.wait_for(
        asyncio.gather(
            asyncio.to_thread(groups[0].send_buckets, manifest, tensors),
            *(asyncio.to_thread(receive, r) for r in (1, 2)),
        ),
        30,
    )
    for tensors_got in got:
        assert tensors_got.keys() == tensors.keys()
        assert all(torch.equal(tensors_got[k], tensors[k]) for k in tensors)


async def test_a_receiver_whose_sender_never_sends_fails_after_the_timeout():
    from asyncrl.weights.group import BroadcastGroup

    address = free_tcp_endpoint().removeprefix("tcp://")
    groups = await asyncio.gather(
        *(asyncio.to_thread(BroadcastGroup.join, address, r, 2, timeout_s=1.0) for r in (0, 1))
    )
    manifest = layout(model(), chunk_bytes=300, blob="b")
    # Rank 0 (the trainer) died or stalled: gloo's timeout raises a RuntimeError. A hang
    # would end in wait_for's TimeoutError instead, which this does not accept.
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(
            asyncio.to_thread(groups[1].receive_buckets, manifest, lambda n, v: None), 30
        )


def test_bucket_buffers_reuse_one_buffer_per_dtype_and_slot_and_grow_for_a_larger_bucket():
    from asyncrl.weights.buckets import BucketBuffers

    buffers = BucketBuffers()
    a = buffers.get(Bucket(0, 1, "float32", 100))
    b = buffers.get(Bucket(1, 2, "float32", 60))
    assert b.data_ptr() == a.data_ptr() and b.numel() == 60  # the same memory again
    c = buffers.get(Bucket(2, 3, "bfloat16", 10))
    assert c.dtype == torch.bfloat16 and buffers.nbytes == 100 * 4 + 10 * 2
    d = buffers.get(Bucket(3, 4, "float32", 200))
    assert d.numel() == 200 and buffers.nbytes == 200 * 4 + 10 * 2  # grown, not added
    e = buffers.get(Bucket(4, 5, "float32", 50), slot=1)  # the bucket filled beside it
    assert e.data_ptr() != d.data_ptr() and buffers.nbytes == 250 * 4 + 10 * 2


def test_a_large_tensor_is_a_bucket_of_its_own():
    entries = layout(model(), chunk_bytes=1, blob="b").entries
    assert plan_buckets(entries, bucket_bytes=1 << 30, direct_bytes=256) == [
        Bucket(0, 1, "float32", 320),  # embed: 1280 bytes, alone
        Bucket(1, 2, "float32", 8),  # norm1: cut off by the large one after it
        Bucket(2, 3, "float32", 64),  # proj: 256 bytes, alone
        Bucket(3, 4, "bfloat16", 16),
        Bucket(4, 6, "float32", 32),  # norm2 + head: small, together
    ]  # fmt: skip


async def test_large_tensors_are_received_straight_into_their_destination():
    from asyncrl.weights.buckets import DIRECT_BYTES
    from asyncrl.weights.group import BroadcastGroup

    address = free_tcp_endpoint().removeprefix("tcp://")
    sender, receiver = await asyncio.gather(
        *(asyncio.to_thread(BroadcastGroup.join, address, r, 2) for r in (0, 1))
    )
    tensors = model(3) | {"big": torch.randn(DIRECT_BYTES // 4 + 1)}
    manifest = layout(tensors, chunk_bytes=1 << 30, blob="b")
    out = {k: torch.zeros_like(v) for k, v in tensors.items()}
    where = out["big"].data_ptr()
    sunk: list[str] = []

    def sink(name: str, view: torch.Tensor) -> None:
        sunk.append(name)
        out[name].copy_(view)

    await asyncio.wait_for(
        asyncio.gather(
            asyncio.to_thread(sender.send_buckets, manifest, tensors),
            asyncio.to_thread(receiver.receive_buckets, manifest, sink, out=out),
        ),
        30,
    )
    assert all(torch.equal(out[k], tensors[k]) for k in tensors)
    assert "big" not in sunk and "embed" in sunk  # small ones went through the buffer
    assert out["big"].data_ptr() == where  # into the destination, not a buffer
