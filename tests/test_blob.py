"""Chunked pull of tensor sets: bit-exact, into caller tensors, bounded and validated."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl.wire.blob import BlobClient, BlobServer, _targets, layout
from asyncrl.wire.errors import PeerLost, RemoteError, WireError
from asyncrl.wire.messages import BlobChunk, FetchDone


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(300, 17, generator=g).to(torch.bfloat16),
        "norm": torch.randn(17, generator=g),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(1001, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
        "scalar": torch.tensor(3.5, dtype=torch.float64),
    }


@pytest.mark.parametrize("chunk", [97, 4096, 1 << 22], ids=["tiny", "4k", "4m"])
async def test_a_pulled_blob_is_bit_exact_whatever_the_chunk_size(endpoint: str, chunk: int):
    src = tensors()
    async with (
        BlobServer(endpoint, chunk_bytes=chunk) as server,
        BlobClient(server.endpoint, window=3) as client,
    ):
        manifest = server.put("v1", src)
        out = await client.fetch("v1")
    assert manifest.num_chunks == -(-manifest.total_bytes // chunk)
    assert set(out) == set(src)
    for name, t in src.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))


async def test_a_pull_can_write_straight_into_existing_tensors(endpoint: str):
    src = tensors()
    dest = {k: torch.empty_like(v) for k, v in src.items()}
    async with (
        BlobServer(endpoint, chunk_bytes=256) as server,
        BlobClient(server.endpoint) as client,
    ):
        server.put("v2", src)
        got = await client.fetch("v2", out=dest)
    assert got is dest
    assert all(torch.equal(dest[k], v) for k, v in src.items())


async def test_destination_tensors_of_the_wrong_shape_are_refused(endpoint: str):
    src = tensors()
    dest = {k: torch.empty_like(v) for k, v in src.items()}
    dest["norm"] = torch.empty(18)
    async with BlobServer(endpoint) as server, BlobClient(server.endpoint) as client:
        server.put("v", src)
        with pytest.raises(ValueError, match=r"out\['norm'\] must be a float32 tensor"):
            await client.fetch("v", out=dest)


async def test_only_the_newest_blobs_are_kept_and_asking_for_an_old_one_says_so(endpoint: str):
    async with BlobServer(endpoint, keep=2) as server, BlobClient(server.endpoint) as client:
        for v in range(1, 4):
            server.put(f"v{v}", {"w": torch.full((4,), float(v))})
        assert server.blobs == ["v2", "v3"]
        with pytest.raises(RemoteError, match=r"'v1' is not served; available: \['v2', 'v3'\]"):
            await client.fetch("v1")
        assert (await client.fetch("v3"))["w"].tolist() == [3.0] * 4


async def test_a_server_records_who_completed_a_pull_so_an_exiting_trainer_can_wait(
    endpoint: str,
):
    async with BlobServer(endpoint, chunk_bytes=97) as server:
        server.put("v", tensors())
        waiter = asyncio.create_task(server.wait_completed("v", ["eval"]))
        async with (
            BlobClient(server.endpoint, window=2, puller="rollout-0") as rollout,
            BlobClient(server.endpoint, window=2, puller="eval") as ev,
        ):
            await ev.manifest("v")  # a manifest alone is not a pull
            await rollout.fetch("v")  # someone else's pull does not count
            await asyncio.sleep(0.05)
            assert server.completed("v") == ["rollout-0"] and not waiter.done()
            await ev.fetch("v")
        async with asyncio.timeout(5):
            await waiter
    assert server.completed("v") == ["rollout-0", "eval"] and server.completed("other") == []


async def test_a_pull_whose_done_notice_meets_an_exited_server_still_returns_the_data(
    endpoint: str, monkeypatch
):
    """The server counts the pull on FetchDone and may exit (a trainer's last version)
    before its reply goes out: the reset then fails only that courtesy, not the pull."""
    call = BlobClient.call

    async def reset_on_done(self, msg, *args, **kwargs):
        if isinstance(msg, FetchDone):
            await call(self, msg, *args, **kwargs)  # counted, then the server is gone
            raise PeerLost("connection reset; call may or may not have run")
        return await call(self, msg, *args, **kwargs)

    monkeypatch.setattr(BlobClient, "call", reset_on_done)
    async with BlobServer(endpoint, chunk_bytes=97) as server:
        server.put("v", tensors())
        async with BlobClient(server.endpoint, window=2, puller="eval") as client:
            got = await client.fetch("v")
        assert server.completed("v") == ["eval"]
    assert all(torch.equal(got[k], v) for k, v in tensors().items())


def test_layout_aligns_every_tensor_to_64_bytes():
    m = layout(tensors(), 1024, "b")
    assert all(e.offset % 64 == 0 for e in m.entries)
    assert m.total_bytes >= sum(e.nbytes for e in m.entries)


class LyingServer(BlobServer):
    """Answers chunk requests with fewer bytes than the chunk holds."""

    async def _serve(self, req, peer):  # type: ignore[no-untyped-def]
        reply = await super()._serve(req, peer)
        if isinstance(reply, BlobChunk):
            reply.parts = reply.parts[:-1]
        return reply


async def test_a_chunk_that_does_not_cover_its_bytes_is_refused(endpoint: str):
    async with (
        LyingServer(endpoint, chunk_bytes=512) as server,
        BlobClient(server.endpoint) as client,
    ):
        server.put("v", tensors())
        with pytest.raises(WireError, match="does not cover its bytes"):
            await client.fetch("v")


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("chunk_bytes", 0, "chunk_bytes 0"),
        ("total_bytes", 1 << 40, "claims"),
    ],
)
def test_manifests_that_lie_are_refused_before_anything_is_allocated(field, value, message):
    m = layout(tensors(), 1024, "b")
    setattr(m, field, value)
    with pytest.raises(WireError, match=message):
        _targets(m, None)
