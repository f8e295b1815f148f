"""The ``dist`` transport into engines behind the SGLang API: ``ServerGroup``.

Such an engine cannot join the trainer's group from inside the rollout actor, so the actor
asks it to over SGLang's own routes (``docs/sglang_api.md`` 2.2, 2.3, 2.5), at the actor's
rank, and announces each bucket after the last one's reply, so the server receives the
broadcasts in the order the trainer sends them:

    trainer (rank 0)                 rollout-i                     its engine (rank i + 1)
    announce v (group G forming) ->  /init_weights_update_group -> joins G SGLang's way
    G formed; announce v+1       ->  pause, then per bucket:
    broadcast bucket 0, 1, ...       /update_weights_from_distributed -> receives it
                                     continue

A version that cannot go by broadcast goes to the engines from disk (``EngineHost``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from asyncrl.engines.client.sglang import SGLangError
from asyncrl.engines.sglang_wire import WeightBucket
from asyncrl.errors import InputError
from asyncrl.observe.logs import get_logger
from asyncrl.weights.buckets import manifest_buckets
from asyncrl.weights.group import group_name, may_join, split_address

if TYPE_CHECKING:
    from asyncrl.engines.client.sglang import SGLangClient
    from asyncrl.weights.config import GroupConfig
    from asyncrl.wire.messages import BlobManifest

log = get_logger("asyncrl.weights")


def server_buckets(manifest: BlobManifest) -> list[WeightBucket]:
    """The ``/update_weights_from_distributed`` calls of one version, in broadcast order:
    a bucket of one tensor as that tensor, one of several as ``flattened_bucket`` (their
    bytes, as the trainer sends them: ``weights.group.on_the_wire``)."""
    entries = manifest.entries
    calls = []
    for bucket in manifest_buckets(manifest):
        part = entries[bucket.start : bucket.end]
        calls.append(
            WeightBucket(
                names=[e.name for e in part],
                dtypes=[e.dtype for e in part],
                shapes=[list(e.shape) for e in part],
                load_format=None if len(part) == 1 else "flattened_bucket",
            )
        )
    return calls


class ServerGroup:
    """The rollout actor's engine in the job's weight group, by the SGLang routes.

    ``notice`` every announcement (a new id forming: the engine joins it in the
    background); ``for_version`` gives the group name to receive a version on, or None.
    """

    def __init__(self, cfg: GroupConfig, *, rank: int, address: str, client: SGLangClient):
        self.cfg, self.rank, self.client = cfg, rank, client
        self.address = split_address(address)
        self.id = ""  # the id the engine joined or is joining
        self.joined = ""  # the group name it is in ("" until a join succeeds)
        self._joining: asyncio.Task[None] | None = None

    async def check(self) -> None:
        """Refuse engines that cannot be one rank: several, or one of several TP ranks."""
        offsets, world = await self.client.weights.group_layout()
        if len(offsets) != 1 or world != 2:
            raise InputError(
                f"--update-weight-transport dist gives each rollout actor one rank, but its "
                f"engines have {world - 1} ({len(offsets)} server(s), tp_size summed): use one "
                f"server with tp_size 1 per rollout actor, or --update-weight-transport disk"
            )

    def notice(self, group_id: str, formed: bool) -> None:
        """On any announcement: join a new id that is still forming (as ``GroupMembership``).
        A formed one we never joined may hold our engine from a predecessor of this actor
        that died between two buckets: the trainer's next broadcast would wait for the
        engine until its timeout. Take the engine out (best effort), so it fails at once
        and the trainer re-forms."""
        if not group_id or group_id == self.id:
            return
        previous = self._joining
        self.id = group_id
        if formed:
            self._joining = asyncio.ensure_future(self._evict(group_id, previous))
        else:
            self._joining = asyncio.ensure_future(self._join(group_id, previous))

    async def for_version(self, group_id: str, formed: bool) -> str | None:
        """The group name to receive this version on; None when it cannot go by broadcast."""
        self.notice(group_id, formed)
        if not formed or group_id != self.id or self._joining is None:
            return None
        try:
            await asyncio.wait_for(asyncio.shield(self._joining), self.cfg.join_timeout_s)
        except Exception as exc:
            log.warning("engine did not join the weight group", group=group_id, error=repr(exc))
            return None
        return self.joined if self.joined == group_name(group_id) else None

    async def failed(self, exc: BaseException) -> None:
        """A broadcast into the engine failed: take the engine out of the group (best
        effort), so the trainer's broadcast fails at once if it still waits for it (the
        call may have failed on our side only), and the trainer re-forms."""
        log.warning(
            "weight broadcast into the engine failed; it takes this version from disk "
            "and rejoins when the group re-forms",
            group=self.id,
            error=repr(exc),
        )
        await self._leave()

    async def aclose(self) -> None:
        """Stop joining, and leave the group (best effort: the engine may be gone)."""
        await _cancelled(self._joining)
        await self._leave()

    async def _join(self, group_id: str, previous: asyncio.Task[None] | None) -> None:
        """Ask the engine to join ``group_id`` if the trainer is still forming it: a server
        blocks (vLLM, SGLang: generation too) until every rank arrives or the join times
        out, and one that came after the trainer gave up would only wait out the timeout."""
        await _cancelled(previous)
        await self._leave()
        name = group_name(group_id)
        (url,) = (await self.client.weights.group_layout())[0]
        host, port = self.address
        refused = await asyncio.to_thread(may_join, host, port, group_id, self.rank)
        if refused:
            log.info("the engine joins the next weight group, not this one", group=group_id,
                     reason=refused)  # fmt: skip
            if self.id == group_id:  # so that its formed announcement takes the engine out
                self.id = ""
            return
        log.info("engine joining the weight group", group=group_id, rank=self.rank)
        pending = await self.client.weights.init_weights_update_group(
            host,
            port,
            world_size=self.cfg.world_size,
            rank_offsets={url: self.rank},
            group_name=name,
            backend=self.cfg.backend,
        )
        await pending  # the server answers once every rank has arrived
        self.joined = name
        log.info("engine joined the weight group", group=group_id, rank=self.rank)

    async def _evict(self, group_id: str, previous: asyncio.Task[None] | None) -> None:
        await _cancelled(previous)
        with contextlib.suppress(SGLangError, OSError):
            await self.client.weights.destroy_weights_update_group(group_name(group_id))
            log.warning("our engine was left in the weight group; taken out", group=group_id)

    async def _leave(self) -> None:
        name, self.joined = self.joined, ""
        if name:
            with contextlib.suppress(SGLangError, OSError):
                await self.client.weights.destroy_weights_update_group(name)


async def _cancelled(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` and wait until it has ended; our own cancellation still raises."""
    if task is not None:
        task.cancel()
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            log.debug("an earlier join ended", error=repr(task.exception()))
