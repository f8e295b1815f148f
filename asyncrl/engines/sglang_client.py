"""The async SGLang client: how rollout actors and the trainer talk to every inference engine.

One ``SGLangClient`` speaks SGLang's HTTP API (``reference/sglang_api.md``) to N engines: the
embedded server (``asyncrl serve``), real SGLang servers, or one real sglang-router.
Rollout actors call ``generate`` / ``generate_stream``; the trainer calls ``update_weights``
(section 2.15: pause, flush, update, continue); APRIL calls ``abort_all_and_wait``.

Transport. One aiohttp ``ClientSession`` (one connection pool, no proxies from the
environment) per client. Every POST carries a JSON body, ``{}`` when it has nothing to say,
because SGLang 0.5.23 refuses body-less control POSTs. Timeouts: ``generate_timeout_s``
(default 4 h, slime's router timeout) for ``/generate``; ``update_timeout_s`` for calls that
wait on a drain or a collective (pause, weight updates, group init); ``control_timeout_s``
for everything else. Timeouts are never retried.

What is retried, up to ``Config.retries`` times with doubling backoff, and nothing else:

- a failed TCP connect (``ClientConnectorError``: refused, unreachable), on every call,
  ``/generate`` included: the request never left this process, so a retry cannot run
  anything twice. A ``/generate`` retry goes to another engine when there is one;
- HTTP 503, or a connection dropped before the response, on idempotent calls only: GETs,
  ``pause_generation``, ``continue_generation``, ``abort_request``,
  ``update_weights_from_disk`` (loading one checkpoint twice gives the same weights);
- a ``/generate`` answered 503 with code ``no_available_workers``: a router refusing
  before it forwarded anything (section 4.2).

Never retried: any 4xx (``flush_cache``'s "busy" 400 is polled by ``flush_cache`` itself,
which is the protocol, not a transport retry); a ``/generate`` the server accepted (a
dropped connection mid-generation raises ``EngineUnavailable``, and the engine leaves the
rotation); group init, distributed updates, begin/end, memory release/resume and router
worker changes, which are not idempotent.

Choosing an engine (several base URLs). Each request goes to the engine in rotation with
the lowest score ``own in-flight + others``, where ``others`` is what the engine's last
``/v1/loads`` (fallback ``/get_load``) reported beyond this client's in-flight count at
that moment: the load other clients put on it. Ties rotate round-robin. Loads are
refreshed in one background task, at most every ``load_refresh_s``, only when there are
engines to choose between, so the request path never waits on it. ``prefer=`` pins a
request to an engine while it is in rotation (resume a partial rollout where its KV cache
is). An engine whose connect fails, or whose ``/health`` fails, leaves the rotation and is
probed with ``GET /health`` every ``recheck_s`` until it answers 200.

With ``router=True`` the one URL is a sglang-router: generation goes through it, and
control calls go to each worker URL from ``GET /workers``, because the router does not fan
them out (section 4.2).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from asyncrl.engines.base import FinishReason, PauseMode, SamplingParams
from asyncrl.observe.logs import get_logger

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

log = get_logger("asyncrl.sglang_client")

DEFAULT_GROUP = "weight_update_group"
_JSON = {"Content-Type": "application/json"}
#: Servers from this version refuse distributed/tensor updates outside begin/end (2.5).
_SESSION_VERSION = (0, 5, 21)
#: ``finish_reason.message`` prefixes of a request aborted before it started (5.1).
_QUEUED_ABORTS = ("Abort in waiting queue", "Abort before prefill")
_CONSTRAINED = dict.fromkeys(("json_schema", "regex", "ebnf", "structural_tag"))


class SGLangError(Exception):
    """An engine answered with an error; ``message`` is the server's own text.

    ``status`` is the HTTP status, the ``code`` of an error chunk inside a stream, or 0
    when no HTTP status applies (a connection failure, a malformed stream).
    """

    def __init__(self, status: int, message: str, body: Any = None, *, url: str = "") -> None:
        super().__init__(f"HTTP {status} from {url or 'engine'}: {message}")
        self.status, self.message, self.body, self.url = status, message, body, url


class EngineUnavailable(SGLangError):
    """No engine could be reached (connect failed after retries, or a connection dropped)."""


class GenerateResult(msgspec.Struct, kw_only=True):
    """One ``/generate`` output; ``logprobs[i]`` and ``versions[i]`` belong to ``output_ids[i]``.

    ``logprobs`` is None when the server sent no log-probs for the tokens it returned.
    ``versions`` come from ``meta_info.weight_versions`` spans when present, else every
    token carries ``weight_version`` (a stream stamps each token with the version of the
    chunk that brought it). ``queued`` marks an abort before the request started.
    ``prompt_tokens`` and ``cached_tokens`` are None on abort shapes that omit them.
    """

    rid: str
    output_ids: list[int]
    logprobs: list[float] | None
    versions: list[int]
    finish_reason: FinishReason | None = None
    weight_version: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int = 0
    text: str = ""
    queued: bool = False
    engine: str = ""
    meta_info: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def finished(self) -> bool:
        """True on the final output (it carries a finish reason)."""
        return self.finish_reason is not None

    @property
    def aborted(self) -> bool:
        """True when generation was aborted (partial output; resume it APRIL-style)."""
        return self.finish_reason is not None and self.finish_reason.type == "abort"


class WeightBucket(msgspec.Struct, kw_only=True):
    """Metadata of tensors broadcast together in one ``update_weights_from_distributed``."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


