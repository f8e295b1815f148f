"""A weight version cut into buckets for a broadcast (the ``dist`` transport).

Broadcasting a model tensor by tensor costs one collective per tensor (272 for
SmolLM2-135M), and each has a fixed cost that dominates the small ones (norms, biases).
A bucket is a run of consecutive manifest entries of one dtype, at most ``bucket_bytes``
in all (a larger tensor is a bucket alone), sent as one flat 1-D tensor::

    bucket[k] = cat(t.reshape(-1) for t in tensors[start_k:end_k])

The plan is a pure function of the announced manifest (its entries, and its
``chunk_bytes`` as the bucket size), so both ends compute the same plan and nothing but
the manifest travels beside the tensors. The sender flattens one bucket at a time; a
receiver receives into one bucket buffer and copies each tensor out to where it goes (its
model's own parameters, say). Both ends reuse their bucket buffer (``BucketBuffers``):
fresh memory costs its page faults on every version (0.21 s per 512 MiB on the project's
machine, three times the copy into it). So each side holds one bucket per dtype beyond its
weights, for as long as it syncs weights, and no more.

Users: ``weight_group.BroadcastGroup.send_buckets`` / ``receive_buckets``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from asyncrl.wire.codec import torch_dtype
from asyncrl.wire.messages import BlobManifest, TensorEntry


@dataclass(frozen=True, slots=True)
class Bucket:
    """Entries ``[start, end)`` of a manifest, all of ``dtype``: ``numel`` elements."""

    start: int
    end: int
    dtype: str
    numel: int


def plan_buckets(entries: Sequence[TensorEntry], bucket_bytes: int) -> list[Bucket]:
    """Consecutive runs of one dtype, each at most ``bucket_bytes`` unless one tensor is."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    start, size, numel = 0, 0, 0
    for i, entry in enumerate(entries):
        same = i > start and entry.dtype == entries[start].dtype
        if i > start and (not same or size + entry.nbytes > bucket_bytes):
            buckets.append(Bucket(start, i, entries[start].dtype, numel))
            start, size, numel = i, 0, 0
        size += entry.nbytes
        numel += _numel(entry)
    if start < len(entries):
        buckets.append(Bucket(start, len(entries), entries[start].dtype, numel))
    return buckets


def manifest_buckets(manifest: BlobManifest) -> list[Bucket]:
    """The plan of an announced ``dist`` version (``chunk_bytes`` is its bucket size)."""
    return plan_buckets(manifest.entries, manifest.chunk_bytes)


def flatten(
    bucket: Bucket,
    entries: Sequence[TensorEntry],
    tensors: Mapping[str, torch.Tensor],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The bucket's tensors as one contiguous 1-D tensor: a copy into ``out`` (a buffer of
    ``bucket.numel`` elements) when given, else into new memory."""
    parts = [tensors[e.name].detach().reshape(-1) for e in entries[bucket.start : bucket.end]]
    if out is not None:
        return torch.cat(parts, out=out)
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


def views(
    bucket: Bucket, entries: Sequence[TensorEntry], flat: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, view of flat shaped as the entry)`` for each tensor of the bucket."""
    offset = 0
    for e in entries[bucket.start : bucket.end]:
        n = _numel(e)
        yield e.name, flat[offset : offset + n].view(e.shape)
        offset += n


def empty_bucket(bucket: Bucket, device: torch.device | str = "cpu") -> torch.Tensor:
    """A new buffer for ``bucket``."""
    return torch.empty(bucket.numel, dtype=torch_dtype(bucket.dtype), device=device)


class BucketBuffers:
    """One flat buffer per dtype, as large as the largest bucket asked for; a bucket's
    buffer is a view of it, valid until the next ``get`` of that dtype."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, bucket: Bucket) -> torch.Tensor:
        """A ``bucket.numel``-element buffer of the bucket's dtype (reused memory)."""
        buffer = self._buffers.get(bucket.dtype)
        if buffer is None or buffer.numel() < bucket.numel:
            buffer = self._buffers[bucket.dtype] = empty_bucket(bucket, self.device)
        return buffer[: bucket.numel]

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


Sink = Callable[[str, torch.Tensor], None]
"""Takes one received tensor (a view of the bucket buffer: copy it before the next)."""


def _numel(entry: TensorEntry) -> int:
    n = 1
    for d in entry.shape:
        n *= d
    return n
