"""The SGLang client's transport: connection pools, retries and the choice of engine.

``SGLangTransport`` owns the aiohttp sessions, the retry rules, the engine rotation, the
load refresher and the raw ``/generate`` POST; ``SGLangClient`` and its weight calls go
through it. Retries, rotation, health and the router's worker list share one connection
state, so they stay in one class. The policy: ``docs/client.md``.
"""

from __future__ import annotations

import asyncio
import functools
import resource
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import aiohttp
import msgspec

from asyncrl.engines.sglang_wire import (
    EngineUnavailable,
    SGLangError,
    error_message,
    load_count,
    parse_weight_version,
    router_refused,
)
from asyncrl.observe.logs import get_logger

log = get_logger("asyncrl.sglang_client")
_T = TypeVar("_T")

_JSON = {"Content-Type": "application/json"}


class SentWatch:
    """Set once a request body has been handed to the socket (``PendingCall`` waits on it)."""

    def __init__(self, size: int) -> None:
        self.remaining, self.event = size, asyncio.Event()


async def _on_chunk_sent(session: Any, ctx: Any, params: aiohttp.TraceRequestChunkSentParams):
    # aiohttp calls this just before the chunk is written, with no await in between, so a
    # waiter woken by the event runs after the write.
    watch = (ctx.trace_request_ctx or {}).get("sent")
    if isinstance(watch, SentWatch):
        watch.remaining -= len(params.chunk)
        if watch.remaining <= 0:
            watch.event.set()


async def gather_replies(tasks: Mapping[str, Awaitable[Any]]) -> dict[str, Any]:
    """``{url: result}``; the first failure is raised once all have finished."""
    results = await asyncio.gather(*tasks.values(), return_exceptions=True)
    failures = {
        url: r for url, r in zip(tasks, results, strict=True) if isinstance(r, BaseException)
    }
    if len(failures) > 1:
        log.warning(
            "control call failed on several engines",
            errors={url: repr(error) for url, error in failures.items()},
        )
    if failures:
        raise next(iter(failures.values()))
    return dict(zip(tasks, results, strict=True))


@dataclass(slots=True)
class EngineState:
    """What the client knows about one base URL."""

    url: str
    inflight: int = 0
    reported: int = 0
    inflight_at_report: int = 0
    reported_at: float = float("-inf")
    down_until: float | None = None
    loads_path: str = "/v1/loads?include=core"
    returning: bool = False  # ``on_return`` is running for it
    probing: asyncio.Task[bool] | None = None  # the probe every concurrent caller awaits

    def score(self) -> int:
        """Own in-flight calls plus what others put on the engine at its last report."""
        return self.inflight + max(0, self.reported - self.inflight_at_report)


#: The share of open files kept for everything but the pool's sockets (listening
#: sockets, zmq's sockets and eventfds, logs, pipes, model files); at least 512.
_RESERVED_SHARE = 8