# ----------------------------------------------------------------------------- parsing


def error_message(body: Any) -> str:
    """The server's message from any error shape of sections 1.7, 3.5 and 4.2."""
    if isinstance(body, str):
        return body.strip()
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, str):
            return error
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail"):  # OpenAI-style, admin replies, FastAPI 404s
            if body.get(key):
                return str(body[key])
    return "" if body is None else msgspec.json.encode(body).decode()[:500]


def parse_weight_version(value: str | int | None) -> int | None:
    """SGLang's string weight version as our int: ``"42"`` -> 42, ``"default"`` -> 0."""
    if value is None or isinstance(value, int):
        return value
    if value == "default":
        return 0
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"weight_version {value!r} is neither an int nor 'default'; asyncrl versions are "
            "optimizer steps (start the server with --weight-version <int>)"
        ) from None


def _finish_reason(raw: Any) -> FinishReason | None:
    if not isinstance(raw, dict):
        return None
    matched = raw.get("matched")
    if isinstance(matched, list):  # the contract allows an id list; keep the id that hit
        raw = {**raw, "matched": matched[-1] if matched else None}
    return msgspec.convert(raw, FinishReason)


def _tokens(payload: dict[str, Any]) -> tuple[list[int], list[float] | None]:
    """Ids and log-probs from the logprob triples, else ids from ``output_ids``."""
    meta = payload.get("meta_info") or {}
    triples = meta.get("output_token_logprobs")
    ids = payload.get("output_ids") or []
    if triples is not None and len(triples) >= len(ids):
        nan = float("nan")
        return [t[1] for t in triples], [nan if t[0] is None else float(t[0]) for t in triples]
    return list(ids), ([] if not ids else None)


def _stamp(versions: list[int], spans: Any) -> list[int]:
    """Overwrite per-token versions with ``weight_versions`` spans ``[start, end)``."""
    for span in spans or ():
        version = parse_weight_version(span.get("version"))
        start, end = max(0, int(span.get("start", 0))), min(len(versions), int(span["end"]))
        if version is not None and end > start:
            versions[start:end] = [version] * (end - start)
    return versions


def _result(
    payload: dict[str, Any],
    ids: list[int],
    logprobs: list[float] | None,
    versions: list[int],
    engine: str,
) -> GenerateResult:
    meta = payload.get("meta_info") or {}
    finish = _finish_reason(meta.get("finish_reason"))
    queued = (
        finish is not None
        and finish.type == "abort"
        and (finish.message or "").startswith(_QUEUED_ABORTS)
    )
    return GenerateResult(
        rid=str(meta.get("id", "")),
        output_ids=ids,
        logprobs=logprobs,
        versions=versions,
        finish_reason=finish,
        weight_version=parse_weight_version(meta.get("weight_version")),
        prompt_tokens=meta.get("prompt_tokens"),
        cached_tokens=meta.get("cached_tokens"),
        completion_tokens=len(ids),
        text=str(payload.get("text") or ""),
        queued=queued,
        engine=engine,
        meta_info=meta,
    )


def parse_generate_output(payload: dict[str, Any], *, engine: str = "") -> GenerateResult:
    """A non-stream ``/generate`` object (section 1.3, every abort shape of 5.1) as a result."""
    ids, logprobs = _tokens(payload)
    meta = payload.get("meta_info") or {}
    fallback = parse_weight_version(meta.get("weight_version"))
    versions = [0 if fallback is None else fallback] * len(ids)
    return _result(payload, ids, logprobs, _stamp(versions, meta.get("weight_versions")), engine)


