"""The SGLang client's weight-update calls (``docs/sglang_api.md`` sections 2.1 to 2.5).

``WeightUpdateCalls`` makes one call per weight endpoint through the client's transport
and remembers, per engine, the server's version and whether a begin/end session (which
servers from 0.5.21 require) is open. Calls that start a collective return a
``PendingCall`` once their requests are written, so the trainer can broadcast while the
servers receive. The full sequence (pause, flush, update, continue) is
``SGLangClient.update_weights``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from typing import Any

import msgspec

from asyncrl.engines.client.transport import SentWatch, SGLangTransport, gather_replies
from asyncrl.engines.sglang_wire import version_tuple

DEFAULT_GROUP = "weight_update_group"
#: Servers from this version refuse distributed/tensor updates outside begin/end (2.5).
_SESSION_VERSION = (0, 5, 21)


class PendingCall:
    """Control calls already written to every engine's socket; ``await`` it for the replies.

    Lets the trainer run the collective the servers are joining (section 2.3): issue, then
    broadcast, then await. Its requests are on the wire, so a broadcast that blocks the
    event loop cannot starve them. Awaiting gives ``{url: reply}`` and raises the first
    failure.
    """

    def __init__(
        self,
        tasks: dict[str, asyncio.Task[Any]],
        after: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self.tasks, self._after = tasks, after

    def done(self) -> bool:
        """True when every reply is in."""
        return all(task.done() for task in self.tasks.values())

    async def wait(self) -> dict[str, Any]:
        """Every engine's reply, after ``after`` (closing a begin/end session) ran."""
        try:
            replies = await gather_replies(self.tasks)
        finally:
            if self._after is not None:
                await self._after()
        return replies

    def __await__(self) -> Generator[Any, None, dict[str, Any]]:
        return self.wait().__await__()


