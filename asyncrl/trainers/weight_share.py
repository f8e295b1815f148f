"""The ``ipc`` transport: weight versions handed over in memory shared on one host.

The trainer copies each version once, bucket by bucket, into shared memory: named shared
memory for CPU tensors, device memory whose CUDA IPC handles travel for GPU tensors
(``engines/tensor_payload.py``). The announcement carries one handle per bucket, each
an ``/update_weights_from_tensor`` payload (``load_format: "flattened_bucket"``), so an
engine on the same host maps the bucket and copies its tensors straight into its own
model, and an SGLang server takes the very same payload over HTTP. Nothing goes through
a socket but the handles. The blob server serves views of the same buckets, so a
subscriber on another host, or one whose version was dropped here, pulls it instead, at
no extra memory.

A bucket is a run of manifest entries of at most ``bucket_bytes`` (one larger tensor is
a bucket alone): few handles to open, which matters for CUDA, where each costs an IPC
map. The newest ``keep`` versions stay shared; an engine that opens an older one finds
it gone and pulls.

Used by ``weight_sync.WeightPublisher`` (trainer side) and ``WeightReceiver.fetch``.
"""

from __future__ import annotations

import socket
from collections import OrderedDict

import torch

from asyncrl.engines.tensor_payload import (
    bucket_layout,
    decode,
    encode,
    named_sharing,
    named_tensors,
    piece,
)
from asyncrl.trainers.weight_buckets import Sink, plan_buckets
from asyncrl.wire.blob import layout

#: The host a version is shared on: a subscriber elsewhere pulls.
HOST = socket.gethostname()


class SharedVersions:
    """The newest ``keep`` versions, each as shared buckets (trainer side)."""

    def __init__(self, *, keep: int = 2, bucket_bytes: int = 64 << 20) -> None:
        self.keep, self.bucket_bytes = max(1, keep), bucket_bytes
        self._kept: OrderedDict[int, list[torch.Tensor]] = OrderedDict()

    def share(
        self, version: int, tensors: dict[str, torch.Tensor]
    ) -> tuple[list[str], dict[str, torch.Tensor]]:
        """Copy ``tensors`` into shared buckets: one handle per bucket, and each tensor as
        a view of its bucket (to serve by pull without a second copy)."""
        entries = layout(tensors, chunk_bytes=self.bucket_bytes, blob="").entries
        handles: list[str] = []
        views: dict[str, torch.Tensor] = {}
        flats: list[torch.Tensor] = []
        for bucket in plan_buckets(entries, self.bucket_bytes):
            named = [(e.name, tensors[e.name]) for e in entries[bucket.start : bucket.end]]
            metadata = bucket_layout(named)
            flat = torch.empty(metadata[-1].end_idx, dtype=torch.uint8, device=named[0][1].device)
            if flat.device.type == "cpu":
                with named_sharing():
                    flat.share_memory_()
            parts = [t.detach().contiguous().view(-1).view(torch.uint8) for _, t in named]
            torch.cat(parts, out=flat)
            handles.append(encode({"flattened_tensor": flat, "metadata": metadata}))
            views.update((m.name, piece(flat, m)) for m in metadata)
            flats.append(flat)
        self._kept[version] = flats
        while len(self._kept) > self.keep:
            self._kept.popitem(last=False)
        return handles, views


def take_shared(handles: list[str], sink: Sink) -> None:
    """Map each bucket of ``handles`` and hand each of its tensors to ``sink(name, view)``
    (a view of shared memory: copy it). ``EngineError`` when a bucket is gone."""
    for handle in handles:
        for name, view in named_tensors(decode(handle), "flattened_bucket").items():
            sink(name, view)
