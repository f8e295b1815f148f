"""Checkpoint files written past the page cache (``O_DIRECT``).

A checkpoint is written once, fsynced, and not read again soon, so the page cache only
costs. On a VM where a buffered write runs at 60-180 MB/s (the kernel paging in and
copying every page, in CPU time the trainer needs), the real model's 1.6 GB checkpoint
took 14-19 s to write and fsync, and 1.6-2.1 s past the page cache
(``bench/checkpoint_write.py``). The files are the usual ones: ``save_tensors`` writes
safetensors' file, ``save_object`` ``torch.save``'s. Where the filesystem refuses
``O_DIRECT`` (tmpfs before Linux 6.6, some network mounts) or the OS has no such flag
(macOS), they are written buffered.
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
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from typing_extensions import Buffer

#: Offsets, lengths and buffer addresses of direct I/O are multiples of this (the
#: largest logical block size in use; 512-byte devices accept it too).
ALIGN = 4096

#: safetensors' names for the dtypes written here, in the order of its ``Dtype`` enum:
#: a file lists its tensors by that rank, highest first, then by name.
SAFETENSORS_DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
}
_RANK = {dtype: rank for rank, dtype in enumerate(SAFETENSORS_DTYPES)}


class DirectFile(io.RawIOBase):
    """A new file at ``path``, written sequentially through a page-aligned staging buffer
    of ``buffer_bytes`` with ``O_DIRECT`` where the filesystem takes it (``direct``: try
    it at all; ``self.direct`` says whether it still does). ``close`` writes the last
    block zero-padded and truncates the file to the bytes written; the caller fsyncs, as
    for any file."""

    def __init__(self, path: Path | str, *, buffer_bytes: int = 8 << 20, direct: bool = True):
        super().__init__()
        self._fd, self._used, self._length = -1, 0, 0  # bytes staged, bytes the caller wrote
        size = -(-buffer_bytes // ALIGN) * ALIGN
        buffer = mmap.mmap(-1, size)  # anonymous: page-aligned
        self._view, self._buffer = memoryview(buffer), buffer
        flag = getattr(os, "O_DIRECT", 0) if direct else 0
        mode = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = bool(flag)
        try:
            self._fd = os.open(path, mode | flag, 0o666)
        except OSError as exc:
            if not flag or exc.errno != errno.EINVAL:
                self._release()
                raise
            self._fd, self.direct = os.open(path, mode, 0o666), False

    def writable(self) -> bool:
        return True

    def write(self, data: Buffer) -> int:
        with memoryview(data) as raw, raw.cast("B") as src:
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
            if self._used and self._fd >= 0:
                padded = -(-self._used // ALIGN) * ALIGN if self.direct else self._used
                self._view[self._used : padded] = bytes(padded - self._used)
                self._used = padded
                self._flush_buffer()
            if self._fd >= 0:
                os.ftruncate(self._fd, self._length)
        finally:
            self._release()

    def _release(self) -> None:
        """Close the descriptor and the staging buffer, once, whatever failed before."""
        fd, self._fd, self._used = self._fd, -1, 0
        try:
            if fd >= 0:
                os.close(fd)
        finally:
            if hasattr(self, "_buffer"):  # absent if the buffer could not be made
                self._view.release()
                self._buffer.close()
            super().close()

    def _flush_buffer(self) -> None:
        start = 0
        while start < self._used:
            try:
                with self._view[start : self._used] as pending:  # no slice outlives a raise
                    n = os.write(self._fd, pending)
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:
                    raise
                self._buffered()  # the filesystem took the flag, not the I/O
                continue
            start += n
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
    """``safetensors.torch.save_file(tensors, path, metadata)``'s file, byte for byte,
    streamed from the tensors' memory (no copy of the whole file is made). A dtype not in
    ``SAFETENSORS_DTYPES`` goes to ``save_file`` itself (buffered). Unlike ``save_file``,
    non-contiguous tensors are copied, and tensors that share memory are written apart."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    if any(t.dtype not in SAFETENSORS_DTYPES for t in tensors.values()):
        save_file(tensors, str(path), metadata=None if metadata is None else dict(metadata))
        return
    text = _header(tensors, metadata)
    with DirectFile(path, direct=direct) as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for name in _order(tensors):
            if tensors[name].numel():
                out.write(tensors[name].reshape(-1).view(torch.uint8).numpy())


def _order(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    return sorted(tensors, key=lambda name: (-_RANK[tensors[name].dtype], name))


def _header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> bytes:
    """The JSON header, padded with spaces to 8 bytes (each tensor's data then starts
    aligned to its element size, the largest first)."""
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError(f"safetensors metadata must map str to str: {dict(metadata)!r}")
    if "__metadata__" in tensors:
        raise ValueError("a tensor cannot be named '__metadata__' in a safetensors file")
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata is not None else {}
    offset = 0
    for name in _order(tensors):
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return text + b" " * (-len(text) % 8)


def save_object(obj: Any, path: Path | str, *, direct: bool = True) -> None:
    """``torch.save(obj, path)``, through a ``DirectFile``."""
    with DirectFile(path, direct=direct) as out:
        torch.save(obj, out)