class _StreamState:
    """Folds SSE chunks into cumulative results, whichever streaming mode the server uses.

    A chunk is cumulative when its token count equals ``meta_info.completion_tokens`` (or,
    without that key, when it extends what we hold); otherwise it is a delta (section 1.6).
    """

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.ids: list[int] = []
        self.logprobs: list[float] | None = []
        self.versions: list[int] = []

    def _cumulative(self, ids: list[int], total: Any) -> bool:
        if isinstance(total, int):
            return len(ids) == total
        return len(ids) >= len(self.ids) and ids[: len(self.ids)] == self.ids

    def _extend(self, ids: list[int], logprobs: list[float] | None, total: Any) -> None:
        self.ids = self.ids + ids
        if self.logprobs is not None and logprobs is not None:
            self.logprobs = self.logprobs + logprobs
        else:
            self.logprobs = None
        if isinstance(total, int) and len(self.ids) > total:  # a re-sent last token
            self.ids = self.ids[:total]
            self.logprobs = None if self.logprobs is None else self.logprobs[:total]

    def add(self, payload: dict[str, Any]) -> GenerateResult:
        ids, logprobs = _tokens(payload)
        meta = payload.get("meta_info") or {}
        total = meta.get("completion_tokens")
        version = parse_weight_version(meta.get("weight_version"))
        if self._cumulative(ids, total):
            self.ids, self.logprobs = ids, logprobs
        else:
            self._extend(ids, logprobs, total)
        grown = max(0, len(self.ids) - len(self.versions))
        self.versions = self.versions[: len(self.ids)] + [version or 0] * grown
        versions = _stamp(list(self.versions), meta.get("weight_versions"))
        return _result(payload, list(self.ids), self.logprobs, versions, self.engine)


def _stream_failure(chunk: dict[str, Any], url: str) -> SGLangError | None:
    """An error chunk, or an abort carrying an HTTP status (non-stream: an HTTP error)."""
    if "error" in chunk or chunk.get("object") == "error":
        error = chunk.get("error")
        code = error.get("code") if isinstance(error, dict) else chunk.get("code")
        status = code if isinstance(code, int) else 400  # stream errors are ValueErrors
        return SGLangError(status, error_message(chunk), chunk, url=url)
    finish = (chunk.get("meta_info") or {}).get("finish_reason") or {}
    status = finish.get("status_code")
    if finish.get("type") == "abort" and isinstance(status, int) and status >= 400:
        return SGLangError(status, str(finish.get("message", "")), chunk, url=url)
    return None


_DONE = object()


