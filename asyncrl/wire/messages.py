"""The closed set of control-plane, weight and probe records that travel between actors.

Data-plane records (work items, group results, train batches) live in ``asyncrl.types``;
``docs/design.md`` section 3 says which channel carries which record.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np

from asyncrl.wire.codec import Message

Scalar = int | float | str | bool
CommandKind = Literal[
    "stop",
    "pause",
    "resume",
    "ping",
    "stats",
    "requeue",
    "checkpoint",
    "engine_restarted",
    "evaluate_final",
]
ActorStateName = Literal["starting", "running", "draining", "stopped", "failed"]


class Hello(Message):
    """An actor is up: who it is and the endpoints it bound."""

    actor: str
    role: str
    pid: int
    host: str
    endpoints: dict[str, str] = msgspec.field(default_factory=dict)


class Heartbeat(Message):
    """Periodic liveness and stats; ``version`` is the weight version the actor holds."""

    actor: str
    pid: int
    seq: int
    state: ActorStateName
    version: int
    stats: dict[str, float] = msgspec.field(default_factory=dict)


class Bye(Message):
    """An actor is about to exit; ``reason`` says why (``"stopped"`` or the error).

    ``permanent``: the error would recur in a restarted actor (an ``InputError``: bad
    data, config or user code; ``actors/base.py::is_permanent``), so the supervisor ends
    the job with it instead of restarting.
    """

    actor: str
    pid: int
    reason: str
    ok: bool
    permanent: bool = False


class Command(Message):
    """A controller request to one actor."""

    kind: CommandKind
    args: dict[str, Scalar] = msgspec.field(default_factory=dict)


class CommandResult(Message):
    """The answer to a ``Command``; ``data`` carries ``stats`` or ``ping`` results."""

    ok: bool
    error: str | None = None
    data: dict[str, Scalar] = msgspec.field(default_factory=dict)


class TensorEntry(Message):
    """Where one tensor lives in a blob's byte space."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


class BlobManifest(Message):
    """Everything a client needs to allocate and fill a blob."""

    blob: str
    total_bytes: int
    chunk_bytes: int
    entries: list[TensorEntry]

    @property
    def num_chunks(self) -> int:
        """``ceil(total_bytes / chunk_bytes)``."""
        return -(-self.total_bytes // self.chunk_bytes)


class FetchManifest(Message):
    """Ask for a blob's manifest."""

    blob: str


class FetchChunk(Message):
    """Ask for chunk ``index`` (bytes ``[index*C, (index+1)*C)``) of a blob."""

    blob: str
    index: int


class FetchDone(Message):
    """Puller ``by`` holds every chunk of a blob (the server records who completed it)."""

    blob: str
    by: str = ""


class BlobChunk(Message):
    """The pieces of one chunk: ``(offset in blob, bytes)`` per tensor it overlaps."""

    blob: str
    index: int
    parts: list[tuple[int, np.ndarray]]


class WeightVersion(Message):
    """Trainer announcement: version ``version`` of the policy weights is available.

    ``transport``: ``pull`` from the blob server at ``location`` (blob ``blob``); ``disk``
    from the directory ``location``; ``dist`` by broadcast on weight group ``group``
    (``manifest`` gives the buckets) once ``formed``, by pull while it forms; ``ipc`` from
    shared memory on host ``host`` (``handles``: one ``/update_weights_from_tensor``
    payload per bucket), else by pull.
    """

    version: int
    transport: Literal["pull", "disk", "dist", "ipc"]
    location: str
    blob: str = ""
    manifest: BlobManifest | None = None
    group: str = ""
    formed: bool = False
    handles: list[str] = msgspec.field(default_factory=list)
    host: str = ""
    #: The publishing trainer process: a restarted trainer's versions replace the ones
    #: its predecessor announced, even where their numbers are lower (it resumed from
    #: an older checkpoint).
    trainer: str = ""


class Probe(Message):
    """Synthetic traffic of a dry run: proves a channel carries records and arrays."""

    sender: str
    seq: int
    payload: np.ndarray