def pool_size(configured: int | None) -> int:
    """Connections one client may open: ``configured``, else half of this process's
    open-file limit less a reserve (an eighth of it, at least 512).

    Each connection is a socket, and an engine embedded in this process holds the server
    end of it as another. Past the limit connects fail with EMFILE and the engines leave
    the rotation; a bounded pool queues the calls here instead.
    """
    if configured is not None:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 0
    return max(64, (soft - max(512, soft // _RESERVED_SHARE)) // 2)


def _forget_probe(engine: EngineState, probe: asyncio.Task[bool]) -> None:
    if engine.probing is probe:
        engine.probing = None


def _timeout(total: float, connect: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=total, sock_connect=connect)


class SGLangTransport:
    """HTTP, retries and engine rotation for ``SGLangClient`` (policy: ``docs/client.md``)."""

    @dataclass(kw_only=True, slots=True, frozen=True)
    class Config:
        """Timeouts, retries and load-refresh settings (the module docstring has the policy)."""

        generate_timeout_s: float = 4 * 3600.0
        """Whole-call limit of ``/generate`` (4 h, as slime's router)."""
        update_timeout_s: float = 3600.0
        """Calls that wait on a drain or a collective: pause, weight updates, group init."""
        control_timeout_s: float = 30.0
        """Every other call, and the TCP connect of all calls."""
        retries: int = 3
        """Retries of a retryable failure (module docstring); 0 disables them."""
        backoff_s: float = 0.1
        """First retry delay; doubles per retry up to ``max_backoff_s``."""
        max_backoff_s: float = 2.0
        """Cap of the retry delay."""
        load_refresh_s: float = 1.0
        """Minimum age of an engine's load report before it is fetched again."""
        recheck_s: float = 2.0
        """How often an engine out of rotation is probed with ``GET /health``."""
        health_check_s: float | None = None
        """Check the engines in rotation with ``GET /health_generate`` this often (None:
        only failed calls take an engine out). Also makes it the probe to come back."""
        api_key: str | None = None
        """Sent as ``Authorization: Bearer`` when the servers run with ``--api-key``."""
        max_connections: int | None = None
        """Connection-pool size; calls beyond it wait in this process for a connection.
        None: from the open-file limit (``pool_size``); 0: unlimited."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        router: bool = False,
        config: Config | None = None,
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("SGLangClient needs at least one engine URL")
        if router and len(urls) != 1:
            raise ValueError(f"router=True takes the one router URL, got {len(urls)} URLs")
        self.config = config or type(self).Config()
        self.router = router
        self._engines = [EngineState(url.rstrip("/")) for url in urls]
        self._rids: dict[str, EngineState] = {}
        self._cursor = 0
        self._refresh_task: asyncio.Task[None] | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None  # /generate
        self._control: aiohttp.ClientSession | None = None  # every other call
        #: Runs before an engine out of rotation rejoins it (``docs/client.md``).
        self.on_return: Callable[[str], Awaitable[None]] | None = None
        #: The weight version every engine in rotation should serve (set by whoever loads
        #: weights); a health check that finds an engine below it (restarted between two
        #: checks) takes it out, so that it comes back through ``on_return``.
        self.expected_version: int | None = None

    async def __aenter__(self) -> Self:
        trace = aiohttp.TraceConfig()
        trace.on_request_chunk_sent.append(_on_chunk_sent)
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        # Two pools: generations in one bounded by the open-file limit, control calls,
        # probes and load reports in their own, so that a pool full of long generations
        # never holds back a pause, an abort or a health check (which would then time out
        # and take a healthy engine out of the rotation).
        self._http, self._control = (
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=limit),
                headers=headers,
                trace_configs=[trace],
                trust_env=False,
            )
            for limit in (pool_size(self.config.max_connections), 0)
        )
        if self.config.health_check_s is not None and not self.router:
            self._health_task = asyncio.create_task(self._health_loop(), name="sglang-health")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the load refresher, the health checks and the probes; close the pool."""
        probes = [e.probing for e in self._engines]
        for task in (self._refresh_task, self._health_task, *probes):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for session in (self._http, self._control):
            if session is not None:
                await session.close()

    @property
    def urls(self) -> list[str]:
        """The base URLs this client was given."""
        return [engine.url for engine in self._engines]

    def in_rotation(self) -> list[str]:
        """Base URLs currently chosen for requests (the others failed to connect or health)."""
        return [e.url for e in self._engines if e.down_until is None]

    def inflight(self) -> dict[str, int]:
        """This client's open ``/generate`` calls per engine."""
        return {engine.url: engine.inflight for engine in self._engines}

    # ------------------------------------------------------------------ HTTP core

    @property
    def _session(self) -> aiohttp.ClientSession:
        """The control calls' session (see ``__aenter__``)."""
        if self._control is None:
            raise RuntimeError("SGLangClient is not open: use `async with SGLangClient(...)`")
        return self._control

    @property
    def _generate_session(self) -> aiohttp.ClientSession:
        """The generations' session, its pool bounded by ``pool_size``."""
        if self._http is None:
            raise RuntimeError("SGLangClient is not open: use `async with SGLangClient(...)`")
        return self._http

    async def read(self, resp: aiohttp.ClientResponse) -> Any:
        """JSON when it parses, else the text (``flush_cache``), None when empty."""
        raw = await resp.read()
        if not raw.strip():
            return None
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return raw.decode(errors="replace")

    async def call(
        self,
        url: str,
        method: str,
        path: str,
        body: Any = None,
        *,
        idempotent: bool,
        timeout_s: float | None = None,
        trace: dict[str, Any] | None = None,
    ) -> Any:
        """One control call with the retry rules of ``docs/client.md``."""
        bodyless = method in ("GET", "DELETE")
        data = None if bodyless else msgspec.json.encode({} if body is None else body)
        timeout = _timeout(
            timeout_s or self.config.control_timeout_s, self.config.control_timeout_s
        )
        delay = self.config.backoff_s
        for attempt in range(self.config.retries + 1):
            last = attempt == self.config.retries
            try:
                async with self._session.request(
                    method,
                    url + path,
                    data=data,
                    headers=_JSON if data is not None else None,
                    timeout=timeout,
                    trace_request_ctx=trace,
                ) as resp:
                    payload = await self.read(resp)
            except aiohttp.ClientConnectorError as exc:
                if last:
                    raise EngineUnavailable(0, str(exc), url=url) from exc
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if last or not idempotent:
                    raise EngineUnavailable(0, f"{path}: {exc}", url=url) from exc
            else:
                if resp.status < 400:
                    return payload
                if resp.status != 503 or not idempotent or last:
                    raise SGLangError(resp.status, error_message(payload), payload, url=url)
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.config.max_backoff_s)
        raise AssertionError("unreachable")

    async def admin(self, url: str, path: str, body: Any, **kwargs: Any) -> Any:
        """A ``{"success", "message"}`` call: ``success: false`` is an error even on 200."""
        reply = await self.call(url, "POST", path, body, **kwargs)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise SGLangError(400, error_message(reply), reply, url=url)
        return reply

    async def each(self, url: str | None, fn: Callable[[str], Awaitable[Any]]) -> dict[str, Any]:
        """Run ``fn`` on one engine or on all control targets at once.

        With a rotation to keep (``on_return`` set), an engine that cannot be reached
        leaves the rotation instead of failing the call, as long as another engine
        answered: ``on_return`` brings it up to date before it serves again.
        """
        targets = await self.targets(url)
        if url is not None or self.router or self.on_return is None or len(targets) < 2:
            return await gather_replies({target: fn(target) for target in targets})
        results = await asyncio.gather(*(fn(t) for t in targets), return_exceptions=True)
        replies = dict(zip(targets, results, strict=True))
        gone = {t: r for t, r in replies.items() if isinstance(r, EngineUnavailable)}
        if len(gone) == len(targets):
            raise next(iter(gone.values()))
        for target, error in gone.items():
            self.mark_down(self._engine(target), error)
            del replies[target]
        for reply in replies.values():
            if isinstance(reply, BaseException):
                raise reply
        return replies

    def _engine(self, url: str) -> EngineState:
        return next(e for e in self._engines if e.url == url)

    async def post_each(
        self,
        url: str | None,
        path: str,
        body: Any,
        *,
        idempotent: bool,
        admin: bool = False,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """POST one body to one engine or to all control targets; ``{url: reply}``."""
        call = self.admin if admin else functools.partial(self.call, method="POST")

        async def one(target: str) -> Any:
            return await call(
                target, path=path, body=body, idempotent=idempotent, timeout_s=timeout_s
            )

        return await self.each(url, one)

    async def targets(self, url: str | None) -> list[str]:
        """One engine, a router's workers, or the engines in rotation (all of them when
        none is: then the call's own failure says why)."""
        if url is not None:
            return [url.rstrip("/")]
        if self.router:
            return [str(w["url"]).rstrip("/") for w in await self.list_workers()]
        return self.in_rotation() or self.urls

    # ------------------------------------------------------------------ engine choice

    def mark_down(self, engine: EngineState, reason: object) -> None:
        if engine.down_until is None:
            log.warning("engine out of rotation", url=engine.url, reason=str(reason))
        engine.down_until = time.monotonic() + self.config.recheck_s

    @property
    def _health_path(self) -> str:
        return "/health" if self.config.health_check_s is None else "/health_generate"

    async def _check(self, engine: EngineState) -> tuple[bool, object]:
        """One health request; ``(healthy, why not)``."""
        timeout = _timeout(self.config.control_timeout_s, self.config.control_timeout_s)
        path = self._health_path
        try:
            async with self._session.get(engine.url + path, timeout=timeout) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return False, exc
        return resp.status == 200, f"{path} answered {resp.status}"

    async def _probe(self, engine: EngineState) -> bool:
        """The health probe once; a pass puts the engine (back) in rotation, after
        ``on_return`` when it was out. Concurrent callers share one probe per engine:
        with every engine out, a probe per waiting request would flood the engines and
        keep them out."""
        probe = engine.probing
        if probe is None:
            probe = engine.probing = asyncio.create_task(
                self._probe_once(engine), name=f"probe {engine.url}"
            )
            probe.add_done_callback(lambda done: _forget_probe(engine, done))
        return await asyncio.shield(probe)

    async def _probe_once(self, engine: EngineState) -> bool:
        healthy, reason = await self._check(engine)
        if healthy and engine.down_until is not None:
            healthy, reason = await self._catch_up(engine)
            if healthy:
                log.info("engine back in rotation", url=engine.url)
        if healthy:
            engine.down_until = None
        else:
            self.mark_down(engine, reason)
        return healthy

    async def _catch_up(self, engine: EngineState) -> tuple[bool, object]:
        """``on_return`` for an engine about to rejoin the rotation (one at a time)."""
        if self.on_return is None:
            return True, None
        if engine.returning:
            return False, "being brought up to date"
        engine.returning = True
        try:
            await self.on_return(engine.url)
        except Exception as exc:  # any failure keeps it out; the next probe tries again
            return False, f"bringing it up to date failed: {type(exc).__name__}: {exc}"
        finally:
            engine.returning = False
        return True, None

    async def _health_loop(self) -> None:
        """Every ``health_check_s``: check the engines in rotation, probe those out."""
        interval = self.config.health_check_s or 0.0
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(self._health_one(e) for e in self._engines))

    async def _health_one(self, engine: EngineState) -> None:
        try:
            if engine.down_until is not None:
                await self._probe(engine)
                return
            healthy, reason = await self._check(engine)
            if healthy and self.expected_version is not None:
                served = await self.engine_weight_version(engine.url)
                if served < self.expected_version:
                    healthy = False
                    reason = f"serves version {served}, not {self.expected_version} (restarted?)"
            if not healthy and engine.down_until is None:
                self.mark_down(engine, reason)
        except Exception:  # a check must not end the loop, whatever went wrong
            log.exception("engine health check failed", url=engine.url)

    async def engine_weight_version(self, url: str) -> int:
        info = await self.get_first(url, ("/get_weight_version", "/model_info", "/get_model_info"))
        return parse_weight_version(info.get("weight_version")) or 0

    async def _fetch_load(self, engine: EngineState) -> None:
        timeout = _timeout(self.config.control_timeout_s, self.config.control_timeout_s)
        try:
            async with self._session.get(engine.url + engine.loads_path, timeout=timeout) as r:
                payload = await self.read(r)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.mark_down(engine, exc)
            return
        if r.status == 404 and engine.loads_path != "/get_load":
            engine.loads_path = "/get_load"  # servers before 0.5.10
            return await self._fetch_load(engine)
        if r.status == 200:
            engine.reported, engine.inflight_at_report = load_count(payload), engine.inflight
            engine.reported_at = time.monotonic()

    async def refresh_loads(self) -> None:
        """Fetch every in-rotation engine's load and probe the out-of-rotation ones now due."""
        now = time.monotonic()
        jobs = [
            self._fetch_load(e) if e.down_until is None else self._probe(e)
            for e in self._engines
            if e.down_until is None or e.down_until <= now
        ]
        await asyncio.gather(*jobs)

    def _refresh_due(self) -> bool:
        now = time.monotonic()
        stale = now - self.config.load_refresh_s
        return any(
            (e.down_until is None and e.reported_at < stale and len(self._engines) > 1)
            or (e.down_until is not None and e.down_until <= now)
            for e in self._engines
        )

    def _maybe_refresh(self) -> None:
        busy = self._refresh_task is not None and not self._refresh_task.done()
        if not busy and self._refresh_due():
            self._refresh_task = asyncio.create_task(self._refresh_quietly(), name="sglang-loads")

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh_loads()
        except Exception:  # a refresh failure must not surface in an unrelated request
            log.exception("load refresh failed")

    async def _pick(self, prefer: str | None) -> EngineState:
        """The engine for one request (policy: ``docs/client.md``)."""
        candidates = [e for e in self._engines if e.down_until is None]
        if not candidates:
            await asyncio.gather(*(self._probe(e) for e in self._engines))
            candidates = [e for e in self._engines if e.down_until is None]
        if not candidates:
            raise EngineUnavailable(0, f"all {len(self._engines)} engines are out of rotation")
        self._maybe_refresh()
        for engine in candidates:
            if prefer is not None and engine.url == prefer.rstrip("/"):
                return engine
        start = self._cursor % len(candidates)
        self._cursor += 1
        return min(candidates[start:] + candidates[:start], key=EngineState.score)

    # ------------------------------------------------------------------ generation

    async def retry_generate(
        self, prefer: str | None, attempt: Callable[[EngineState, bool], Awaitable[_T | None]]
    ) -> tuple[EngineState, _T]:
        """Pick an engine and make one ``attempt(engine, last)`` on it until one answers
        (None: retry), up to ``retries`` more times with doubling backoff; the pick itself
        is retried too while every engine is out of rotation."""
        cfg, delay = self.config, self.config.backoff_s
        for n in range(cfg.retries + 1):
            last = n == cfg.retries
            try:
                engine = await self._pick(prefer)
            except EngineUnavailable:
                if last:
                    raise
            else:
                if (answer := await attempt(engine, last)) is not None:
                    return engine, answer
            await asyncio.sleep(delay)
            delay = min(2 * delay, cfg.max_backoff_s)
        raise AssertionError("unreachable")

    async def open_generate(
        self, fields: dict[str, Any], rid: str, prefer: str | None
    ) -> tuple[EngineState, aiohttp.ClientResponse]:
        """POST ``/generate`` until an engine answers 200; the caller releases ``inflight``."""
        body = msgspec.json.encode(fields)
        return await self.retry_generate(
            prefer, lambda engine, last: self.post_generate(engine, body, rid, last)
        )

    async def post_generate(
        self, engine: EngineState, body: bytes, rid: str, last: bool
    ) -> aiohttp.ClientResponse | None:
        """One attempt: the 200 response, None to retry, or an exception."""
        timeout = _timeout(self.config.generate_timeout_s, self.config.control_timeout_s)
        engine.inflight += 1
        self._rids[rid] = engine
        try:
            resp = await self._generate_session.post(
                engine.url + "/generate", data=body, headers=_JSON, timeout=timeout
            )
        except aiohttp.ClientConnectorError as exc:  # nothing was sent: safe to retry anywhere
            self.release(engine, rid)
            self.mark_down(engine, exc)
            if last:
                raise EngineUnavailable(0, str(exc), url=engine.url) from exc
            return None
        except BaseException as exc:
            self.release(engine, rid)
            if isinstance(exc, aiohttp.ClientError):  # sent, maybe running: never retried
                self.mark_down(engine, exc)
                raise EngineUnavailable(0, f"/generate: {exc}", url=engine.url) from exc
            raise
        if resp.status == 200:
            return resp
        async with resp:
            payload = await self.read(resp)
        self.release(engine, rid)
        if last or not router_refused(resp.status, payload):
            raise SGLangError(resp.status, error_message(payload), payload, url=engine.url)
        return None

    def in_flight(self) -> list[str]:
        """The rids of this client's ``/generate`` calls still open."""
        return list(self._rids)

    def engine_of(self, rid: str) -> str | None:
        """The URL of the engine running this client's ``/generate`` ``rid``, if open."""
        engine = self._rids.get(rid)
        return None if engine is None else engine.url

    def release(self, engine: EngineState, rid: str) -> None:
        engine.inflight -= 1
        if self._rids.get(rid) is engine:
            del self._rids[rid]

    async def health(self) -> dict[str, bool]:
        """The health probe (``GET /health``; ``/health_generate`` with ``health_check_s``)
        on every base URL; failures leave the rotation, passes rejoin it.

        SGLang's probe is a 1-token generation that blocks while the engine is paused
        (section 2.11), so a paused engine may read as unhealthy: check before pausing.
        """
        results = await asyncio.gather(*(self._probe(e) for e in self._engines))
        return dict(zip(self.urls, results, strict=True))

    async def get_first(self, url: str, paths: Sequence[str]) -> Any:
        """GET the first path that is not 404 (renamed endpoints across versions)."""
        for path in paths[:-1]:
            try:
                return await self.call(url, "GET", path, idempotent=True)
            except SGLangError as exc:
                if exc.status not in (404, 405):
                    raise
        return await self.call(url, "GET", paths[-1], idempotent=True)

    # ------------------------------------------------------------------ router workers

    def router_url(self) -> str:
        if not self.router:
            raise ValueError("worker management needs SGLangClient(url, router=True)")
        return self._engines[0].url

    async def list_workers(self) -> list[dict[str, Any]]:
        """The router's workers (``GET /workers``; legacy ``/list_workers`` gives urls only)."""
        router = self.router_url()
        try:
            reply = await self.call(router, "GET", "/workers", idempotent=True)
            return list(reply.get("workers", []))
        except SGLangError as exc:
            if exc.status != 404:
                raise
        reply = await self.call(router, "GET", "/list_workers", idempotent=True)
        return [{"url": u} for u in reply.get("urls", [])]