def _sse_line(line: bytes, url: str) -> Any:
    """One SSE line: a decoded ``data:`` payload, ``_DONE``, or None to skip."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None  # blank separators, comments, event:/id: lines
    data = line[5:].strip()
    if data == b"[DONE]":
        return _DONE
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise SGLangError(0, f"malformed stream chunk: {data[:200]!r}", url=url) from exc


async def _sse_events(content: aiohttp.StreamReader, url: str) -> AsyncIterator[Any]:
    """Decoded ``data:`` payloads; lines may arrive split across TCP reads."""
    buffer = bytearray()
    async for chunk in content.iter_any():
        buffer.extend(chunk)
        cut = buffer.rfind(b"\n")
        if cut < 0:
            continue
        lines, buffer = bytes(buffer[:cut]).split(b"\n"), buffer[cut + 1 :]
        for line in lines:
            if (event := _sse_line(line, url)) is _DONE:
                return
            if event is not None:
                yield event
    event = _sse_line(bytes(buffer), url)
    if event is not None and event is not _DONE:
        yield event


def sampling_dict(params: SamplingParams | Mapping[str, Any] | None) -> dict[str, Any]:
    """``sampling_params`` to send: the keys given (a mapping) or that differ from defaults.

    Unknown keys and out-of-range values raise ``ValueError`` before anything is sent,
    because SGLang refuses made-up sampling keys (section 1.1). ``n`` must be 1: send n
    requests with their own rids instead (one rid, one result, one abort handle).
    """
    if params is None:
        return {}
    if isinstance(params, Mapping):
        sent = dict(params)
        try:
            struct = msgspec.convert(sent, SamplingParams)
        except msgspec.ValidationError as exc:
            raise ValueError(f"sampling_params: {exc}") from exc
    else:
        struct, sent = params, _non_defaults(params)
    # Constrained decoding is the embedded server's limit, not SGLang's: check ranges only.
    msgspec.structs.replace(struct, **_CONSTRAINED).verify()
    if struct.n != 1:
        raise ValueError(f"sampling_params.n is {struct.n}; send n requests with distinct rids")
    return sent


def _non_defaults(params: SamplingParams) -> dict[str, Any]:
    out = {}
    for field in msgspec.structs.fields(params):
        default = field.default
        if default is msgspec.NODEFAULT:
            default = field.default_factory()
        if (value := getattr(params, field.name)) != default:
            out[field.encode_name] = msgspec.to_builtins(value)
    return out


def _version_tuple(text: Any) -> tuple[int, ...] | None:
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or ""))
    return None if match is None else tuple(int(g or 0) for g in match.groups())


def _load_count(load: Any) -> int:
    """Running plus waiting requests in a ``/v1/loads`` or ``/get_load`` answer (as slime)."""
    if isinstance(load, list):
        return sum(_load_count(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return _load_count(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    running, waiting = load.get("num_running_reqs", 0), load.get("num_waiting_reqs", 0)
    return (running if isinstance(running, int) else 0) + (
        waiting if isinstance(waiting, int) else 0
    )


# ----------------------------------------------------------------------------- transport


class _SentWatch:
    """Set once a request body has been handed to the socket (see ``PendingCall``)."""

    def __init__(self, size: int) -> None:
        self.remaining, self.event = size, asyncio.Event()


async def _on_chunk_sent(session: Any, ctx: Any, params: aiohttp.TraceRequestChunkSentParams):
    # aiohttp calls this just before the chunk is written, with no await in between, so a
    # waiter woken by the event runs after the write.
    watch = (ctx.trace_request_ctx or {}).get("sent")
    if isinstance(watch, _SentWatch):
        watch.remaining -= len(params.chunk)
        if watch.remaining <= 0:
            watch.event.set()


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
            replies = await _gather(self.tasks)
        finally:
            if self._after is not None:
                await self._after()
        return replies

    def __await__(self) -> Generator[Any, None, dict[str, Any]]:
        return self.wait().__await__()


async def _gather(tasks: Mapping[str, Awaitable[Any]]) -> dict[str, Any]:
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
class _Engine:
    """What the client knows about one base URL."""

    url: str
    inflight: int = 0
    reported: int = 0
    inflight_at_report: int = 0
    reported_at: float = float("-inf")
    down_until: float | None = None
    loads_path: str = "/v1/loads?include=core"

    def score(self) -> int:
        return self.inflight + max(0, self.reported - self.inflight_at_report)


def _timeout(total: float, connect: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=total, sock_connect=connect)


# ----------------------------------------------------------------------------- client


class SGLangClient:
    """Async client for SGLang-API engines; use as ``async with SGLangClient(urls) as c:``."""

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
        api_key: str | None = None
        """Sent as ``Authorization: Bearer`` when the servers run with ``--api-key``."""
        max_connections: int = 0
        """Connection-pool size; 0 is unlimited, so every in-flight generate reaches the server."""

    def __init__(
        self, urls: str | Sequence[str], *, router: bool = False, config: Config | None = None
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("SGLangClient needs at least one engine URL")
        if router and len(urls) != 1:
            raise ValueError(f"router=True takes the one router URL, got {len(urls)} URLs")
        self.config = config or SGLangClient.Config()
        self.router = router
        self._engines = [_Engine(url.rstrip("/")) for url in urls]
        self._rids: dict[str, _Engine] = {}
        self._server_versions: dict[str, tuple[int, ...] | None] = {}
        self._sessions_open: set[str] = set()
        self._legacy_loads: set[str] = set()
        self._cursor = 0
        self._refresh_task: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SGLangClient:
        trace = aiohttp.TraceConfig()
        trace.on_request_chunk_sent.append(_on_chunk_sent)
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.config.max_connections),
            headers=headers,
            trace_configs=[trace],
            trust_env=False,
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the load refresher and close the connection pool."""
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            await asyncio.gather(self._refresh_task, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

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
        if self._http is None:
            raise RuntimeError("SGLangClient is not open: use `async with SGLangClient(...)`")
        return self._http

    async def _read(self, resp: aiohttp.ClientResponse) -> Any:
        """JSON when it parses, else the text (``flush_cache``), None when empty."""
        raw = await resp.read()
        if not raw.strip():
            return None
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return raw.decode(errors="replace")

    async def _call(
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
        """One control call with the retry rules of the module docstring."""
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
                    payload = await self._read(resp)
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

    async def _admin(self, url: str, path: str, body: Any, **kwargs: Any) -> Any:
        """A ``{"success", "message"}`` call: ``success: false`` is an error even on 200."""
        reply = await self._call(url, "POST", path, body, **kwargs)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise SGLangError(400, error_message(reply), reply, url=url)
        return reply

    async def _each(self, url: str | None, fn: Callable[[str], Awaitable[Any]]) -> dict[str, Any]:
        """Run ``fn`` on one engine or on all control targets at once."""
        targets = await self._targets(url)
        return await _gather({target: fn(target) for target in targets})

    async def _post_each(
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
        call = self._admin if admin else functools.partial(self._call, method="POST")

        async def one(target: str) -> Any:
            return await call(
                target, path=path, body=body, idempotent=idempotent, timeout_s=timeout_s
            )

        return await self._each(url, one)

    async def _targets(self, url: str | None) -> list[str]:
        if url is not None:
            return [url.rstrip("/")]
        if self.router:
            return [str(w["url"]).rstrip("/") for w in await self.list_workers()]
        return self.urls

    # ------------------------------------------------------------------ engine choice

    def _mark_down(self, engine: _Engine, reason: object) -> None:
        if engine.down_until is None:
            log.warning("engine out of rotation", url=engine.url, reason=str(reason))
        engine.down_until = time.monotonic() + self.config.recheck_s

    async def _probe(self, engine: _Engine) -> bool:
        """``GET /health`` once; 200 puts the engine (back) in rotation."""
        timeout = _timeout(self.config.control_timeout_s, self.config.control_timeout_s)
        try:
            async with self._session.get(engine.url + "/health", timeout=timeout) as resp:
                await resp.read()
                healthy = resp.status == 200
        except (aiohttp.ClientError, TimeoutError) as exc:
            healthy, reason = False, exc
        else:
            reason = f"/health answered {resp.status}"
        if healthy:
            if engine.down_until is not None:
                log.info("engine back in rotation", url=engine.url)
            engine.down_until = None
        else:
            self._mark_down(engine, reason)
        return healthy

    async def _fetch_load(self, engine: _Engine) -> None:
        timeout = _timeout(self.config.control_timeout_s, self.config.control_timeout_s)
        try:
            async with self._session.get(engine.url + engine.loads_path, timeout=timeout) as r:
                payload = await self._read(r)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._mark_down(engine, exc)
            return
        if r.status == 404 and engine.loads_path != "/get_load":
            engine.loads_path = "/get_load"  # servers before 0.5.10
            return await self._fetch_load(engine)
        if r.status == 200:
            engine.reported, engine.inflight_at_report = _load_count(payload), engine.inflight
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

    async def _pick(self, prefer: str | None) -> _Engine:
        """The engine for one request (policy in the module docstring)."""
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
        return min(candidates[start:] + candidates[:start], key=_Engine.score)

    # ------------------------------------------------------------------ generation

    def _generate_body(
        self,
        input_ids: Sequence[int],
        sampling_params: Any,
        rid: str,
        return_logprob: bool,
        stream: bool,
        extra: Mapping[str, Any] | None,
    ) -> bytes:
        body = {
            **(extra or {}),
            "input_ids": list(input_ids),
            "rid": rid,
            "sampling_params": sampling_dict(sampling_params),
            "return_logprob": return_logprob,
            "stream": stream,
        }
        return msgspec.json.encode(body)

    async def _open_generate(
        self, body: bytes, rid: str, prefer: str | None
    ) -> tuple[_Engine, aiohttp.ClientResponse]:
        """POST ``/generate`` until an engine answers 200; the caller releases ``inflight``."""
        cfg, delay = self.config, self.config.backoff_s
        for attempt in range(cfg.retries + 1):
            last = attempt == cfg.retries
            try:
                engine = await self._pick(prefer)
            except EngineUnavailable:
                if last:
                    raise
            else:
                if (resp := await self._post_generate(engine, body, rid, last)) is not None:
                    return engine, resp
            await asyncio.sleep(delay)
            delay = min(2 * delay, cfg.max_backoff_s)
        raise AssertionError("unreachable")

    async def _post_generate(
        self, engine: _Engine, body: bytes, rid: str, last: bool
    ) -> aiohttp.ClientResponse | None:
        """One attempt: the 200 response, None to retry, or an exception."""
        timeout = _timeout(self.config.generate_timeout_s, self.config.control_timeout_s)
        engine.inflight += 1
        self._rids[rid] = engine
        try:
            resp = await self._session.post(
                engine.url + "/generate", data=body, headers=_JSON, timeout=timeout
            )
        except aiohttp.ClientConnectorError as exc:  # nothing was sent: safe to retry anywhere
            self._release(engine, rid)
            self._mark_down(engine, exc)
            if last:
                raise EngineUnavailable(0, str(exc), url=engine.url) from exc
            return None
        except BaseException as exc:
            self._release(engine, rid)
            if isinstance(exc, aiohttp.ClientError):  # sent, maybe running: never retried
                self._mark_down(engine, exc)
                raise EngineUnavailable(0, f"/generate: {exc}", url=engine.url) from exc
            raise
        if resp.status == 200:
            return resp
        async with resp:
            payload = await self._read(resp)
        self._release(engine, rid)
        if last or not _router_refused(resp.status, payload):
            raise SGLangError(resp.status, error_message(payload), payload, url=engine.url)
        return None

    def _release(self, engine: _Engine, rid: str) -> None:
        engine.inflight -= 1
        if self._rids.get(rid) is engine:
            del self._rids[rid]

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
        Raises ``SGLangError`` (the server's message) or ``EngineUnavailable``.
        """
        if stream:
            final = None
            chunks = self.generate_stream(
                input_ids, sampling_params, rid=rid, return_logprob=return_logprob,
                prefer=prefer, extra=extra,
            )  # fmt: skip
            async for result in chunks:
                final = result
            assert final is not None
            return final
        rid = rid or uuid.uuid4().hex
        body = self._generate_body(input_ids, sampling_params, rid, return_logprob, False, extra)
        engine, resp = await self._open_generate(body, rid, prefer)
        try:
            async with resp:
                payload = await self._read(resp)
        except aiohttp.ClientError as exc:
            self._mark_down(engine, exc)
            raise EngineUnavailable(0, f"/generate lost: {exc}", url=engine.url) from exc
        finally:
            self._release(engine, rid)
        if not isinstance(payload, dict) or "error" in payload:
            raise SGLangError(200, error_message(payload), payload, url=engine.url)
        return parse_generate_output(payload, engine=engine.url)

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
        body = self._generate_body(input_ids, sampling_params, rid, return_logprob, True, extra)
        engine, resp = await self._open_generate(body, rid, prefer)
        state, final = _StreamState(engine.url), None
        try:
            async with resp:
                async for chunk in _sse_events(resp.content, engine.url):
                    if not isinstance(chunk, dict):
                        continue
                    if (failure := _stream_failure(chunk, engine.url)) is not None:
                        raise failure
                    final = state.add(chunk)
                    yield final
        except aiohttp.ClientError as exc:
            self._mark_down(engine, exc)
            raise EngineUnavailable(0, f"/generate stream lost: {exc}", url=engine.url) from exc
        finally:
            self._release(engine, rid)
        if final is None or not final.finished:
            raise EngineUnavailable(0, "stream ended without a final chunk", url=engine.url)

    # ------------------------------------------------------------------ abort / pause

    async def abort(
        self, rid: str | None = None, *, abort_all: bool = False, url: str | None = None
    ) -> None:
        """``/abort_request``: one rid (prefix match at the server) or everything.

        A rid goes to the engine serving it when this client sent it, else to every
        engine. Returns before the aborted calls have answered (section 2.9): await them,
        or ``wait_idle``.
        """
        if (rid is None) == (not abort_all):
            raise ValueError("abort takes either rid=... or abort_all=True")
        body: dict[str, Any] = {"abort_all": True} if abort_all else {"rid": rid}
        if url is None and rid is not None and not self.router and rid in self._rids:
            url = self._rids[rid].url
        await self._post_each(url, "/abort_request", body, idempotent=True)

    async def pause(self, mode: PauseMode = "abort", *, url: str | None = None) -> None:
        """``/pause_generation``; in ``abort`` mode it returns once every call has answered.

        The default mode is sent as ``{}`` (SGLang's default), which 0.5.5 also accepts.
        """
        body = {} if mode == "abort" else {"mode": mode}
        await self._post_each(
            url, "/pause_generation", body, idempotent=True, timeout_s=self.config.update_timeout_s
        )

    async def continue_(self, *, url: str | None = None) -> None:
        """``/continue_generation``: undo ``pause``."""
        await self._post_each(url, "/continue_generation", {}, idempotent=True)

    async def _engine_load(self, url: str) -> int:
        if url not in self._legacy_loads:
            try:
                return _load_count(
                    await self._call(url, "GET", "/v1/loads?include=core", idempotent=True)
                )
            except SGLangError as exc:
                if exc.status != 404:
                    raise
            self._legacy_loads.add(url)  # servers before 0.5.10
        return _load_count(await self._call(url, "GET", "/get_load", idempotent=True))

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
            loads = await self._each(None, self._engine_load)
            own = sum(engine.inflight for engine in self._engines)
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

    async def health(self) -> dict[str, bool]:
        """``GET /health`` on every base URL; failures leave the rotation, 200s rejoin it.

        SGLang's probe is a 1-token generation that blocks while the engine is paused
        (section 2.11), so a paused engine may read as unhealthy: check before pausing.
        """
        results = await asyncio.gather(*(self._probe(e) for e in self._engines))
        return dict(zip(self.urls, results, strict=True))

    async def _get_first(self, url: str, paths: Sequence[str]) -> Any:
        """GET the first path that is not 404 (renamed endpoints across versions)."""
        for path in paths[:-1]:
            try:
                return await self._call(url, "GET", path, idempotent=True)
            except SGLangError as exc:
                if exc.status not in (404, 405):
                    raise
        return await self._call(url, "GET", paths[-1], idempotent=True)

    async def server_info(self, url: str | None = None) -> dict[str, Any]:
        """``/get_server_info`` (fallback ``/server_info``) of one engine (default: the first)."""
        target = (await self._targets(url))[0]
        return await self._get_first(target, ("/get_server_info", "/server_info"))

    async def _server_version(self, url: str) -> tuple[int, ...] | None:
        if url not in self._server_versions:
            info = await self._get_first(url, ("/get_server_info", "/server_info"))
            self._server_versions[url] = _version_tuple(info.get("version"))
        return self._server_versions[url]

    async def _engine_weight_version(self, url: str) -> int:
        info = await self._get_first(url, ("/get_weight_version", "/model_info", "/get_model_info"))
        return parse_weight_version(info.get("weight_version")) or 0

    async def weight_version(self, url: str | None = None) -> int:
        """The weight version served: one engine's, or the oldest across all engines.

        Reads ``/get_weight_version`` and falls back to ``/model_info`` (404 from 0.5.8).
        """
        versions = await self._each(url, self._engine_weight_version)
        return min(versions.values())

    # ------------------------------------------------------------------ cache and memory

    async def _flush_one(self, url: str, retries: int, interval_s: float) -> str:
        for attempt in range(retries + 1):
            try:
                return await self._call(url, "GET", "/flush_cache", idempotent=True) or ""
            except SGLangError as exc:
                if exc.status != 400 or attempt == retries:
                    raise
            await asyncio.sleep(interval_s)
        raise AssertionError("unreachable")

    async def flush_cache(
        self, retries: int = 60, *, interval_s: float = 1.0, url: str | None = None
    ) -> None:
        """``GET /flush_cache``, polled while it answers 400 (requests still running), as slime."""
        await self._each(url, lambda u: self._flush_one(u, retries, interval_s))

    async def release_memory(
        self, tags: Sequence[str] | None = None, *, url: str | None = None
    ) -> None:
        """``/release_memory_occupation`` (engines must be idle; pause or abort first)."""
        body = {} if tags is None else {"tags": list(tags)}
        await self._post_each(url, "/release_memory_occupation", body, idempotent=False)

    async def resume_memory(
        self, tags: Sequence[str] | None = None, *, url: str | None = None
    ) -> None:
        """``/resume_memory_occupation``: undo ``release_memory``."""
        body = {} if tags is None else {"tags": list(tags)}
        await self._post_each(url, "/resume_memory_occupation", body, idempotent=False)

    # ------------------------------------------------------------------ weights

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
        return await self._post_each(
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
        targets = await self._targets(None)
        infos = await _gather(
            {u: self._get_first(u, ("/get_server_info", "/server_info")) for u in targets}
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
        watches = {u: _SentWatch(len(msgspec.json.encode(bodies[u]))) for u in urls}
        tasks = {
            u: asyncio.create_task(
                self._admin(
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
        await self._post_each(
            url, "/destroy_weights_update_group", body, idempotent=False, admin=True
        )

    async def _needs_session(self, url: str) -> bool:
        version = await self._server_version(url)
        return version is not None and version >= _SESSION_VERSION

    async def begin_weight_update(self, *, url: str | None = None) -> None:
        """Open the update session servers >= 0.5.21 require; a no-op on older ones."""

        async def begin(u: str) -> None:
            if await self._needs_session(u) and u not in self._sessions_open:
                await self._admin(u, "/begin_weight_update", {"selector": "all"}, idempotent=False)
                self._sessions_open.add(u)

        await self._each(url, begin)

    async def end_weight_update(self, *, url: str | None = None) -> None:
        """Close the session ``begin_weight_update`` opened (runs post-load hooks)."""

        async def end(u: str) -> None:
            if u in self._sessions_open:
                self._sessions_open.discard(u)
                await self._admin(
                    u,
                    "/end_weight_update",
                    {},
                    idempotent=False,
                    timeout_s=self.config.update_timeout_s,
                )

        await self._each(url, end)

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
        targets = await self._targets(url)
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

    async def update_weights(
        self,
        version: int,
        *,
        path: str | None = None,
        buckets: Sequence[WeightBucket] = (),
        broadcast: Callable[[WeightBucket], Any] | None = None,
        group_name: str = DEFAULT_GROUP,
        pause_mode: PauseMode = "abort",
        flush_retries: int = 60,
    ) -> None:
        """Section 2.15 on every engine: pause, flush (retried), update, continue.

        Disk: ``path``. Distributed: ``buckets`` and ``broadcast(bucket)`` (sync or async),
        which the trainer uses to send each bucket's tensors; each bucket is announced
        first, and the version is set with the last one. The cache is flushed only in
        ``abort`` mode: ``in_place``/``retract`` keep requests, and flush refuses to run
        while they exist. On failure the engines stay paused (weights may be half
        loaded); retry the update or restart them.
        """
        if (path is None) == (broadcast is None):
            raise ValueError("update_weights takes path=... or buckets=... with broadcast=...")
        if broadcast is not None and not buckets:
            raise ValueError("update_weights got broadcast= but no buckets to announce")
        await self.pause(pause_mode)
        if pause_mode == "abort":
            await self.flush_cache(flush_retries)
        if path is not None:
            await self.update_weights_from_disk(path, version, flush_cache=False)
        else:
            await self._distributed_buckets(version, buckets, broadcast, group_name)
        await self.continue_()

    async def _distributed_buckets(
        self,
        version: int,
        buckets: Sequence[WeightBucket],
        broadcast: Callable[[WeightBucket], Any] | None,
        group_name: str,
    ) -> None:
        assert broadcast is not None
        await self.begin_weight_update()
        for index, bucket in enumerate(buckets):
            last = index == len(buckets) - 1
            pending = await self.update_weights_from_distributed(
                bucket.names,
                bucket.dtypes,
                bucket.shapes,
                group_name=group_name,
                version=version if last else None,
                flush_cache=False,
            )
            if inspect.isawaitable(sent := broadcast(bucket)):
                await sent
            await pending
        await self.end_weight_update()

    # ------------------------------------------------------------------ router workers

    def _router_url(self) -> str:
        if not self.router:
            raise ValueError("worker management needs SGLangClient(url, router=True)")
        return self._engines[0].url

    async def list_workers(self) -> list[dict[str, Any]]:
        """The router's workers (``GET /workers``; legacy ``/list_workers`` gives urls only)."""
        router = self._router_url()
        try:
            reply = await self._call(router, "GET", "/workers", idempotent=True)
            return list(reply.get("workers", []))
        except SGLangError as exc:
            if exc.status != 404:
                raise
        reply = await self._call(router, "GET", "/list_workers", idempotent=True)
        return [{"url": u} for u in reply.get("urls", [])]

    async def add_worker(
        self, url: str, *, worker_type: str = "regular", wait_s: float | None = 30.0
    ) -> str:
        """``POST /workers`` (202, registered in the background); returns the worker id.

        With ``wait_s`` it polls ``GET /workers`` until the worker is listed and healthy.
        """
        body = {"url": url.rstrip("/"), "worker_type": worker_type}
        reply = await self._call(self._router_url(), "POST", "/workers", body, idempotent=False)
        worker_id = str((reply or {}).get("worker_id", ""))
        deadline = time.monotonic() + (wait_s or 0)
        while wait_s is not None:
            listed = [w for w in await self.list_workers() if w.get("url") == body["url"]]
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
            ids = [w["id"] for w in await self.list_workers() if w.get("url") == worker.rstrip("/")]
            if not ids:
                raise ValueError(f"the router lists no worker at {worker}")
            worker = str(ids[0])
        await self._call(self._router_url(), "DELETE", f"/workers/{worker}", idempotent=False)
        deadline = time.monotonic() + (wait_s or 0)
        while wait_s is not None:
            if all(str(w.get("id")) != worker for w in await self.list_workers()):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"router still lists worker {worker} after {wait_s}s")
            await asyncio.sleep(0.1)


def _router_refused(status: int, payload: Any) -> bool:
    """A router's 503 "no_available_workers": nothing was forwarded, so a retry is safe."""
    error = payload.get("error") if isinstance(payload, dict) else None
    return status == 503 and isinstance(error, dict) and error.get("code") == "no_available_workers"
