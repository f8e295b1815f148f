"""Weight versions from the trainer to every engine: ``WeightPublisher`` and ``WeightReceiver``.

The trainer publishes each version in two parts (``docs/design.md`` section 6): the tensors
are put where subscribers can fetch them (``pull``: its blob server; ``disk``: a
safetensors directory; ``dist``: a broadcast group; ``ipc``: shared memory on its host),
then a small ``WeightVersion`` is announced on the ``weights`` pub/sub topic. A ``dist`` or
``ipc`` version is on the blob server too, for a subscriber that cannot take it that way.
Pub/sub is lossy and conflated: a receiver always moves to the newest announced version.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Literal, Protocol

import msgspec
import torch
from safetensors.torch import load_file, save_file

from asyncrl.errors import EngineError
from asyncrl.observe.logs import get_logger
from asyncrl.weights.buckets import Sink
from asyncrl.weights.group import BroadcastGroup, GroupMembership
from asyncrl.weights.lora_merge import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    is_adapter_version,
    peft_layout,
    read_peft_dir,
)
from asyncrl.weights.share import HOST, SharedVersions, take_shared
from asyncrl.wire.blob import BlobClient, BlobServer, layout
from asyncrl.wire.codec import Codec
from asyncrl.wire.errors import WouldBlock
from asyncrl.wire.messages import BlobManifest, WeightVersion
from asyncrl.wire.pubsub import Publisher, Subscriber

log = get_logger("asyncrl.weights")

Transport = Literal["pull", "disk", "dist", "ipc"]
TOPIC = "weights"


class GroupMember(Protocol):
    """Told of every ``dist`` announcement, skipped ones too (a new group id to join):
    ``GroupMembership`` (this process receives) or ``rollout.server_group.ServerGroup``
    (its engines do)."""

    def notice(self, group_id: str, formed: bool) -> None: ...


def blob_name(version: int) -> str:
    """The blob under which version ``version`` is served."""
    return f"weights-v{version}"


def disk_path(root: Path, version: int) -> Path:
    """The directory of version ``version`` (slime's ``weight_v{N:06d}`` naming)."""
    return root / f"weight_v{version:06d}"


class WeightPublisher:
    """Trainer side: stores a version with the chosen transport, then announces it."""

    def __init__(
        self,
        publisher: Publisher[WeightVersion],
        *,
        transport: Transport = "pull",
        blob: BlobServer | None = None,
        disk_dir: Path | None = None,
        group: GroupMembership | None = None,
        keep: int = 2,
        bucket_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        if transport in ("pull", "dist", "ipc") and blob is None:
            raise ValueError(f"transport {transport!r} needs the trainer's BlobServer")
        if transport == "disk" and disk_dir is None:
            raise ValueError("transport 'disk' needs a directory (disk_dir)")
        if transport == "dist" and (group is None or group.rank != 0):
            raise ValueError("transport 'dist' needs a GroupMembership where the trainer is rank 0")
        self.publisher, self.transport, self.blob, self.group = publisher, transport, blob, group
        self.disk_dir, self.keep, self.bucket_bytes = disk_dir, max(1, keep), bucket_bytes
        self.latest: WeightVersion | None = None
        self._sending: asyncio.Future[None] | None = None  # dist: the broadcast under way
        self._shared = SharedVersions(keep=self.keep, bucket_bytes=bucket_bytes)
        self.lineage = os.urandom(4).hex()  # WeightVersion.trainer

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> WeightVersion:
        """Make ``tensors`` (CPU, not modified afterwards) fetchable as ``version``; announce."""
        if self.transport == "dist":
            return await self._broadcast(version, tensors)
        if self.transport == "ipc":
            msg = await self._share(version, tensors)
        elif self.transport == "pull":
            msg = self._put_blob(version, tensors)
        else:
            msg = await asyncio.to_thread(self._write_disk, version, tensors)
        self.publisher.publish(TOPIC, msg)
        self.latest = msg
        return msg

    def fetched(self) -> list[str]:
        """The pullers that completed a pull of the latest version (pull transport)."""
        if self.latest is None or self.blob is None:
            return []
        return self.blob.completed(self.latest.blob)

    async def wait_fetched(self, pullers: Collection[str]) -> None:
        """Before the trainer exits: wait until each of ``pullers`` pulled the latest
        version. Disk and broadcast versions outlive the trainer or were delivered already,
        so they need no wait."""
        if self.latest is not None and self.blob is not None and self.latest.blob:
            await self.blob.wait_completed(self.latest.blob, pullers)

    def close(self) -> None:
        """Give back the shared memory of ipc versions (engines still copying keep
        theirs until done; later opens fail) and the blobs that are views of it."""
        self._shared.close()
        if self.transport == "ipc" and self.blob is not None:
            for name in self.blob.blobs:
                self.blob.remove(name)

    async def settle(self) -> None:
        """Wait until the last version's broadcast has ended (before exiting)."""
        if self._sending is not None:
            await self._sending
            self._sending = None

    async def _broadcast(self, version: int, tensors: dict[str, torch.Tensor]) -> WeightVersion:
        """Put on the blob server, announce, and start the broadcast if the group is
        formed. It runs while the trainer trains on: the next version's waits for it
        (every member takes the versions in order), as does ``settle``."""
        assert self.group is not None
        await self.settle()
        pulled = self._put_blob(version, tensors)
        group = self.group.usable()
        manifest = layout(tensors, chunk_bytes=self.bucket_bytes, blob=pulled.blob)
        msg = msgspec.structs.replace(
            pulled,
            transport="dist",
            manifest=manifest,
            group=self.group.id,
            formed=group is not None,
        )
        self.publisher.publish(TOPIC, msg)  # subscribers join the broadcast on seeing it
        self.latest = msg
        if group is not None:
            self._sending = asyncio.ensure_future(self._send(group, manifest, tensors))
        return msg

    async def _send(
        self, group: BroadcastGroup, manifest: BlobManifest, tensors: dict[str, torch.Tensor]
    ) -> None:
        try:
            await asyncio.to_thread(group.send_buckets, manifest, tensors)
        except RuntimeError as exc:  # a member died or never came: it pulls instead
            assert self.group is not None
            self.group.failed(exc)

    async def _share(self, version: int, tensors: dict[str, torch.Tensor]) -> WeightVersion:
        """Into shared memory, and on the blob server as views of it."""
        handles, views = await asyncio.to_thread(self._shared.share, version, tensors)
        pulled = self._put_blob(version, views)
        return msgspec.structs.replace(pulled, transport="ipc", handles=handles, host=HOST)

    def _put_blob(self, version: int, tensors: dict[str, torch.Tensor]) -> WeightVersion:
        assert self.blob is not None
        manifest = self.blob.put(blob_name(version), tensors)
        return WeightVersion(
            version=version,
            transport="pull",
            location=self.blob.endpoint,
            blob=manifest.blob,
            manifest=manifest,
            trainer=self.lineage,
        )

    def _write_disk(self, version: int, tensors: dict[str, torch.Tensor]) -> WeightVersion:
        assert self.disk_dir is not None
        final = disk_path(self.disk_dir, version)
        write_version_dir(final, tensors)
        self._prune_disk(version)
        return WeightVersion(
            version=version, transport="disk", location=str(final), trainer=self.lineage
        )

    def _prune_disk(self, newest: int) -> None:
        assert self.disk_dir is not None
        for old in self.disk_dir.glob("weight_v*"):
            number = old.name.removeprefix("weight_v").removesuffix(".tmp")
            if number.isdigit() and int(number) <= newest - self.keep:
                shutil.rmtree(old, ignore_errors=True)


class WeightReceiver:
    """Subscriber side: follows the announcements and fetches the newest version.

    Open both channels (``await actor.open(...)`` or ``async with``) before use:
    ``receiver.subscriber`` and, for the pull transport, ``receiver.client(endpoint)``.
    """

    def __init__(
        self,
        endpoint: str,
        snapshot_endpoint: str,
        *,
        max_frame_bytes: int = 64 * 1024 * 1024,
        window: int = 64,
        group: GroupMember | None = None,
        name: str = "weights",
        puller: str = "",
        shared: bool = True,
    ) -> None:
        codec = Codec(WeightVersion, max_frame_bytes=max_frame_bytes)
        self.group = group
        self.subscriber = Subscriber(endpoint, snapshot_endpoint, codec, [TOPIC], name=name)
        self.window, self.max_frame_bytes, self.puller = window, max_frame_bytes, puller
        self.shared = shared  # ipc versions from shared memory (False: always pull)
        self.lineage = ""  # the trainer whose versions we take (WeightVersion.trainer)
        self._clients: dict[str, BlobClient] = {}
        #: dist and ipc versions taken by broadcast, from shared memory, and by pull
        self.counts = {"broadcast": 0, "shared": 0, "pulled": 0}

    async def __aenter__(self) -> WeightReceiver:
        await self.subscriber.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()
        await self.subscriber.__aexit__(*exc)

    async def next_version(self, after: int = -1, *, held: str | None = None) -> WeightVersion:
        """Wait for an announcement newer than the caller's weights, version ``after`` of
        the trainer ``held`` (``WeightVersion.trainer``; None: the trainer of the last
        announcement returned); the newest one if several queued. Another trainer's
        announcement is newer whatever its number: a restarted trainer resumed from a
        checkpoint, and its versions replace its predecessor's (and with ``dist`` every
        member must take each one it broadcasts). A caller that failed to load one passes
        ``held`` so that the new trainer's next versions are not skipped as old."""
        while True:
            msg = self._notice((await self.subscriber.receive()).msg)
            msg = self._newest_pending(msg)
            lineage = self.lineage if held is None else held
            if msg.version > after or (lineage and msg.trainer != lineage):
                self.lineage = msg.trainer
                return msg

    def _newest_pending(self, msg: WeightVersion) -> WeightVersion:
        while True:
            try:
                newer = self._notice(self.subscriber.receive_nowait().msg)
            except WouldBlock:
                return msg
            if newer.version > msg.version or newer.trainer != msg.trainer:
                msg = newer  # a later trainer's versions win, as they come later

    def _notice(self, msg: WeightVersion) -> WeightVersion:
        """A dist announcement names the group to join, even one we skip."""
        if self.group is not None and msg.transport == "dist":
            self.group.notice(msg.group, msg.formed)
        return msg

    async def fetch(
        self, msg: WeightVersion, *, out: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The tensors of ``msg``; with ``out`` (pull only) copied straight into them."""
        if msg.transport == "pull":
            client = await self._client(msg.location)
            return await client.fetch(msg.blob, out=out)
        if msg.transport == "disk":
            path = Path(msg.location)
            return await asyncio.to_thread(_load_dir, path)
        if msg.transport == "ipc":
            return await self._take_shared(msg, out)
        return await self._receive_broadcast(msg, out)

    async def _take_shared(
        self, msg: WeightVersion, out: dict[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        """From the trainer's shared memory when on its host, else (or when the version
        is gone there) by pull."""
        if msg.host == HOST and self.shared:
            got, sink = _collector(out)
            try:
                await asyncio.to_thread(take_shared, msg.handles, msg.version, sink)
                self.counts["shared"] += 1
                return got
            except EngineError as exc:  # dropped meanwhile: the blob server may have it
                log.warning("shared weights gone; pulling", version=msg.version, error=str(exc))
        client = await self._client(msg.location)
        tensors = await client.fetch(msg.blob, out=out)
        self.counts["pulled"] += 1
        return tensors

    async def _receive_broadcast(
        self, msg: WeightVersion, out: dict[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        """Over the group when it is formed with us in it, else (while it forms, or after
        a failed broadcast) by pull."""
        if msg.manifest is None:
            raise ValueError(f"'dist' weight version {msg.version} has no manifest")
        member = self.group if isinstance(self.group, GroupMembership) else None
        group = await member.for_version(msg.group, msg.formed) if member else None
        if group is not None:
            got, sink = _collector(out)
            try:
                await asyncio.to_thread(group.receive_buckets, msg.manifest, sink, out=out)
                self.counts["broadcast"] += 1
                return got
            except RuntimeError as exc:  # rank 0 aborted it (a member died): pull this one
                assert member is not None
                member.failed(exc)
        if not msg.blob:
            raise ValueError(f"'dist' weight version {msg.version} names no blob to pull")
        client = await self._client(msg.location)
        tensors = await client.fetch(msg.blob, out=out)
        self.counts["pulled"] += 1
        return tensors

    async def _client(self, endpoint: str) -> BlobClient:
        client = self._clients.get(endpoint)
        if client is None:
            client = BlobClient(
                endpoint,
                window=self.window,
                max_frame_bytes=self.max_frame_bytes,
                name="blob",
                puller=self.puller,
            )
            await client.__aenter__()
            self._clients[endpoint] = client
        return client


def _collector(out: dict[str, torch.Tensor] | None) -> tuple[dict[str, torch.Tensor], Sink]:
    """A sink for views that go away (a bucket buffer, shared memory): each is copied
    into ``out[name]``, or without ``out`` cloned into the returned dict."""
    got: dict[str, torch.Tensor] = {} if out is None else out

    def sink(name: str, view: torch.Tensor) -> None:
        if out is None:
            got[name] = view.clone()
        else:
            out[name].copy_(view)

    return got, sink


def write_version_dir(final: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` as ``final/model.safetensors`` (an adapter version: a peft adapter
    folder, ``lora_merge.peft_layout``), whole or not at all: written to a temporary
    directory, then renamed into place."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if is_adapter_version(tensors):
        config, weights = peft_layout(tensors)
        (tmp / PEFT_CONFIG).write_text(json.dumps(config, indent=1))
        save_file({k: v.contiguous() for k, v in weights.items()}, tmp / PEFT_WEIGHTS)
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def _load_dir(path: Path) -> dict[str, torch.Tensor]:
    if (path / PEFT_CONFIG).is_file():
        return read_peft_dir(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path} (was version pruned? keep more)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors |= load_file(f)
    return tensors
