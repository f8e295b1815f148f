"""Batch dumps: the ``TrainBatch``es a buffer served, one msgpack file each, for replay.

``DIR/batch_NNNNNN.msgpack``, numbered from 1 in the order taken: one ``TrainBatch`` each,
every array inline (no pickle), written atomically. A writer on a directory that already
holds batches continues the numbering (a resumed run). Rollout-only runs and
``--save-debug-rollout-data`` write them; ``--load-debug-rollout-data`` trains on them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from asyncrl.types import TrainBatch
from asyncrl.wire.codec import Codec
from asyncrl.wire.errors import WireError

_NAME = re.compile(r"^batch_(\d{6,})\.msgpack$")
#: Larger than any batch: every array is encoded in the body, so one file is one frame.
_ALL_INLINE = 1 << 62


def batch_files(directory: Path) -> list[Path]:
    """The batch files of ``directory`` in the order they were written."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _NAME.match(p.name)), key=_index)


def _index(path: Path) -> int:
    match = _NAME.match(path.name)
    assert match is not None  # batch_files lists only matching names
    return int(match.group(1))


def _codec() -> Codec[TrainBatch]:
    return Codec(TrainBatch, max_frame_bytes=_ALL_INLINE, inline_bytes=_ALL_INLINE)


class BatchWriter:
    """Appends batches to ``directory`` as ``batch_NNNNNN.msgpack``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        existing = batch_files(directory)
        self.count = _index(existing[-1]) if existing else 0
        self._codec = _codec()

    def write(self, batch: TrainBatch) -> Path:
        """Write ``batch`` as the next file; returns its path."""
        (body,) = self._codec.encode(batch)
        path = self.directory / f"batch_{self.count + 1:06d}.msgpack"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(body)
        os.replace(tmp, path)
        self.count += 1
        return path


def encode_batch(batch: TrainBatch) -> bytes:
    """``batch`` as one MessagePack body (what a dump file holds)."""
    (body,) = _codec().encode(batch)
    return bytes(body)


def decode_batch(body: bytes) -> TrainBatch:
    """Inverse of ``encode_batch``; ``WireError`` when it is not one."""
    return _codec().decode([body])


def read_batch(path: Path) -> TrainBatch:
    """One dumped batch; ``ValueError`` naming the file when it is not one."""
    try:
        return _codec().decode([path.read_bytes()])
    except WireError as exc:
        raise ValueError(f"{path}: not a dumped TrainBatch ({exc})") from exc
