"""The buffer's write-ahead journal: every change to the hub, on disk before anyone hears of it.

Recovery is the last checkpoint plus the records after it (``Hub.replay``). One file,
appended unbuffered, so a record is in the kernel (which a killed process cannot lose)
when ``append`` returns; ``fsync=True`` survives the machine too::

    header:  b"ASRLJNL1" | u32 length | u32 crc32 | JournalHeader(lineage, first_seq)
    record:  u32 length | u32 crc32(body) | body (a Codec frame, arrays inline)

Record ``k`` has seq ``first_seq + k``. A checkpoint stores its lineage and last seq and
starts a fresh journal after it (``reset``); a journal of another lineage is refused.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from asyncrl.types import Group
from asyncrl.wire.codec import Codec, Message
from asyncrl.wire.errors import WireError

MAGIC = b"ASRLJNL1"
_PREFIX = struct.Struct("<II")  # length, crc32
#: Arrays travel inline in a journal body: one contiguous frame per record.
_INLINE_ALL = 1 << 62


def _record_codec() -> Codec[Record]:
    """A record a frame, arrays inline, no size limit but the frame's u32 length (the
    wire's 256 MiB limit guards sockets, not files)."""
    return Codec(Record, inline_bytes=_INLINE_ALL, max_frame_bytes=_INLINE_ALL)


class JournalHeader(Message):
    """The first record of a journal file: which checkpoint lineage it continues."""

    lineage: str
    first_seq: int


class Handed(Message):
    """``hand_out(actor, request, max_items)`` returned the groups ``uids``."""

    actor: str
    request: str
    max_items: int
    uids: list[str]


class Returned(Message):
    """A result arrived and was ``put``; ``outcome`` is what became of it."""

    group: Group
    outcome: str


class Requeued(Message):
    """The work ``actor`` held went back to the pool (the actor died)."""

    actor: str


class Followed(Message):
    """The trainer reached ``version``."""

    version: int


class Settled(Message):
    """A trainer request's bookkeeping: ``acks``, its durable version, a resync at
    ``version`` (a restarted trainer, which replays the batches it lost)."""

    version: int
    acks: list[int]
    durable: int
    resync: bool


class Taken(Message):
    """``take(n)`` at ``version`` made batch ``batch_id`` of the groups ``uids``."""

    n: int
    version: int
    batch_id: int
    uids: list[str]


Record = Handed | Returned | Requeued | Followed | Settled | Taken


class Journal:
    """An append-only file of ``Record``s; see the module docstring."""

    def __init__(self, path: Path, *, fsync: bool = False) -> None:
        """A journal at ``path`` (opened by ``reset``); ``fsync`` each append."""
        self.path, self.fsync = Path(path), fsync
        self.codec: Codec[Record] = _record_codec()
        self.next_seq = 1
        self.bytes_written = 0
        self._file: io.FileIO | None = None

    def reset(self, lineage: str, first_seq: int) -> None:
        """Start an empty journal whose first record will have seq ``first_seq``."""
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        header = Codec(JournalHeader).encode_parts(JournalHeader(lineage, first_seq))[0]
        with tmp.open("wb") as out:
            out.write(MAGIC + _frame(header))
            out.flush()
            os.fsync(out.fileno())  # the rename below must not expose an empty file
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        self._file = io.FileIO(self.path, "ab")
        self.next_seq, self.bytes_written = first_seq, 0

    def append(self, records: Sequence[Record]) -> int:
        """Write ``records`` (one ``write`` call); returns the seq of the last one."""
        if not records:
            return self.next_seq - 1
        data = b"".join(_frame(self.codec.encode_parts(r)[0]) for r in records)
        out = self._file
        assert out is not None, "reset() the journal before appending"
        end = os.lseek(out.fileno(), 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:  # one write() may take less than all of it
                view = view[out.write(view) or 0 :]
            if self.fsync:
                os.fsync(out.fileno())
        except OSError:
            # No half record may stay in the middle of the file (later records would
            # follow a damaged one): cut back to where this append started.
            os.ftruncate(out.fileno(), end)
            raise
        self.next_seq += len(records)
        self.bytes_written += len(data)
        return self.next_seq - 1

    def close(self) -> None:
        """Close the file (appends after this need a ``reset``)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_journal(path: Path) -> tuple[JournalHeader, Iterator[tuple[int, Record]]]:
    """The header of the journal at ``path`` and its ``(seq, record)`` pairs, in order.

    ``ValueError`` naming the file and offset when it is not a journal or is damaged
    before its last record; a torn last record ends the iteration.
    """
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{path}: not an asyncrl buffer journal (bad magic)")
    body, offset = _read_frame(path, data, len(MAGIC))
    if body is None:
        raise ValueError(f"{path}: the journal header is truncated")
    try:
        header = Codec(JournalHeader).decode_parts(body)
    except WireError as exc:
        raise ValueError(f"{path}: bad journal header: {exc}") from None
    return header, _records(path, data, offset, header.first_seq)


def _records(path: Path, data: bytes, offset: int, seq: int) -> Iterator[tuple[int, Record]]:
    codec: Codec[Record] = _record_codec()
    while offset < len(data):
        start = offset
        body, offset = _read_frame(path, data, offset)
        if body is None:
            return  # a torn tail: never acknowledged
        try:
            record = codec.decode_parts(body)
        except WireError as exc:
            raise ValueError(
                f"{path}: record {seq} at byte {start} does not decode: {exc}"
            ) from None
        yield seq, record
        seq += 1


def _frame(body: bytes) -> bytes:
    return _PREFIX.pack(len(body), zlib.crc32(body)) + body


def _read_frame(path: Path, data: bytes, offset: int) -> tuple[bytes | None, int]:
    """The body at ``offset`` and the offset after it; ``(None, end)`` for a torn tail."""
    end = offset + _PREFIX.size
    if end > len(data):
        return None, len(data)
    length, crc = _PREFIX.unpack_from(data, offset)
    if end + length > len(data) or length == 0:  # no record is empty: zeros past the end
        return None, len(data)
    body = data[end : end + length]
    if zlib.crc32(body) != crc:
        if end + length == len(data):
            return None, len(data)  # the last record, torn inside its body
        raise ValueError(f"{path}: record at byte {offset} fails its checksum (damaged file)")
    return body, end + length


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (the directory entry, not only the file)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lineage_token() -> str:
    """A fresh random lineage id (each fresh buffer start begins one)."""
    return os.urandom(8).hex()
