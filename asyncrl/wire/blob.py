"""Chunked pull of large tensor sets: ``BlobServer`` (ROUTER) and ``BlobClient`` (DEALER).

The trainer puts each new weight version here and announces it on pub/sub; engines pull
it at their own pace, ``window`` chunk requests in flight (the zmq file-transfer pattern
with credits: throughput not bound by round trips, at most ``window * chunk_bytes`` in
transit). A blob lays its tensors out in one byte space, each 64-byte aligned, cut into
``chunk_bytes`` chunks.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from asyncrl.wire.codec import Codec, torch_dtype, torch_dtype_name
from asyncrl.wire.errors import PeerLost, WireError
from asyncrl.wire.messages import (
    BlobChunk,
    BlobManifest,
    FetchChunk,
    FetchDone,
    FetchManifest,
    TensorEntry,
)
from asyncrl.wire.rpc import RpcClient, RpcServer

_ALIGN = 64

if TYPE_CHECKING:
    import torch


BlobRequest = FetchManifest | FetchChunk | FetchDone
BlobReply = BlobManifest | BlobChunk


def layout(tensors: dict[str, torch.Tensor], chunk_bytes: int, blob: str) -> BlobManifest:
    """Assign each tensor an aligned offset in one byte space."""
    entries, offset = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        entries.append(
            TensorEntry(
                name=name,
                dtype=torch_dtype_name(t.dtype),
                shape=list(t.shape),
                offset=offset,
                nbytes=nbytes,
            )
        )
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return BlobManifest(blob=blob, total_bytes=offset, chunk_bytes=chunk_bytes, entries=entries)


class _StoredBlob:
    def __init__(self, manifest: BlobManifest, tensors: dict[str, torch.Tensor]) -> None:
        import torch

        self.manifest = manifest
        # Byte views, no copy: numpy for host tensors, the tensor itself on a GPU (an ipc
        # version's device buckets), copied to the host a chunk at a time if ever pulled,
        # not a whole version through host memory on each publish.
        self.views = []
        for e in manifest.entries:
            flat = tensors[e.name].detach().contiguous().reshape(-1).view(torch.uint8)
            self.views.append(flat.numpy() if flat.device.type == "cpu" else flat)
        self.starts = [e.offset for e in manifest.entries]

    def chunk(self, index: int) -> list[tuple[int, np.ndarray]]:
        m = self.manifest
        if not 0 <= index < m.num_chunks:
            raise IndexError(f"chunk {index} out of range; {m.blob} has {m.num_chunks}")
        lo, hi = index * m.chunk_bytes, min((index + 1) * m.chunk_bytes, m.total_bytes)
        parts = []
        for i, start, end in _overlapping(m.entries, self.starts, lo, hi):
            view, offset = self.views[i], m.entries[i].offset
            part = view[start - offset : end - offset]
            parts.append((start, part if isinstance(part, np.ndarray) else part.cpu().numpy()))
        return parts


def _overlapping(
    entries: Sequence[TensorEntry], starts: list[int], lo: int, hi: int
) -> Iterator[tuple[int, int, int]]:
    """``(i, start, end)``: the bytes of ``[lo, hi)`` that entry ``i`` holds, in order
    (found by bisection: a chunk spans few of a model's hundreds of tensors)."""
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(entries) and entries[i].offset < hi:
        start, end = max(lo, entries[i].offset), min(hi, entries[i].offset + entries[i].nbytes)
        if start < end:
            yield i, start, end
        i += 1


class BlobServer(RpcServer[BlobRequest, BlobReply]):
    """Serves chunks of the newest ``keep`` blobs; asking for a dropped one is a
    ``RemoteError`` naming those it has, so a slow engine learns to move to the latest."""

    def __init__(
        self,
        endpoint: str,
        *,
        chunk_bytes: int = 4 * 1024 * 1024,
        keep: int = 2,
        max_frame_bytes: int = 64 * 1024 * 1024,
        name: str = "blob",
        allow_remote: bool = False,
    ) -> None:
        if not 0 < chunk_bytes <= max_frame_bytes:
            raise ValueError(f"chunk_bytes must be in (0, {max_frame_bytes}], got {chunk_bytes}")
        codec_req = Codec(BlobRequest, max_frame_bytes=max_frame_bytes)
        codec_rep = Codec(BlobReply, max_frame_bytes=max_frame_bytes)
        super().__init__(
            endpoint, codec_req, codec_rep, self._serve, name=name, allow_remote=allow_remote
        )
        self.chunk_bytes = chunk_bytes
        self.keep = keep
        self._blobs: OrderedDict[str, _StoredBlob] = OrderedDict()
        # Who completed a pull of each blob; a trainer about to exit waits on them.
        self._completed: dict[str, list[str]] = {}
        self._served = asyncio.Condition()

    def put(self, blob: str, tensors: dict[str, torch.Tensor]) -> BlobManifest:
        """Store ``tensors`` under ``blob`` (dropping the oldest past ``keep``). They must
        not change while served: put a copy of live weights."""
        manifest = layout(tensors, self.chunk_bytes, blob)
        self._blobs[blob] = _StoredBlob(manifest, tensors)
        self._blobs.move_to_end(blob)
        while len(self._blobs) > self.keep:
            self._blobs.popitem(last=False)
        return manifest

    def remove(self, blob: str) -> None:
        """Stop serving ``blob``."""
        self._blobs.pop(blob, None)

    @property
    def blobs(self) -> list[str]:
        """Names of the blobs served now, oldest first."""
        return list(self._blobs)

    def completed(self, blob: str) -> list[str]:
        """The pullers (by name, in order) whose pull of ``blob`` completed."""
        return list(self._completed.get(blob, []))

    async def wait_completed(self, blob: str, pullers: Collection[str]) -> None:
        """Wait until every one of ``pullers`` has completed a pull of ``blob``."""
        async with self._served:
            await self._served.wait_for(lambda: set(pullers) <= set(self.completed(blob)))

    async def _serve(self, req: BlobRequest, peer: bytes) -> BlobReply:
        stored = self._blobs.get(req.blob)
        if stored is None:
            raise KeyError(f"blob {req.blob!r} is not served; available: {self.blobs}")
        if isinstance(req, FetchManifest):
            return stored.manifest
        if isinstance(req, FetchDone):  # counted on the client's word: every byte arrived
            async with self._served:
                self._completed.setdefault(req.blob, []).append(req.by)
                self._served.notify_all()
            return BlobChunk(blob=req.blob, index=-1, parts=[])
        return BlobChunk(blob=req.blob, index=req.index, parts=stored.chunk(req.index))


class BlobClient(RpcClient[BlobRequest, BlobReply]):
    """Pulls blobs with ``window`` chunk requests in flight."""

    def __init__(
        self,
        endpoint: str,
        *,
        window: int = 16,
        max_frame_bytes: int = 64 * 1024 * 1024,
        identity: str | None = None,
        name: str = "blob",
        allow_remote: bool = False,
        puller: str = "",
    ) -> None:
        codec_req = Codec(BlobRequest, max_frame_bytes=max_frame_bytes)
        codec_rep = Codec(BlobReply, max_frame_bytes=max_frame_bytes)
        self.puller = puller
        super().__init__(
            endpoint,
            codec_req,
            codec_rep,
            max_inflight=window,
            identity=identity,
            name=name,
            allow_remote=allow_remote,
        )
        self.window = window

    async def manifest(self, blob: str) -> BlobManifest:
        """The manifest of ``blob``."""
        reply = await self.call(FetchManifest(blob=blob))
        if not isinstance(reply, BlobManifest):
            raise WireError(f"expected BlobManifest for {blob!r}, got {type(reply).__name__}")
        return reply

    async def fetch(
        self, blob: str, *, out: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Pull ``blob`` and return ``{name: tensor}``.

        With ``out`` (tensors of the manifest's names, dtypes and shapes, on any device;
        e.g. an engine's parameters or a staging buffer reused across versions), each chunk
        is copied straight into them and ``out`` is returned. Without it, the tensors are
        views into one fresh buffer.
        """
        m = await self.manifest(blob)
        targets = _targets(m, out)
        starts = [e.offset for e in m.entries]
        indices = iter(range(m.num_chunks))
        inflight: deque[tuple[int, asyncio.Future[BlobReply]]] = deque()
        try:
            for index in itertools.islice(indices, self.window):
                inflight.append((index, self._request(m.blob, index)))
            while inflight:
                index, fut = inflight.popleft()
                reply = await fut
                nxt = next(indices, None)
                if nxt is not None:  # keep the pipe full: ask before copying
                    inflight.append((nxt, self._request(m.blob, nxt)))
                _write_chunk(m, index, reply, starts, targets)
        finally:
            for _, fut in inflight:
                fut.cancel()
        try:  # lets an exiting server know we are done
            await self.call(FetchDone(blob=m.blob, by=self.puller))
        except PeerLost:  # it counted us and exited before its reply: every byte is here
            pass
        return {e.name: t for e, t in zip(m.entries, targets, strict=True)} if out is None else out

    def _request(self, blob: str, index: int) -> asyncio.Future[BlobReply]:
        return self.start_call(FetchChunk(blob=blob, index=index))


def _write_chunk(
    m: BlobManifest, index: int, reply: BlobReply, starts: list[int], targets: list[torch.Tensor]
) -> None:
    """Check that each part of chunk ``index`` lies inside one tensor, and copy it there."""
    if not isinstance(reply, BlobChunk) or reply.index != index:
        raise WireError(f"bad reply for chunk {index} of {m.blob!r}")
    lo, hi = index * m.chunk_bytes, min((index + 1) * m.chunk_bytes, m.total_bytes)
    expected = list(_overlapping(m.entries, starts, lo, hi))
    got = [(offset, offset + data.nbytes) for offset, data in reply.parts]
    if got != [(start, end) for _, start, end in expected]:  # every byte once: no gap left
        raise WireError(f"chunk {index} of {m.blob!r} does not cover its bytes: {got}")
    for (i, start, _), (_, data) in zip(expected, reply.parts, strict=True):
        _copy_into(targets[i], start - m.entries[i].offset, data)


def _copy_into(target: torch.Tensor, start: int, data: np.ndarray) -> None:
    """Copy ``data`` to byte ``start`` of ``target`` (any device)."""
    import torch

    flat = target.view(-1).view(torch.uint8)[start : start + data.nbytes]
    if flat.device.type == "cpu":
        # numpy's single-threaded memcpy: torch's parallel copy fights zmq's I/O threads
        # for the cores (bench/wire.py).
        flat.numpy()[:] = data
    else:
        flat.copy_(torch.from_numpy(data))


def _check_manifest(m: BlobManifest) -> None:
    if m.chunk_bytes <= 0 or m.total_bytes < 0:
        raise WireError(
            f"manifest of {m.blob!r}: chunk_bytes {m.chunk_bytes}, total_bytes {m.total_bytes}"
        )
    end = 0
    for e in m.entries:
        if e.offset < end:
            raise WireError(f"manifest entry {e.name} is out of order or overlaps another")
        end = e.offset + e.nbytes
    if m.total_bytes > -(-end // _ALIGN) * _ALIGN:  # no room claimed beyond the tensors
        raise WireError(f"manifest of {m.blob!r} claims {m.total_bytes} bytes for {end}")
    for e in m.entries:
        dtype = torch_dtype(e.dtype)
        if e.offset + e.nbytes > m.total_bytes or e.offset % _ALIGN:
            raise WireError(f"manifest entry {e.name} at {e.offset} is out of bounds")
        if min(e.shape, default=0) < 0 or math.prod(e.shape) * dtype.itemsize != e.nbytes:
            raise WireError(f"manifest entry {e.name}: shape {e.shape} != {e.nbytes} bytes")


def _targets(m: BlobManifest, out: dict[str, torch.Tensor] | None) -> list[torch.Tensor]:
    """One destination tensor per manifest entry, checked against the manifest."""
    import torch

    _check_manifest(m)
    if out is None:
        base = torch.empty(m.total_bytes, dtype=torch.uint8)
        return [
            base[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype)).reshape(e.shape)
            if e.nbytes
            else torch.empty(e.shape, dtype=torch_dtype(e.dtype))
            for e in m.entries
        ]
    targets = []
    for e in m.entries:
        t = out.get(e.name)
        if t is None or t.dtype != torch_dtype(e.dtype) or list(t.shape) != e.shape:
            raise ValueError(
                f"out[{e.name!r}] must be a {e.dtype} tensor of shape {e.shape}, "
                f"got {None if t is None else (t.dtype, list(t.shape))}"
            )
        if not t.is_contiguous():
            raise ValueError(f"out[{e.name!r}] must be contiguous")
        targets.append(t)
    return targets
