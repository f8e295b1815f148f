"""The buffer's checkpoint file: its ``HubState`` in one checksummed frame, written
atomically, and ``recover_hub``: a checkpoint and the journal after it, replayed.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Any

from asyncrl.buffer.hub import Hub, HubState, ReplayDiverged
from asyncrl.buffer.journal import fsync_dir, read_journal
from asyncrl.errors import CheckpointUnreadable, InputError, RunStateLost
from asyncrl.observe.logs import get_logger
from asyncrl.wire.codec import Codec
from asyncrl.wire.errors import WireError

log = get_logger("asyncrl.buffer")

#: Arrays inline and no frame limit: a checkpoint is one frame of whatever size the
#: buffer holds (the wire's 256 MiB limit guards sockets, not files).
_CHECKPOINT_CODEC_ARGS: dict[str, Any] = {"inline_bytes": 1 << 62, "max_frame_bytes": 1 << 62}


#: A checkpoint file: this, the body's crc32 (u32 little-endian), then the body. A file
#: without it is read as the body alone (a checkpoint with no checksum).
_CHECKPOINT_MAGIC = b"ASRLBCK1"


def read_checkpoint(path: Path) -> HubState:
    """A buffer checkpoint; ``CheckpointUnreadable`` naming the file when it is truncated,
    damaged (its checksum) or not one."""
    data = path.read_bytes()
    body = data
    if data.startswith(_CHECKPOINT_MAGIC):
        if len(data) < len(_CHECKPOINT_MAGIC) + 4:
            raise _unreadable(path, "it ends inside its header")
        (crc,), body = struct.unpack_from("<I", data, len(_CHECKPOINT_MAGIC)), data[12:]
        if zlib.crc32(body) != crc:
            raise _unreadable(path, "its checksum does not match (a damaged file)")
    try:
        return Codec(HubState, **_CHECKPOINT_CODEC_ARGS).decode([body])
    except WireError as exc:
        raise _unreadable(path, str(exc)) from None


def _unreadable(path: Path, why: str) -> CheckpointUnreadable:
    return CheckpointUnreadable(
        f"buffer checkpoint {path} is unreadable (truncated, damaged, or not a buffer "
        f"checkpoint): {why}; restore it from a copy, or start the run over (--overwrite)"
    )


def write_checkpoint(state: HubState, path: Path) -> None:
    """Write ``state`` atomically (a temp file, fsync, then a rename), checksummed."""
    body = Codec(HubState, **_CHECKPOINT_CODEC_ARGS).encode_parts(state)[0]
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tmp.open("wb") as out:
        out.write(_CHECKPOINT_MAGIC + struct.pack("<I", zlib.crc32(body)))
        out.write(body)
        out.flush()
        os.fsync(out.fileno())  # the journal is reset after this: it must be on disk
    os.replace(tmp, path)
    fsync_dir(path.parent)


def recover_hub(hub: Hub, checkpoint: Path, journal: Path | None) -> int:
    """Load ``checkpoint`` into ``hub`` (its job included) and replay ``journal`` after it;
    returns the records replayed. A journal of another lineage is older than the
    checkpoint (a fresh start writes its checkpoint first) and is ignored."""
    state = read_checkpoint(checkpoint)
    try:
        hub.load_state_dict(state)
    except InputError:  # not damage: the data changed since (the source says how)
        raise
    except (ValueError, KeyError, TypeError) as exc:  # a body that decodes but is not whole
        raise _unreadable(checkpoint, f"{type(exc).__name__}: {exc}") from None
    if journal is None or not journal.exists():
        return 0
    try:
        return _replay(hub, checkpoint, journal)
    except InputError:  # not damage: the data changed since (the source says how)
        raise
    except (ValueError, ReplayDiverged) as exc:  # the same bytes fail the same way again
        raise RunStateLost(
            f"the buffer's journal cannot be replayed: {exc}. Going on would forget what it "
            "recorded (groups handed out, trained): restore it from a copy, or start over "
            "(--overwrite)"
        ) from exc


def _replay(hub: Hub, checkpoint: Path, journal: Path) -> int:
    header, records = read_journal(journal)
    if header.lineage != hub.lineage:
        log.warning("journal of another lineage ignored", journal=str(journal))
        return 0
    if header.first_seq > hub.journal_seq + 1:
        raise ValueError(
            f"{journal} starts at record {header.first_seq} but {checkpoint} ends at "
            f"{hub.journal_seq}: the records between are missing"
        )
    return hub.replay(records)
