"""The ``ipc`` transport: weight versions handed over in memory shared on one host.

The trainer copies each version once, bucket by bucket, into shared memory (named shared
memory for CPU tensors, CUDA IPC for GPU ones). The announcement carries one
``/update_weights_from_tensor`` payload per bucket (few handles: each costs a CUDA IPC
map), so an engine on the host maps it and copies straight into its model, and only
handles cross a socket. A subscriber elsewhere, or one whose version was refilled, pulls
from the blob server, which serves views of the same buckets.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import shutil
import socket
from pathlib import Path

import torch

from asyncrl.errors import EngineError, InputError
from asyncrl.weights.buckets import Sink, plan_buckets
from asyncrl.weights.payload import (
    bucket_layout,
    decode,
    encode,
    named_sharing,
    named_tensors,
    piece,
)
from asyncrl.wire.blob import layout

#: The host a version is shared on: a subscriber elsewhere pulls.
HOST = socket.gethostname()
#: Opens of a shared bucket per version that its name must outlive (``_allow_opens``).
_OPENS = 256


class _Slot:
    """One version's shared buckets, reused by a later version of the same layout."""

    def __init__(self, named: list[list[tuple[str, torch.Tensor]]]) -> None:
        self.signature = _signature(named)
        device = named[0][0][1].device
        self.stamp = _shared_empty(8, device).view(torch.int64)  # the version it holds
        self.flats, self.handles, self.views = [], [], {}
        for bucket in named:
            metadata = bucket_layout(bucket)
            flat = _shared_empty(metadata[-1].end_idx, device)
            payload = {"flattened_tensor": flat, "metadata": metadata, "stamp": self.stamp}
            self.flats.append(flat)
            self.handles.append(encode(payload))
            self.views.update((m.name, piece(flat, m)) for m in metadata)

    def release(self) -> None:
        """Unlink the slot's names: no new open finds them; the memory goes once the
        last process that has it mapped lets go."""
        for t in (self.stamp, *self.flats):
            if t.device.type == "cpu":
                _, name, _ = t.untyped_storage()._share_filename_cpu_()
                with contextlib.suppress(FileNotFoundError):
                    _posixshmem.shm_unlink(name.decode())

    def fill(self, version: int, named: list[list[tuple[str, torch.Tensor]]]) -> None:
        """Copy a version in; the stamp says -1 meanwhile, so a reader can tell."""
        self.stamp[0] = -1
        for flat, bucket in zip(self.flats, named, strict=True):
            torch.cat(
                [t.detach().contiguous().view(-1).view(torch.uint8) for _, t in bucket], out=flat
            )
            _allow_opens(flat)
        _allow_opens(self.stamp, len(self.handles))  # each bucket's handle opens it
        if self.stamp.device.type == "cuda":  # readers map it from other processes
            torch.cuda.synchronize(self.stamp.device)
        self.stamp[0] = version


class SharedVersions:
    """The newest ``keep`` versions as shared buckets (trainer side), in a ring of
    ``keep + 1`` slots reused version after version: memory that is shared (and paged in)
    once, not per version. A slot is refilled only after its version has left the
    newest ``keep``; each bucket carries the slot's stamp (the version it holds, -1
    while refilled), so a reader that was too slow can tell (``take_shared``)."""

    def __init__(self, *, keep: int = 2, bucket_bytes: int = 64 << 20) -> None:
        self.keep, self.bucket_bytes = max(1, keep), bucket_bytes
        self._slots: list[_Slot | None] = [None] * (self.keep + 1)
        self._next = 0

    def share(
        self, version: int, tensors: dict[str, torch.Tensor]
    ) -> tuple[list[str], dict[str, torch.Tensor]]:
        """Copy ``tensors`` into the next slot: one handle per bucket, and each tensor as
        a view of its bucket (to serve by pull without a second copy)."""
        entries = layout(tensors, chunk_bytes=self.bucket_bytes, blob="").entries
        named = [
            [(e.name, tensors[e.name]) for e in entries[b.start : b.end]]
            for b in plan_buckets(entries, self.bucket_bytes)
        ]
        index = self._next % len(self._slots)
        self._next += 1
        slot = self._slots[index]
        if slot is None or slot.signature != _signature(named):
            if slot is not None:  # its memory goes back before the new one is taken
                slot.release()
                self._slots[index] = None
            _check_room(named, len(self._slots))
            slot = self._slots[index] = _Slot(named)
        slot.fill(version, named)
        return slot.handles, slot.views

    def close(self) -> None:
        """Unlink every slot (the extra opens would keep them until the process exits)."""
        for slot in self._slots:
            if slot is not None:
                slot.release()
        self._slots = [None] * len(self._slots)


def _check_room(named: list[list[tuple[str, torch.Tensor]]], slots: int) -> None:
    """Refuse, with what to do, a version the host's shared memory cannot hold (Docker
    gives /dev/shm 64 MB unless told otherwise): failing later would be a bus error."""
    if named[0][0][1].device.type != "cpu" or not Path("/dev/shm").is_dir():
        return
    need = sum(t.nbytes for bucket in named for _, t in bucket)
    free = shutil.disk_usage("/dev/shm").free
    if need > free:
        raise InputError(
            f"--update-weight-transport ipc shares {slots} versions of {need / 2**30:.2f} GiB "
            f"in /dev/shm, which has {free / 2**30:.2f} GiB free: enlarge it (docker "
            f"--shm-size) or use --update-weight-transport pull"
        )


def _signature(named: list[list[tuple[str, torch.Tensor]]]) -> list[list[tuple]]:
    return [[(n, t.dtype, tuple(t.shape), t.device) for n, t in bucket] for bucket in named]


def _shared_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of memory other processes on the host can map: named shared memory,
    allocated there (not copied there) for the CPU; device memory for CUDA (its IPC
    handle is made when it is pickled)."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    with named_sharing():
        storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _allow_opens(flat: torch.Tensor, handles: int = 1) -> None:
    """torch counts the opens of named shared memory in the memory itself and unlinks its
    name when the count reaches zero: a handle is meant to be opened once, but ours is
    opened by every engine, version after version. So each version adds ``_OPENS`` to the
    count (more than any job has engines); torch's shm manager removes the name once
    every process that used it is gone."""
    if flat.device.type == "cpu":
        storage = flat.untyped_storage()
        for _ in range(_OPENS * handles):
            storage._shared_incref()


def take_shared(handles: list[str], version: int, sink: Sink) -> None:
    """Map each bucket of ``handles`` and hand each of its tensors to ``sink(name, view)``
    (a view of shared memory: copy it). ``EngineError`` when a bucket is gone, or no
    longer holds ``version`` (refilled: we were too slow)."""
    for handle in handles:
        payload = decode(handle)
        stamp = payload.get("stamp") if isinstance(payload, dict) else None
        _check_stamp(stamp, version)
        for name, view in named_tensors(payload, "flattened_bucket").items():
            sink(name, view)
        _check_stamp(stamp, version)


def check_shared(handles: list[str], version: int) -> None:
    """``EngineError`` unless the slot of ``handles`` holds ``version`` (a server that is
    handed them cannot tell a refilled slot: its caller checks before and after)."""
    if handles:
        payload = decode(handles[0])
        _check_stamp(payload.get("stamp") if isinstance(payload, dict) else None, version)


def _check_stamp(stamp: object, version: int) -> None:
    if isinstance(stamp, torch.Tensor) and int(stamp[0]) != version:
        raise EngineError(
            f"shared version {version} was replaced (the slot holds "
            f"{int(stamp[0])}): too slow to take it"
        )
