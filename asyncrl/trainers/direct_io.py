"""Checkpoint files written past the page cache (``O_DIRECT``).

A checkpoint is written once, fsynced, and not read again soon, so the page cache only
costs: on a VM where a buffered write runs at 60-180 MB/s (the kernel allocating and
copying every page, in CPU time the trainer needs) the real model's 1.6 GB checkpoint
took 15-24 s a save, where ``O_DIRECT`` writes 1.1 GB/s with 0.1 s of CPU
(``bench/checkpoint_write.py``). The files are the usual ones: ``save_tensors`` writes
the safetensors format, ``save_object`` ``torch.save``'s; where the filesystem refuses
``O_DIRECT`` (tmpfs, some network mounts) or the OS has none, they are written buffered.
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from typing_extensions import Buffer

#: Offsets, lengths and buffer addresses of direct I/O are multiples of this (the
#: largest logical block size in use; 512-byte devices accept it too).
ALIGN = 4096

#: safetensors' names for the dtypes it stores.
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class DirectFile(io.RawIOBase):
    """A new file at ``path``, written sequentially through a page-aligned staging buffer
    of ``buffer_bytes`` with ``O_DIRECT`` where the filesystem takes it (``direct``: try
    it at all). ``close`` writes the last block zero-padded and truncates the file to the
    bytes written; the caller fsyncs, as for any file."""

    def __init__(self, path: Path | str, *, buffer_bytes: int = 8 << 20, direct: bool = True):
        super().__init__()
        flag = getattr(os, "O_DIRECT", 0) if direct else 0
        mode = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = bool(flag)
        try:
            self._fd = os.open(path, mode | flag, 0o644)
        except OSError as exc:
            if not flag or exc.errno != errno.EINVAL:
                raise
            self._fd, self.direct = os.open(path, mode, 0o644), False
        size = -(-buffer_bytes // ALIGN) * ALIGN
        self._buffer = mmap.mmap(-1, size)  # anonymous: page-aligned
        self._view = memoryview(self._buffer)
        self._used = 0
        self._length = 0  # bytes the caller wrote

    def writable(self) -> bool:
        return True

    def write(self, data: Buffer) -> int:
        src = memoryview(data).cast("B")
        done = 0
        while done < len(src):
            n = min(len(src) - done, len(self._view) - self._used)
            self._view[self._used : self._used + n] = src[done : done + n]
            self._used += n
            done += n
            if self._used == len(self._view):
                self._flush_buffer()
        self._length += done
        return done

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._used:
                padded = -(-self._used // ALIGN) * ALIGN if self.direct else self._used
                self._view[self._used : padded] = bytes(padded - self._used)
                self._used = padded
                self._flush_buffer()
            os.ftruncate(self._fd, self._length)
        finally:
            os.close(self._fd)
            self._view.release()
            self._buffer.close()
            super().close()

    def _flush_buffer(self) -> None:
        pending = self._view[: self._used]
        while len(pending):
            try:
                n = os.write(self._fd, pending)
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:
                    raise
                self._buffered()  # the filesystem took the flag, not the I/O
                continue
            pending = pending[n:]
            if n % ALIGN:  # a short odd write: the rest cannot stay aligned
                self._buffered()
        self._used = 0

    def _buffered(self) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~getattr(os, "O_DIRECT", 0))
        self.direct = False


def save_tensors(
    tensors: Mapping[str, torch.Tensor],
    path: Path | str,
    metadata: Mapping[str, str] | None = None,
    *,
    direct: bool = True,
) -> None:
    """``safetensors.torch.save_file(tensors, path, metadata)``'s format, streamed from the
    tensors' memory (no copy of the whole file is made). Tensors are laid out largest
    element first, then by name, as safetensors does, so each starts aligned to its
    element size."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r}: safetensors stores no {t.dtype}")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with DirectFile(path, direct=direct) as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for name in order:
            t = tensors[name]
            if t.numel():
                out.write(t.reshape(-1).view(torch.uint8).numpy())


def save_object(obj: Any, path: Path | str, *, direct: bool = True) -> None:
    """``torch.save(obj, path)``, through a ``DirectFile``."""
    with DirectFile(path, direct=direct) as out:
        torch.save(obj, out)
