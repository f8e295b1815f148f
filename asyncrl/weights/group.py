"""The weight broadcast group: ``BroadcastGroup`` (one formed group) and ``GroupMembership``
(a process's rank in the job's group across re-formings).

The trainer (rank 0) and every subscriber rendezvous on a ``TCPStore`` that rank 0 serves,
and build a gloo (CPU tensors) or NCCL (CUDA tensors) group directly on it: no default
process group, so a DDP trainer's own group is untouched. The store is laid out as
SGLang's ``/init_weights_update_group`` lays it out, so an SGLang server can be any member.
A gloo group cannot take a new member: a lost member means a new group under a new id,
and versions go by pull until it forms. Blocking calls: run them in a worker thread.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

import torch
import torch.distributed as dist

from asyncrl.observe.logs import get_logger
from asyncrl.weights.buckets import (
    Bucket,
    BucketBuffers,
    Sink,
    as_itself,
    flatten,
    manifest_buckets,
    views,
)
from asyncrl.weights.config import GroupConfig
from asyncrl.wire.messages import BlobManifest, TensorEntry
from asyncrl.wire.sockets import is_loopback

log = get_logger("asyncrl.weights")

#: The group name SGLang's API uses when none is given.
DEFAULT_GROUP = "weight_update_group"
#: Rank 0's store key naming the id it is forming now ("" between attempts): a server
#: engine blocks while it joins, so its actor asks it to join only that id.
FORMING_KEY = "asyncrl/forming"
#: The store key a member sets before it joins an id at a rank (``claim_rank``).
CLAIM_KEY = "asyncrl/claimed/{group_id}/{rank}"
#: Set by a second joiner at a rank: rank 0 gives that id up at once (``usable``).
STALE_KEY = "asyncrl/stale/{group_id}"
#: Rank 0 gives an id up this long past its join timeout even if gloo still waits
#: (gloo's store phase and its connect phase each have that timeout; the connections of
#: ranks that arrived in time take well under a second).
FORM_GRACE_S = 10.0


def group_name(group_id: str) -> str:
    """The torch/SGLang group name of a job group id (``<incarnation>-<epoch>``)."""
    return f"asyncrl-weights-{group_id}"


def sglang_layout(store: dist.Store, name: str, device: str) -> dist.Store:
    """``store`` prefixed as a member that joins group ``name`` SGLang's way sees it:
    ``name`` (SGLang's ``init_custom_process_group``), then ``name/`` and ``device/`` ("cpu"
    for gloo, "cuda" for NCCL: torch's ``_new_process_group_helper``)."""
    sglangs = dist.PrefixStore(name, store)  # init_custom_process_group's own prefix
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{name}/", sglangs))


def on_the_wire(bucket: Bucket, flat: torch.Tensor) -> torch.Tensor:
    """What a bucket's broadcast carries: a lone tensor as itself, several as bytes
    (``uint8``: SGLang's ``load_format: "flattened_bucket"``)."""
    return flat if bucket.end - bucket.start == 1 else flat.view(torch.uint8)


class BroadcastGroup:
    """``world_size`` processes that broadcast tensors from rank 0."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        store: dist.Store,
        rank: int,
        size: int,
        *,
        timeout_s: float = 300.0,
    ) -> None:
        self.group, self._store, self.rank, self.world_size = group, store, rank, size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.buffers = BucketBuffers()  # one bucket per dtype, reused every version

    @classmethod
    def join(
        cls,
        address: str,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        name: str = DEFAULT_GROUP,
    ) -> BroadcastGroup:
        """Rendezvous at ``address`` ("host:port"; rank 0 serves the store) as group
        ``name``. Blocks until all ``world_size`` ranks arrive or ``timeout_s`` passes."""
        host, port = split_address(address)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            store = serve_store(host, port, timeout, world_size)
        else:
            store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
        return cls.form(
            store,
            rank,
            world_size,
            name=name,
            backend=backend,
            join_timeout_s=timeout_s,
            timeout_s=timeout_s,
        )

    @classmethod
    def form(
        cls,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        name: str = DEFAULT_GROUP,
        backend: str = "gloo",
        join_timeout_s: float = 60.0,
        timeout_s: float = 300.0,
        bind: str | None = None,
    ) -> BroadcastGroup:
        """Group ``name`` of the ranks meeting on ``store``, laid out as SGLang's
        (``sglang_layout``), so several can share a store. Blocks until every rank arrives;
        ``join_timeout_s`` bounds that. ``bind``: the address gloo listens on (default:
        the host name's, or ``GLOO_SOCKET_IFNAME``)."""
        group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
        if backend == "gloo":
            gloo = dist.ProcessGroupGloo
            options = gloo._Options()
            options._timeout = datetime.timedelta(seconds=join_timeout_s)
            options._devices = [
                gloo.create_device(hostname=bind) if bind else gloo.create_default_device()
            ]
            group = gloo(sglang_layout(store, name, "cpu"), rank, world_size, options)
        elif backend == "nccl":
            group = dist.ProcessGroupNCCL(sglang_layout(store, name, "cuda"), rank, world_size)
        else:
            raise ValueError(f"weight group backend must be gloo or nccl, got {backend!r}")
        group._set_sequence_number_for_group()  # through the store, as torch's helper does
        return cls(group, store, rank, world_size, timeout_s=timeout_s)

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast each tensor from rank 0 in list order (in place on other ranks)."""
        for t in tensors:
            self.start(t).wait()

    def start(self, tensor: torch.Tensor) -> dist.Work:
        """Begin broadcasting ``tensor`` from rank 0; ``wait()`` on the result ends it.
        Every rank must start the same broadcasts in the same order."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        return self.group.broadcast([tensor], opts)

    def abort(self) -> None:
        """Close every connection now: the other ranks' calls fail at once."""
        self.group.abort()

    def send_buckets(self, manifest: BlobManifest, tensors: Mapping[str, torch.Tensor]) -> None:
        """Rank 0: one broadcast per bucket of ``manifest``; a large tensor goes as itself,
        the small ones flattened into a reused buffer (``buckets.py``), the next
        bucket filled while the last one is on the wire."""
        on_wire: dist.Work | None = None
        for i, bucket in enumerate(manifest_buckets(manifest)):
            flat = as_itself(bucket, manifest.entries, tensors)
            if flat is None:  # its slot's last bucket (i - 2) is off the wire: waited below
                out = self.buffers.get(bucket, slot=i % 2)
                flat = flatten(bucket, manifest.entries, tensors, out=out)
            work = self.start(on_the_wire(bucket, flat))
            if on_wire is not None:
                on_wire.wait()
            on_wire = work
        if on_wire is not None:
            on_wire.wait()

    def receive_buckets(
        self,
        manifest: BlobManifest,
        sink: Sink,
        device: torch.device | str = "cpu",
        *,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Other ranks: each bucket into a buffer, then ``sink(name, view)`` per tensor,
        while the next bucket arrives; a large tensor whose destination ``out`` holds is
        received straight into it."""
        if self.buffers.device != device:
            self.buffers = BucketBuffers(device)
        entries = manifest.entries
        arriving: tuple[dist.Work, Bucket, torch.Tensor | None] | None = None
        for i, bucket in enumerate(manifest_buckets(manifest)):
            direct = as_itself(bucket, entries, out)
            flat = self.buffers.get(bucket, slot=i % 2) if direct is None else direct
            work = self.start(on_the_wire(bucket, flat))
            if arriving is not None:  # empties slot (i - 1) % 2 before bucket i + 1 fills it
                _empty(arriving, entries, sink)
            arriving = (work, bucket, None if direct is not None else flat)
        if arriving is not None:
            _empty(arriving, entries, sink)


def _empty(
    arriving: tuple[dist.Work, Bucket, torch.Tensor | None],
    entries: Sequence[TensorEntry],
    sink: Sink,
) -> None:
    """Wait for a bucket; hand each tensor of a buffered one to ``sink``."""
    work, bucket, flat = arriving
    work.wait()
    if flat is not None:
        for name, view in views(bucket, entries, flat):
            sink(name, view)


def serve_store(
    host: str,
    port: int,
    timeout: datetime.timedelta,
    world_size: int | None = None,
    *,
    wait_for_workers: bool = True,
) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on ``host`` alone (``_bind_address``). torch's
    own store server listens on every interface, and its keys can be listed and written
    by anyone who reaches it (no authentication): it is handed a socket bound here."""
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((_bind_address(bare), port))
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(
        bare,
        port,
        world_size,
        True,
        timeout=timeout,
        wait_for_workers=wait_for_workers,
        master_listen_fd=sock.detach(),
    )


def _bind_address(host: str) -> str:
    """Where rank 0's store listens for ``host``: that address when it is one (the job's
    ``runtime.host``, loopback by default), loopback for ``localhost``; every interface
    for another host name, which the other ranks may resolve to an address this machine's
    resolver does not give (Debian maps its own name to 127.0.1.1)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return "127.0.0.1" if host == "localhost" else ""


def _set_forming(keys: dist.Store | None, value: str, unless_not: str | None = None) -> None:
    """Rank 0: name ``value`` as the id forming (``unless_not``: only if it still names
    that one). Best effort: a member that cannot read it joins nothing, and versions go by
    pull or disk meanwhile."""
    if keys is None:
        return
    try:
        if unless_not is None:
            keys.set(FORMING_KEY, value)
        else:
            keys.compare_set(FORMING_KEY, unless_not, value)
    except (RuntimeError, OSError) as exc:  # the store closed under a lingering join
        log.warning("could not name the weight group forming", error=_first_line(exc))


def claim_rank(store: dist.Store, group_id: str, rank: int) -> str:
    """Take ``rank`` of group ``group_id`` for one join: "" for its first taker only,
    else why not.

    gloo keeps one address per rank, so a member that died mid-join leaves a dead one
    that a second joiner at that rank, and rank 0, would wait on past their timeouts.
    The second claimant marks the id stale and unnames it: no rank joins it any more,
    and rank 0 gives it up at its next version (``GroupMembership.usable``)."""
    stale = STALE_KEY.format(group_id=group_id)
    if store.check([stale]):
        return "a rank was joined twice (its first joiner died in it)"
    token = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
    key = CLAIM_KEY.format(group_id=group_id, rank=rank)
    if store.compare_set(key, "", token).decode() == token:
        return ""
    store.set(stale, f"rank {rank} joined twice")
    store.compare_set(FORMING_KEY, group_id, "")
    return f"rank {rank} was taken by an earlier join (a predecessor's)"


def may_join(host: str, port: int, group_id: str, rank: int, timeout_s: float = 5.0) -> str:
    """Whether a member may join ``group_id`` at ``rank`` now, as rank 0's store at
    ``host:port`` says: "" when it may (the rank is then taken for it: ``claim_rank``),
    else why not. Blocking: run it in a thread."""
    try:
        store = dist.TCPStore(
            host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        forming = store.get(FORMING_KEY).decode() if store.check([FORMING_KEY]) else ""
        if forming != group_id:
            return f"no longer forming (forming: {forming!r})"
        return claim_rank(store, group_id, rank)
    except (RuntimeError, OSError) as exc:  # torch raises DistNetworkError/DistStoreError
        return f"rank 0's store did not answer: {_first_line(exc)}"


def split_address(address: str) -> tuple[str, int]:
    """``("host", port)`` of ``"host:port"`` (or ``"tcp://host:port"``)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"weight group address must be host:port, got {address!r}")
    return host, int(port)


class GroupMembership:
    """This process's rank in the job's weight group, re-formed when a member is lost.

    ``id`` is the group formed or being formed (empty before any); ``group`` is it once
    formed. Rank 0 calls ``usable`` before each version; the others ``notice`` every
    announcement and ``for_version`` the one they take; either calls ``failed`` when a
    broadcast fails. Joins run in daemon threads, each bounded by ``join_timeout_s``, so
    none outlives the process.
    """

    def __init__(self, cfg: GroupConfig, *, rank: int, address: str) -> None:
        if not 0 <= rank < cfg.world_size:
            raise ValueError(f"weight group rank {rank} is outside a group of {cfg.world_size}")
        self.cfg, self.rank, self.address = cfg, rank, split_address(address)
        self.id = ""
        self.group: BroadcastGroup | None = None
        self._forming: Future[BroadcastGroup] | None = None
        self._since = 0.0  # when the id forming began (monotonic)
        self._epoch = 0
        self._incarnation = os.urandom(3).hex()  # rank 0: its ids differ from a predecessor's
        self._store: dist.TCPStore | None = None
        self._keys: dist.TCPStore | None = None  # rank 0: FORMING_KEY's client

    def open(self) -> None:
        """Rank 0: serve the rendezvous store (blocking; the address must be free)."""
        if self.rank == 0 and self._store is None:
            host, port = self.address
            self._store = serve_store(host, port, self._join_timeout, wait_for_workers=False)
            # A client of its own: the store's blocks while a forming thread waits on it.
            self._keys = dist.TCPStore(host, port, None, False, timeout=self._join_timeout)
            self._keys.set(FORMING_KEY, "")

    def close(self) -> None:
        """Leave the group (its members' next broadcast fails at once, and re-forms)."""
        self._drop()
        self._forming, self._store, self._keys = None, None, None

    # -- rank 0 ---------------------------------------------------------------------------
    def usable(self) -> BroadcastGroup | None:
        """Rank 0, before a version: the formed group; None while one forms (this starts
        forming the next id when none is)."""
        if self.group is not None:
            return self.group
        forming = self._forming
        if forming is not None and not forming.done() and (why := self._hopeless()):
            self._give_up(forming, why)
            forming = None
        if forming is not None and forming.done():
            self._forming = None
            try:
                self.group = forming.result()
            except Exception as exc:  # a rank did not arrive in time: try a new id
                log.warning(
                    "weight group did not form; versions go by pull meanwhile",
                    group=self.id,
                    error=_first_line(exc),
                )
            else:
                log.info("weight group formed", group=self.id, world_size=self.cfg.world_size)
                return self.group
        if self._forming is None:
            self._epoch += 1
            self._start(f"{self._incarnation}-{self._epoch}")
        return None

    def _hopeless(self) -> str:
        """Why the id forming cannot form now ("" while it can): a rank joined it twice
        (the first joiner died in it), or it outlasted its timeout."""
        elapsed = time.monotonic() - self._since
        if elapsed > self.cfg.join_timeout_s + FORM_GRACE_S:
            return f"not formed after {elapsed:.0f}s"
        try:
            stale = self._keys is not None and self._keys.check(
                [STALE_KEY.format(group_id=self.id)]
            )
        except (RuntimeError, OSError):  # the store is closing: nothing to give up
            return ""
        return "a rank joined it twice (its first joiner died in it)" if stale else ""

    def _give_up(self, forming: Future[BroadcastGroup], why: str) -> None:
        """Stop waiting for ``forming``; no member may start joining it, and should it
        form after all, it is aborted at once."""
        log.warning("weight group given up; versions go by pull meanwhile", group=self.id,
                    reason=why)  # fmt: skip
        _set_forming(self._keys, "", unless_not=self.id)
        self._forming = None
        forming.add_done_callback(_abort_formed)

    # -- ranks 1..N -----------------------------------------------------------------------
    def notice(self, group_id: str, formed: bool) -> None:
        """Member, on any announcement (one skipped as old too): join a new id that is
        still forming, in the background. A formed one we are not in lacks us: the next
        id (rank 0 re-forms when its broadcast fails) will not."""
        if group_id and group_id != self.id and not formed:
            self._drop()
            self._start(group_id)

    async def for_version(self, group_id: str, formed: bool) -> BroadcastGroup | None:
        """Member, on the announcement it takes: the group to receive it on, or None
        (pull it)."""
        self.notice(group_id, formed)
        if not formed or group_id != self.id:
            return None
        forming = self._forming
        if self.group is None and forming is not None:
            # Rank 0 formed it; our side of the same rendezvous is finishing.
            self._forming = None
            try:
                self.group = await asyncio.wait_for(
                    asyncio.wrap_future(forming), self.cfg.join_timeout_s
                )
            except Exception as exc:
                log.warning("weight group join failed", group=group_id, error=_first_line(exc))
        return self.group

    def failed(self, exc: BaseException) -> None:
        """A broadcast on the group failed: abort it (rank 0 forms a new one next)."""
        log.warning(
            "weight broadcast failed; versions go by pull until the group re-forms",
            group=self.id,
            rank=self.rank,
            error=_first_line(exc),
        )
        self._drop()

    # -- both -----------------------------------------------------------------------------
    @property
    def _join_timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.cfg.join_timeout_s)

    def _start(self, group_id: str) -> None:
        keys = self._keys  # rank 0's; None for a member
        _set_forming(keys, group_id)  # before the announcement that names it
        self.id, self._since = group_id, time.monotonic()
        forming: Future[BroadcastGroup] = Future()
        self._forming = forming

        def unname() -> None:
            # Formed or failed, no member may start joining it: unnamed before anyone
            # waiting on the future learns the outcome (a given-up id already is, and
            # its store may be gone with the job).
            if self._forming is forming:
                _set_forming(keys, "", unless_not=group_id)

        def run() -> None:
            try:
                group = self._form(group_id)
            except BaseException as exc:  # handed to whoever waits on the future
                unname()
                forming.set_exception(exc)
            else:
                unname()
                forming.set_result(group)

        threading.Thread(target=run, name=f"weight-group-{group_id}", daemon=True).start()

    def _form(self, group_id: str) -> BroadcastGroup:
        # A store client of its own per rendezvous: a client blocks while one thread
        # waits on it, and a given-up rendezvous may still wait.
        host, port = self.address
        store = dist.TCPStore(host, port, None, False, timeout=self._join_timeout)
        if self.rank and (refused := claim_rank(store, group_id, self.rank)):
            raise RuntimeError(f"not joining {group_id}: {refused}")
        cfg = self.cfg
        return BroadcastGroup.form(
            store,
            self.rank,
            cfg.world_size,
            name=group_name(group_id),
            backend=cfg.backend,
            join_timeout_s=cfg.join_timeout_s,
            timeout_s=cfg.timeout_s,
            # A job on one host keeps gloo's sockets on loopback too, not on every interface.
            bind=self.address[0] if is_loopback(self.address[0]) else None,
        )

    def _drop(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.abort()


def _abort_formed(forming: Future[BroadcastGroup]) -> None:
    """A given-up rendezvous that formed after all: its group would hold its members."""
    if not forming.cancelled() and forming.exception() is None:
        forming.result().abort()


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
