"""``SGLangClient``: how rollout actors and the trainer talk to every inference engine.

One client speaks SGLang's HTTP API (``docs/sglang_api.md``) to N engines: the embedded
server (``asyncrl serve``), SGLang servers, or one sglang-router. This module holds the
public calls and their sequences; ``transport`` carries them (policy: ``docs/client.md``)
and ``weights`` makes the weight-update calls.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import aiohttp
import msgspec

from asyncrl.engines.base import PauseMode, SamplingParams
from asyncrl.engines.client.transport import EngineState, SGLangTransport
from asyncrl.engines.client.weights import DEFAULT_GROUP, PendingCall, WeightUpdateCalls
from asyncrl.engines.sglang_wire import (
    EngineUnavailable,
    GenerateResult,
    SGLangError,
    StreamState,
    WeightBucket,
    error_message,
    generate_body,
    load_count,
    parse_generate_output,
    parse_weight_version,
    sampling_dict,
    sse_events,
    stream_failure,
)

__all__ = [
    "DEFAULT_GROUP",
    "EngineUnavailable",
    "GenerateResult",
    "PendingCall",
    "SGLangClient",
    "SGLangError",
    "WeightBucket",
    "error_message",
    "parse_generate_output",
    "parse_weight_version",
    "sampling_dict",
]


class SGLangClient:
    """Async client for SGLang-API engines; use as ``async with SGLangClient(urls) as c:``.

    ``transport`` (an ``SGLangTransport``) carries every call and keeps the rotation and
    health (``c.transport.health()``, ``in_rotation()``, ``on_return``); ``weights`` (a
    ``WeightUpdateCalls``) has one method per weight endpoint. ``SGLangClient.Config`` is
    the transport's: timeouts and retries.
    """

    Config = SGLangTransport.Config

    def __init__(
        self, urls: str | Sequence[str], *, router: bool = False, config: Config | None = None
    ) -> None:
        self.transport = SGLangTransport(urls, router=router, config=config)
        self.weights = WeightUpdateCalls(self.transport)
        self.config, self.router = self.transport.config, router
        self._legacy_loads: set[str] = set()  # engines answering only /get_load

    async def __aenter__(self) -> SGLangClient:
        await self.transport.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.transport.close()

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        stream: bool = False,
        prefer: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> GenerateResult:
        """Generate from token ids; the final result (an abort is a normal partial result).

        ``rid`` defaults to a fresh uuid (use yours to abort one request). ``stream=True``
        consumes ``generate_stream`` and returns its last result. ``prefer`` pins an engine
        while it is in rotation; ``extra`` adds top-level keys (``lora_path``, ...).
        Raises ``SGLangError`` (the server's message), ``EngineUnavailable``, or
        ``TimeoutError`` past ``Config.generate_timeout_s``.
        """
        if stream:
            final = None
            chunks = self.generate_stream(
                input_ids,
                sampling_params,
                rid=rid,
                return_logprob=return_logprob,
                prefer=prefer,
                extra=extra,
            )
            async for result in chunks:
                final = result
            assert final is not None
            return final
        rid = rid or uuid.uuid4().hex
        body = generate_body(
            input_ids, sampling_params, rid, return_logprob=return_logprob, extra=extra
        )
        wire = msgspec.json.encode(body)
        engine, payload = await self.transport.retry_generate(
            prefer, lambda engine, last: self._generate_once(engine, wire, rid, last)
        )
        if not isinstance(payload, dict) or "error" in payload:
            raise SGLangError(200, error_message(payload), payload, url=engine.url)
        return parse_generate_output(payload, engine=engine.url)

    async def _generate_once(
        self, engine: EngineState, wire: bytes, rid: str, last: bool
    ) -> Any | None:
        """One non-stream ``/generate`` attempt with the encoded body ``wire``: its reply,
        or None to retry. An empty 200 reply raises: the call was accepted, so it is never
        sent again."""
        if (resp := await self.transport.post_generate(engine, wire, rid, last)) is None:
            return None
        if (payload := await self._read_generate(engine, resp, rid)) is None:
            raise SGLangError(200, "/generate answered with an empty body", url=engine.url)
        return payload

    async def _read_generate(
        self, engine: EngineState, resp: aiohttp.ClientResponse, rid: str
    ) -> Any:
        try:
            async with resp:
                return await self.transport.read(resp)
        except aiohttp.ClientError as exc:
            self.transport.mark_down(engine, exc)
            raise EngineUnavailable(0, f"/generate lost: {exc}", url=engine.url) from exc
        finally:
            self.transport.release(engine, rid)

    async def generate_stream(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        prefer: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[GenerateResult]:
        """Stream ``/generate``: a cumulative result per chunk, the last one final.

        Cumulative and delta servers give the same results; the final chunk is trusted.
        An error chunk, or an abort with an HTTP status, raises ``SGLangError``; a stream
        that ends without a final chunk raises ``EngineUnavailable``.
        """
        rid = rid or uuid.uuid4().hex
        body = generate_body(
            input_ids,
            sampling_params,
            rid,
            return_logprob=return_logprob,
            stream=True,
            extra=extra,
        )
        engine, resp = await self.transport.open_generate(body, rid, prefer)
        state, final = StreamState(engine.url), None
        try:
            async with resp:
                async for chunk in sse_events(resp.content, engine.url):
                    if not isinstance(chunk, dict):
                        continue
                    if (failure := stream_failure(chunk, engine.url)) is not None:
                        raise failure
                    final = state.add(chunk)
                    yield final
        except aiohttp.ClientError as exc:
            self.transport.mark_down(engine, exc)
            raise EngineUnavailable(0, f"/generate stream lost: {exc}", url=engine.url) from exc
        finally:
            self.transport.release(engine, rid)
        if final is None or not final.finished:
            raise EngineUnavailable(0, "stream ended without a final chunk", url=engine.url)

    # ------------------------------------------------------------------ abort / pause

    async def abort(
        self, rid: str | None = None, *, abort_all: bool = False, url: str | None = None
    ) -> None:
        """``/abort_request``: one rid (SGLang aborts it, once it is live, and every request
        whose id starts with it) or everything.

        A rid goes to the engine serving it when this client sent it, else to every
        engine. Returns before the aborted calls have answered (section 2.9): await them,
        or ``wait_idle``.
        """
        if (rid is None) == (not abort_all):
            raise ValueError("abort takes either rid=... or abort_all=True")
        body: dict[str, Any] = {"abort_all": True} if abort_all else {"rid": rid}
        if url is None and rid is not None and not self.router:
            url = self.transport.engine_of(rid)
        await self.transport.post_each(url, "/abort_request", body, idempotent=True)

    async def abort_prefix(self, prefix: str) -> int:
        """Abort, one exact id at a time, every call of this client in flight whose rid
        starts with ``prefix`` (SGLang aborts only a rid that is live); returns how many."""
        rids = [rid for rid in self.transport.in_flight() if rid.startswith(prefix)]
        for rid in rids:
            await self.abort(rid=rid)
        return len(rids)

    async def pause(self, mode: PauseMode = "abort", *, url: str | None = None) -> None:
        """``/pause_generation``; in ``abort`` mode it returns once every call has answered.

        The default mode is sent as ``{}`` (SGLang's default), which 0.5.5 also accepts.
        """
        body = {} if mode == "abort" else {"mode": mode}
        await self.transport.post_each(
            url, "/pause_generation", body, idempotent=True, timeout_s=self.config.update_timeout_s
        )

    async def continue_(self, *, url: str | None = None) -> None:
        """``/continue_generation``: undo ``pause``."""
        await self.transport.post_each(url, "/continue_generation", {}, idempotent=True)

    async def _engine_load(self, url: str) -> int:
        if url not in self._legacy_loads:
            try:
                return load_count(
                    await self.transport.call(url, "GET", "/v1/loads?include=core", idempotent=True)
                )
            except SGLangError as exc:
                if exc.status != 404:
                    raise
            self._legacy_loads.add(url)  # servers before 0.5.10
        return load_count(await self.transport.call(url, "GET", "/get_load", idempotent=True))

    async def wait_idle(
        self,
        *,
        timeout_s: float | None = None,
        poll_s: float = 0.2,
        reabort_s: float | None = None,
    ) -> None:
        """Poll loads until every engine has no running or waiting request and this client
        has no open ``/generate``; with ``reabort_s``, abort all again at that period (slime).

        Raises ``TimeoutError`` naming the last counts after ``timeout_s``.
        """
        loop = asyncio.get_running_loop()
        start = last_abort = loop.time()
        while True:
            loads = await self.transport.each(None, self._engine_load)
            own = sum(self.transport.inflight().values())
            if own == 0 and not any(loads.values()):
                return
            now = loop.time()
            if timeout_s is not None and now - start >= timeout_s:
                raise TimeoutError(
                    f"engines not idle after {timeout_s}s: loads {loads}, "
                    f"{own} calls of this client still open"
                )
            if reabort_s is not None and now - last_abort >= reabort_s:
                await self.abort(abort_all=True)
                last_abort = now
            await asyncio.sleep(poll_s)

    async def abort_all_and_wait(self, *, timeout_s: float = 180.0, reabort_s: float = 3.0) -> None:
        """APRIL's stop: abort everything on every engine, then wait until all are idle."""
        await self.abort(abort_all=True)
        await self.wait_idle(timeout_s=timeout_s, reabort_s=reabort_s)

    # ------------------------------------------------------------------ queries

    async def server_info(self, url: str | None = None) -> dict[str, Any]:
        """``/get_server_info`` (fallback ``/server_info``) of one engine (default: the first)."""
        target = (await self.transport.targets(url))[0]
        return await self.transport.get_first(target, ("/get_server_info", "/server_info"))

    async def weight_version(self, url: str | None = None) -> int:
        """The weight version served: one engine's, or the oldest across all engines.

        Reads ``/get_weight_version`` and falls back to ``/model_info`` (404 from 0.5.8).
        """
        versions = await self.transport.each(url, self.transport.engine_weight_version)
        return min(versions.values())

    # ------------------------------------------------------------------ cache and memory

    async def _flush_one(self, url: str, retries: int, interval_s: float) -> str:
        for attempt in range(retries + 1):
            try:
                return await self.transport.call(url, "GET", "/flush_cache", idempotent=True) or ""
            except SGLangError as exc:
                if exc.status != 400 or attempt == retries:
                    raise
            await asyncio.sleep(interval_s)
        raise AssertionError("unreachable")

    async def flush_cache(
        self, retries: int = 60, *, interval_s: float = 1.0, url: str | None = None
    ) -> None:
        """``GET /flush_cache``, polled while it answers 400 (requests still running), as slime."""
        await self.transport.each(url, lambda u: self._flush_one(u, retries, interval_s))

    async def release_memory(
        self, tags: Sequence[str] | None = None, *, url: str | None = None
    ) -> None:
        """``/release_memory_occupation`` (engines must be idle; pause or abort first)."""
        body = {} if tags is None else {"tags": list(tags)}
        await self.transport.post_each(url, "/release_memory_occupation", body, idempotent=False)

    async def resume_memory(
        self, tags: Sequence[str] | None = None, *, url: str | None = None
    ) -> None:
        """``/resume_memory_occupation``: undo ``release_memory``."""
        body = {} if tags is None else {"tags": list(tags)}
        await self.transport.post_each(url, "/resume_memory_occupation", body, idempotent=False)

    # ------------------------------------------------------------------ weights

    async def update_weights(
        self,
        version: int,
        *,
        path: str | None = None,
        buckets: Sequence[WeightBucket] = (),
        broadcast: Callable[[WeightBucket], Any] | None = None,
        group_name: str = DEFAULT_GROUP,
        payloads: Sequence[str] = (),
        pause_mode: PauseMode = "abort",
        flush_retries: int = 60,
        url: str | None = None,
    ) -> None:
        """Section 2.15 on every engine (or the one at ``url``, from disk only): pause,
        flush (retried), update, continue. ``payloads``: ``/update_weights_from_tensor``
        flattened buckets, already serialized (shared by the trainer on this host).

        Disk: ``path``. Distributed: ``buckets`` and ``broadcast(bucket)`` (sync or async),
        which the trainer uses to send each bucket's tensors; each bucket is announced
        first, and the version is set with the last one. The cache is flushed only in
        ``abort`` mode: ``in_place``/``retract`` keep requests, and flush refuses to run
        while they exist. On failure the engines stay paused (weights may be half
        loaded); retry the update or restart them.
        """
        if (path is not None) + (broadcast is not None) + bool(payloads) != 1:
            raise ValueError(
                "update_weights takes path=..., buckets=... with broadcast=..., or payloads=..."
            )
        if broadcast is not None and not buckets:
            raise ValueError("update_weights got broadcast= but no buckets to announce")
        if url is not None and path is None:
            raise ValueError("update_weights: a broadcast goes to every engine, not one url")
        await self.pause(pause_mode, url=url)
        if pause_mode == "abort":
            await self.flush_cache(flush_retries, url=url)
        if path is not None:
            await self.weights.update_weights_from_disk(path, version, flush_cache=False, url=url)
        elif payloads:
            await self.weights.update_weights_from_payloads(
                payloads, version=version, flush_cache=False
            )
        else:
            await self._distributed_buckets(version, buckets, broadcast, group_name)
        await self.continue_(url=url)

    async def _distributed_buckets(
        self,
        version: int,
        buckets: Sequence[WeightBucket],
        broadcast: Callable[[WeightBucket], Any] | None,
        group_name: str,
    ) -> None:
        assert broadcast is not None
        await self.weights.begin_weight_update()
        for index, bucket in enumerate(buckets):
            last = index == len(buckets) - 1
            pending = await self.weights.update_weights_from_distributed(
                bucket.names,
                bucket.dtypes,
                bucket.shapes,
                group_name=group_name,
                version=version if last else None,
                flush_cache=False,
                load_format=bucket.load_format,
            )
            if inspect.isawaitable(sent := broadcast(bucket)):
                await sent
            await pending
        await self.weights.end_weight_update()

    # ------------------------------------------------------------------ router workers

    async def list_workers(self) -> list[dict[str, Any]]:
        """The router's workers (``GET /workers``; legacy ``/list_workers`` gives urls only)."""
        return await self.transport.list_workers()

    async def add_worker(
        self, url: str, *, worker_type: str = "regular", wait_s: float | None = 30.0
    ) -> str:
        """``POST /workers`` (202, registered in the background); returns the worker id.

        With ``wait_s`` it polls ``GET /workers`` until the worker is listed and healthy.
        """
        body = {"url": url.rstrip("/"), "worker_type": worker_type}
        reply = await self.transport.call(
            self.transport.router_url(), "POST", "/workers", body, idempotent=False
        )
        worker_id = str((reply or {}).get("worker_id", ""))
        deadline = time.monotonic() + (wait_s or 0)
        while wait_s is not None:
            listed = [w for w in await self.transport.list_workers() if w.get("url") == body["url"]]
            if listed and listed[0].get("is_healthy", True):
                return str(listed[0].get("id", worker_id))
            if time.monotonic() >= deadline:
                raise TimeoutError(f"router did not list {url} as healthy within {wait_s}s")
            await asyncio.sleep(0.1)
        return worker_id

    async def remove_worker(self, worker: str, *, wait_s: float | None = 30.0) -> None:
        """``DELETE /workers/{id}`` (202, removed in the background); a URL is resolved first.

        With ``wait_s`` it polls ``GET /workers`` until the worker is no longer listed, so
        the caller can rely on the router not sending it new work.
        """
        if worker.startswith(("http://", "https://")):
            listed = await self.transport.list_workers()
            ids = [w["id"] for w in listed if w.get("url") == worker.rstrip("/")]
            if not ids:
                raise ValueError(f"the router lists no worker at {worker}")
            worker = str(ids[0])
        await self.transport.call(
            self.transport.router_url(), "DELETE", f"/workers/{worker}", idempotent=False
        )
        deadline = time.monotonic() + (wait_s or 0)
        while wait_s is not None:
            if all(str(w.get("id")) != worker for w in await self.transport.list_workers()):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"router still lists worker {worker} after {wait_s}s")
            await asyncio.sleep(0.1)
