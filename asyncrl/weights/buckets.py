"""A weight version cut into buckets for a broadcast (the ``dist`` transport).

One collective per tensor has a fixed cost that dominates the small ones (norms, biases),
so a bucket is a run of consecutive manifest entries of one dtype, at most
``bucket_bytes`` in all, sent as one flat 1-D tensor::

    bucket[k] = cat(t.reshape(-1) for t in tensors[start_k:end_k])

A tensor of at least ``DIRECT_BYTES`` is a bucket alone, sent and received where it lies,
so the large tensors (nearly all of a model's bytes) are copied by neither end. The plan
is a pure function of the announced manifest, so both ends compute the same one. Each end
fills or empties one bucket while the other is on the wire, in two reused buffers per
dtype (``BucketBuffers``: fresh memory would pay its page faults every version).
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


#: A tensor this large goes as itself, in a bucket of its own: below it, a bucket's copies
#: cost less than the collectives they save (measured: ``docs/benchmarks.md``).
DIRECT_BYTES = 16 << 20


def plan_buckets(
    entries: Sequence[TensorEntry], bucket_bytes: int, direct_bytes: int | None = None
) -> list[Bucket]:
    """Consecutive runs of one dtype, each at most ``bucket_bytes``; a tensor of at least
    ``direct_bytes`` (None: only one larger than a bucket) is a bucket alone."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    alone = min(bucket_bytes + 1, direct_bytes or bucket_bytes + 1)
    buckets: list[Bucket] = []
    start, size, numel = 0, 0, 0
    for i, entry in enumerate(entries):
        first = entries[start]
        fits = entry.dtype == first.dtype and size + entry.nbytes <= bucket_bytes
        if i > start and (not fits or entry.nbytes >= alone or first.nbytes >= alone):
            buckets.append(Bucket(start, i, first.dtype, numel))
            start, size, numel = i, 0, 0
        size += entry.nbytes
        numel += _numel(entry)
    if start < len(entries):
        buckets.append(Bucket(start, len(entries), entries[start].dtype, numel))
    return buckets


def manifest_buckets(manifest: BlobManifest) -> list[Bucket]:
    """The plan of an announced ``dist`` version (``chunk_bytes`` is its bucket size)."""
    return plan_buckets(manifest.entries, manifest.chunk_bytes, DIRECT_BYTES)


def as_itself(
    bucket: Bucket, entries: Sequence[TensorEntry], tensors: Mapping[str, torch.Tensor] | None
) -> torch.Tensor | None:
    """The one tensor of a one-tensor ``bucket`` in ``tensors``, when it can be sent or
    received as the bucket itself (contiguous, of the bucket's dtype); else None."""
    if tensors is None or bucket.end - bucket.start != 1:
        return None
    entry = entries[bucket.start]
    t = tensors.get(entry.name)
    if t is None or t.dtype != torch_dtype(bucket.dtype) or list(t.shape) != list(entry.shape):
        return None
    t = t.detach()
    return t.view(-1) if t.is_contiguous() else None


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
    """Flat buffers per dtype and slot (two slots: one bucket on the wire while the next
    is filled or emptied), each as large as the largest bucket asked for; a bucket's
    buffer is a view of it, valid until the next ``get`` of that dtype and slot."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = device
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    def get(self, bucket: Bucket, slot: int = 0) -> torch.Tensor:
        """A ``bucket.numel``-element buffer of the bucket's dtype (reused memory)."""
        key = (bucket.dtype, slot)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < bucket.numel:
            buffer = self._buffers[key] = empty_bucket(bucket, self.device)
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