class WeightUpdateCalls:
    """One method per weight-update endpoint, on one engine or on every control target."""

    def __init__(self, transport: SGLangTransport) -> None:
        self.transport = transport
        self.config = transport.config
        self._server_versions: dict[str, tuple[int, ...] | None] = {}
        self._sessions_open: set[str] = set()

    async def update_weights_from_disk(
        self,
        path: str,
        version: int | None = None,
        *,
        flush_cache: bool | None = None,
        abort_all_requests: bool = False,
        load_format: str | None = None,
        url: str | None = None,
    ) -> dict[str, Any]:
        """``/update_weights_from_disk`` on one or every engine; ``{url: reply}``.

        Only the keys given are sent; ``version`` travels as a string. Without a pause the
        server waits for in-flight generates first (section 2.1).
        """
        body: dict[str, Any] = {"model_path": path}
        if version is not None:
            body["weight_version"] = str(version)
        if flush_cache is not None:
            body["flush_cache"] = flush_cache
        if abort_all_requests:
            body["abort_all_requests"] = True
        if load_format is not None:
            body["load_format"] = load_format
        return await self.transport.post_each(
            url,
            "/update_weights_from_disk",
            body,
            idempotent=True,
            admin=True,
            timeout_s=self.config.update_timeout_s,
        )

    async def group_layout(self) -> tuple[dict[str, int], int]:
        """Rank offsets per engine and the world size of a weight-update group.

        The trainer is rank 0; each engine's TP ranks follow (``tp_size`` from server info).
        """
        targets = await self.transport.targets(None)
        infos = await gather_replies(
            {u: self.transport.get_first(u, ("/get_server_info", "/server_info")) for u in targets}
        )
        offsets, next_rank = {}, 1
        for target in targets:
            offsets[target] = next_rank
            next_rank += int(infos[target].get("tp_size") or 1)
        return offsets, next_rank

    async def _issue(
        self,
        urls: Sequence[str],
        path: str,
        bodies: Mapping[str, Any],
        after: Callable[[], Awaitable[Any]] | None = None,
    ) -> PendingCall:
        """Start a non-idempotent admin POST on every URL; return once all are written."""
        watches = {u: SentWatch(len(msgspec.json.encode(bodies[u]))) for u in urls}
        tasks = {
            u: asyncio.create_task(
                self.transport.admin(
                    u,
                    path,
                    bodies[u],
                    idempotent=False,
                    timeout_s=self.config.update_timeout_s,
                    trace={"sent": watches[u]},
                ),
                name=f"sglang{path}",
            )
            for u in urls
        }
        for u in urls:
            written = asyncio.ensure_future(watches[u].event.wait())
            await asyncio.wait({tasks[u], written}, return_when=asyncio.FIRST_COMPLETED)
            written.cancel()
            if tasks[u].done() and tasks[u].exception() is not None:
                # Fail now: the other engines would wait for a collective that never comes.
                for task in tasks.values():
                    task.cancel()
                await asyncio.gather(*tasks.values(), return_exceptions=True)
                if after is not None:
                    await after()
                raise tasks[u].exception()  # type: ignore[misc]
        return PendingCall(tasks, after)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        *,
        world_size: int | None = None,
        rank_offsets: Mapping[str, int] | None = None,
        group_name: str = DEFAULT_GROUP,
        backend: str = "nccl",
    ) -> PendingCall:
        """Ask every engine to join the trainer's group; returns before they have joined.

        Then call ``init_process_group`` (rank 0, same world size) and await the result.
        Offsets and world size default to ``group_layout()``. Use ``backend="gloo"`` on CPU.
        """
        if rank_offsets is None or world_size is None:
            layout, size = await self.group_layout()
            rank_offsets, world_size = rank_offsets or layout, world_size or size
        bodies = {
            u: {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            }
            for u, offset in rank_offsets.items()
        }
        return await self._issue(list(bodies), "/init_weights_update_group", bodies)

    async def destroy_weights_update_group(
        self, group_name: str = DEFAULT_GROUP, *, url: str | None = None
    ) -> None:
        """``/destroy_weights_update_group`` on one or every engine."""
        body = {"group_name": group_name}
        await self.transport.post_each(
            url, "/destroy_weights_update_group", body, idempotent=False, admin=True
        )

    async def _needs_session(self, url: str) -> bool:
        version = await self._server_version(url)
        return version is not None and version >= _SESSION_VERSION

    async def begin_weight_update(self, *, url: str | None = None) -> None:
        """Open the update session servers >= 0.5.21 require; a no-op on older ones."""

        async def begin(u: str) -> None:
            if await self._needs_session(u) and u not in self._sessions_open:
                await self.transport.admin(
                    u, "/begin_weight_update", {"selector": "all"}, idempotent=False
                )
                self._sessions_open.add(u)

        await self.transport.each(url, begin)

    async def end_weight_update(self, *, url: str | None = None) -> None:
        """Close the session ``begin_weight_update`` opened (runs post-load hooks)."""

        async def end(u: str) -> None:
            if u in self._sessions_open:
                self._sessions_open.discard(u)
                await self.transport.admin(
                    u,
                    "/end_weight_update",
                    {},
                    idempotent=False,
                    timeout_s=self.config.update_timeout_s,
                )

        await self.transport.each(url, end)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = DEFAULT_GROUP,
        version: int | None = None,
        flush_cache: bool | None = None,
        load_format: str | None = None,
        url: str | None = None,
    ) -> PendingCall:
        """Announce one bucket on every engine; returns before the servers have received it.

        Broadcast the tensors (in ``names`` order, from rank 0), then await the result
        (section 2.3). Servers >= 0.5.21 get a begin/end session around this one call when
        ``begin_weight_update`` has not opened one.
        """
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names, dtypes, shapes differ in length: "
                f"{len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": [d.removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
        }
        for key, value in (
            ("flush_cache", flush_cache),
            ("load_format", load_format),
            ("weight_version", None if version is None else str(version)),
        ):
            if value is not None:
                body[key] = value
        targets = await self.transport.targets(url)
        fresh = [
            u for u in targets if u not in self._sessions_open and await self._needs_session(u)
        ]
        for u in fresh:
            await self.begin_weight_update(url=u)

        async def close_fresh() -> None:
            await asyncio.gather(*(self.end_weight_update(url=u) for u in fresh))

        return await self._issue(
            targets, "/update_weights_from_distributed", dict.fromkeys(targets, body), close_fresh
        )

    async def update_weights_from_tensor(
        self,
        named: Sequence[tuple[str, Any]],
        *,
        version: int | None = None,
        flattened: bool = False,
        flush_cache: bool | None = None,
        url: str | None = None,
    ) -> dict[str, Any]:
        """``/update_weights_from_tensor`` (section 2.4) of ``named``, by reference, on one
        or every engine (they share our host), in one flattened bucket with ``flattened``."""
        from asyncrl.weights.payload import encode
        from asyncrl.weights.payload import flattened as flatten

        payload = encode(flatten(list(named)) if flattened else list(named))
        return await self.update_weights_from_payloads(
            [payload], version=version, flattened=flattened, flush_cache=flush_cache, url=url
        )

    async def update_weights_from_payloads(
        self,
        payloads: Sequence[str],
        *,
        version: int | None = None,
        flattened: bool = True,
        flush_cache: bool | None = None,
        url: str | None = None,
    ) -> dict[str, Any]:
        """One ``/update_weights_from_tensor`` per serialized payload, in order, on one or
        every engine; ``version`` set with the last. Servers >= 0.5.21 get a begin/end
        session around them when none is open. ``{url: last reply}``."""
        body: dict[str, Any] = {"load_format": "flattened_bucket" if flattened else None}
        if flush_cache is not None:
            body["flush_cache"] = flush_cache

        async def one(u: str) -> Any:
            opened = u not in self._sessions_open and await self._needs_session(u)
            if opened:
                await self.begin_weight_update(url=u)
            try:
                reply = None
                for i, payload in enumerate(payloads):
                    last = {"weight_version": str(version)} if i == len(payloads) - 1 else {}
                    reply = await self.transport.admin(
                        u,
                        "/update_weights_from_tensor",
                        {
                            **body,
                            **({} if version is None else last),
                            "serialized_named_tensors": [payload],
                        },
                        idempotent=False,
                        timeout_s=self.config.update_timeout_s,
                    )
                return reply
            finally:
                if opened:
                    await self.end_weight_update(url=u)

        return await self.transport.each(url, one)

    async def _server_version(self, url: str) -> tuple[int, ...] | None:
        if url not in self._server_versions:
            info = await self.transport.get_first(url, ("/get_server_info", "/server_info"))
            self._server_versions[url] = version_tuple(info.get("version"))
        return self._server_versions[url]
