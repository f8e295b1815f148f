"""The SGLang-compatible HTTP server over an engine (``asyncrl serve``).

SGLang's clients (rollout code, slime, AReaL, sglang-router) talk to it as to an SGLang
server (``docs/sglang_api.md`` sections 1 to 3 and 7). One ``EngineServer`` owns one
engine and its aiohttp application; this module holds the application, its lifetime, the
traffic gate and ``/generate``::

    HTTP /generate, /v1/*  -> parse + validate (400 before anything starts)
                           -> traffic gate (pause, weight-update lock)
                           -> engine.generate() per item -> JSON, or SSE chunks
    HTTP control routes    -> engine.abort / pause / resume / update_weights_* / load
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from asyncrl.engines.base import GenerateOutput, GenerateRequest, InferenceEngine, SamplingParams
from asyncrl.engines.server.control_routes import ControlRoutes
from asyncrl.engines.server.generate_wire import (
    DONE,
    ApiError,
    GenerateJob,
    Json,
    answer,
    bad_request,
    decode_json,
    decode_output,
    failed_status,
    json_response,
    meta_info,
    openai_error,
    parse_generate,
    read_body,
    sse,
    stream_error,
    version_text,
)
from asyncrl.engines.server.openai_routes import OpenAIRoutes
from asyncrl.engines.server.token_routes import TokenRoutes
from asyncrl.observe.logs import get_logger

log = get_logger("asyncrl.server")
T = TypeVar("T")

HEALTH_TIMEOUT_S = 20.0
#: Request bodies over this many bytes are decoded and tokenized on a worker thread, so
#: that ``/health`` and the other calls keep being answered meanwhile.
INLINE_BODY_BYTES = 1 << 16
#: ``asyncrl serve --max-body-mb``'s default: the generation routes' body limit.
MAX_BODY_BYTES = 8 << 20


def _is_openai(request: web.Request) -> bool:
    return request.path in ("/v1/chat/completions", "/v1/completions")


class ServerClosed(Exception):
    """The server is stopped or shutting down: a call is refused (503 over HTTP; raised
    to an in-process caller, ``server/in_process.py``)."""


class ServerGone(Exception):
    """The engine stopped with an in-process call still open (over HTTP the caller sees
    its connection close); the call was accepted, so it is not made again."""


def error_reply(exc: Exception, path: str, *, openai: bool = False) -> tuple[int, Json]:
    """SGLang's status and body for a refusal (``ApiError``, ``ValueError``) or a bug (500)."""
    if isinstance(exc, ApiError):
        return exc.status, openai_error(exc.message, exc.status) if openai else exc.body
    if isinstance(exc, ServerClosed):  # the traffic gate of a closing server
        message = str(exc)
        return 503, openai_error(message, 503) if openai else {"error": {"message": message}}
    if isinstance(exc, ValueError):  # EngineError, SamplingParams.verify: the request's fault
        return 400, openai_error(str(exc)) if openai else {"error": {"message": str(exc)}}
    log.exception("request failed", path=path)  # a bug: the cause instead of a bare page
    message = f"{type(exc).__name__}: {exc}"
    return 500, openai_error(message, 500, "InternalServerError")


@web.middleware
async def _errors(request: web.Request, handler: Callable[..., Awaitable[Any]]) -> Any:
    """Turn refusals into SGLang's error bodies; the server keeps serving after any of them."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as exc:
        status, body = error_reply(exc, request.path, openai=_is_openai(request))
        return json_response(body, status=status)


#: Routes open without the API key: the liveness probe of load balancers and routers.
OPEN_ROUTES = frozenset({"/health"})


def _key_check(api_key: str) -> Callable[..., Awaitable[Any]]:
    """Middleware: every route but ``OPEN_ROUTES`` needs ``Authorization: Bearer <key>``
    (SGLang's ``--api-key``); a request without it gets 401, not the engine's attention."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Callable[..., Awaitable[Any]]) -> Any:
        given = request.headers.get("Authorization", "").encode()
        if request.path in OPEN_ROUTES or hmac.compare_digest(given, expected):
            return await handler(request)
        message = "missing or wrong API key (send Authorization: Bearer <key>)"
        body = (
            openai_error(message, 401, "AuthenticationError")
            if request.path.startswith("/v1/")
            else {"error": {"message": message}}
        )
        return json_response(body, status=401)

    return check


# ----------------------------------------------------------------------------- traffic gate


class TrafficGate:
    """Who may start generating: the pause gate and SGLang's model-update lock.

    SGLang's two guarantees: ``pause_generation`` (abort mode) returns only after every
    admitted ``/generate`` call has been answered, and new calls wait until
    ``continue_generation``; a weight update outside a pause (``updating``) closes the gate
    to new calls and waits for those in flight. ``calls`` counts the calls past the gate
    until their answer is written, so ``drained()`` is "every admitted call answered".
    """

    def __init__(self) -> None:
        self.open = asyncio.Event()  # cleared between pause and continue
        self.no_update = asyncio.Event()  # cleared while an update holds the lock
        self.idle = asyncio.Event()
        for event in (self.open, self.no_update, self.idle):
            event.set()
        self.calls = 0
        self.closed = False  # the server is shutting down: refuse, do not hold
        self._update_lock = asyncio.Lock()

    @property
    def paused(self) -> bool:
        """Between ``pause_generation`` and ``continue_generation``."""
        return not self.open.is_set()

    @contextlib.asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        """Hold one call's place; returns without yielding when the gate is open, so the
        caller's engine admission happens in the same step (``pause`` relies on it)."""
        while not (self.open.is_set() and self.no_update.is_set()) and not self.closed:
            await (self.no_update if self.open.is_set() else self.open).wait()
        if self.closed:
            raise ServerClosed("the engine server is shutting down")
        self.calls += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.calls -= 1
            if not self.calls:
                self.idle.set()

    def close(self) -> None:
        """Refuse every call from now on, those held by a pause or an update included."""
        self.closed = True
        self.open.set()
        self.no_update.set()

    async def drained(self) -> None:
        """Wait until no call is past the gate."""
        while self.calls:
            await self.idle.wait()

    @contextlib.asynccontextmanager
    async def updating(self) -> AsyncIterator[None]:
        """Exclusive against generation unless paused (then the update runs at once)."""
        if self.paused:
            yield
            return
        async with self._update_lock:
            self.no_update.clear()
            try:
                await self.drained()
                yield
            finally:
                self.no_update.set()


# ----------------------------------------------------------------------------- the server


class EngineServer:
    """SGLang's HTTP API over one engine; ``app`` for aiohttp, ``start``/``stop`` for tests."""

    def __init__(
        self,
        engine: InferenceEngine,
        *,
        served_model_name: str | None = None,
        server_args: Json | None = None,
        api_key: str | None = None,
        tool_call_parser: Any = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.engine = engine
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes  # generation bodies; weight updates may be more
        # SGLang's --tool-call-parser: finds a chat reply's tool calls (rollout's parsers
        # fit: parse(text) and content(text)); None: tools are only rendered.
        self.tool_call_parser = tool_call_parser
        self.served_model_name = served_model_name or engine.model_path
        self.server_args = server_args or {}
        self.gate = TrafficGate()
        self.ready = False
        self.url = ""
        self._engine_task: asyncio.Task[None] | None = None
        # Open in-process /generate calls: their task -> ended by the engine's end.
        self._local_calls: dict[asyncio.Task[Any], bool] = {}
        self._warmup: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.started = time.time()  # reported by /server_info and /v1/models
        self.app = self._build_app()

    def _build_app(self) -> web.Application:
        checks = [_key_check(self.api_key)] if self.api_key else []
        app = web.Application(middlewares=[*checks, _errors], client_max_size=1 << 28)
        app.cleanup_ctx.append(self._engine_lifetime)
        app.on_shutdown.append(self._on_shutdown)
        for method in ("POST", "PUT"):
            app.router.add_route(method, "/generate", self.generate)
        ControlRoutes(self).register(app.router)
        OpenAIRoutes(self).register(app.router)
        TokenRoutes(self).register(app.router)
        return app

    # -- lifecycle ------------------------------------------------------------------------
    async def _engine_lifetime(self, app: web.Application) -> AsyncIterator[None]:
        self.gate.closed = False  # a server started again serves again
        self._engine_task = asyncio.create_task(self.engine.run(), name="engine-run")
        self._engine_task.add_done_callback(self._engine_ended)
        self._warmup = asyncio.create_task(self._warm_up(), name="engine-warmup")
        yield
        self.ready = False
        self._warmup.cancel()
        self._engine_task.cancel()
        await asyncio.gather(self._warmup, self._engine_task, return_exceptions=True)

    async def _warm_up(self) -> None:
        """One real 1-token generation before ``/health`` says 200 (SGLang's warm-up)."""
        await self.probe(timeout_s=300.0)
        self.ready = True
        log.info("engine ready", model=self.engine.model_path, version=self.engine.version)

    async def _on_shutdown(self, app: web.Application) -> None:
        # Answer every open call with its partial output so the shutdown does not wait,
        # and refuse the calls still to come (in-process callers have no port to close).
        self.ready = False
        self.gate.close()
        self.engine.abort(abort_all=True)

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, *, wait_ready: bool = True
    ) -> str:
        """Listen on ``host:port`` (0: a free port); returns the URL, by default once the
        warm-up generation is done (``/health`` answers 503 until then)."""
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        port = self._runner.addresses[0][1]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self.server_args |= {"host": host, "port": port}
        if wait_ready:
            assert self._warmup is not None
            await self._warmup
        return self.url

    async def stop(self) -> None:
        """Stop listening, answer open calls, stop the engine loop."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def alive(self) -> bool:
        """Warmed up and the engine loop still running."""
        task = self._engine_task
        return self.ready and task is not None and not task.done()

    # -- generation core ------------------------------------------------------------------
    async def outputs(
        self, requests: list[GenerateRequest]
    ) -> AsyncIterator[tuple[int, GenerateOutput]]:
        """Every item's cumulative outputs as ``(k, output)``, merged in arrival order.

        Items run as tasks; closing this iterator cancels them, which aborts their engine
        requests (a client that went away).
        """
        if len(requests) == 1:
            async with contextlib.aclosing(self.engine.generate(requests[0])) as outs:
                async for out in outs:
                    yield 0, out
            return
        queue: asyncio.Queue[tuple[int, GenerateOutput | BaseException | None]] = asyncio.Queue()

        async def pump(k: int, request: GenerateRequest) -> None:
            try:
                async for out in self.engine.generate(request):
                    queue.put_nowait((k, out))
            except Exception as exc:  # handed to the consumer, which raises it
                queue.put_nowait((k, exc))
            queue.put_nowait((k, None))

        tasks = [
            asyncio.create_task(pump(k, r), name=f"generate-{r.rid}")
            for k, r in enumerate(requests)
        ]
        try:
            remaining = len(tasks)
            while remaining:
                k, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield k, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """The final output of every item (non-stream calls)."""
        finals: list[GenerateOutput | None] = [None] * len(requests)
        async with contextlib.aclosing(self.outputs(requests)) as outs:
            async for k, out in outs:
                if out.finish_reason is not None:
                    finals[k] = out
        assert all(f is not None for f in finals), "an engine stream ended without a final"
        return finals  # type: ignore[return-value]

    async def stream(
        self,
        request: web.Request,
        requests: list[GenerateRequest],
        render: Callable[[int, GenerateOutput], list[Any]],
        *,
        error: Callable[[Exception], Any],
        tail: Callable[[], list[Any]] = list,
    ) -> web.StreamResponse:
        """SSE: ``render(k, out)`` events per output, then ``tail()``, then ``[DONE]``.

        Headers go out with the first event, so a refusal at admission is still a plain
        400; a refusal after that is one ``error(exc)`` event (1.6).
        """
        resp: web.StreamResponse | None = None
        try:
            try:
                async with contextlib.aclosing(self.outputs(requests)) as outs:
                    async for k, out in outs:
                        events = render(k, out)
                        resp = resp or await _open_sse(request)
                        for event in events:
                            await resp.write(sse(event))
            except ValueError as exc:
                if resp is None:
                    raise
                await resp.write(sse(error(exc)))
            resp = resp or await _open_sse(request)
            for event in tail():
                await resp.write(sse(event))
            await resp.write(DONE)
            await resp.write_eof()
        except ConnectionResetError:  # the client left; its requests were aborted above
            log.info("stream client went away", path=request.path)
        return resp or web.StreamResponse()

    async def probe(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        """A 1-token greedy generation (rid ``HEALTH_CHECK_*``), as SGLang's health probe."""
        request = GenerateRequest(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            input_ids=[0],
            sampling=SamplingParams(max_new_tokens=1, temperature=0),
        )
        async with (
            asyncio.timeout(timeout_s),
            contextlib.aclosing(self.engine.generate(request)) as outs,
        ):
            async for _ in outs:
                pass

    # -- /generate --------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``POST|PUT /generate`` (section 1). A streamed request that SGLang's tokenizer
        manager would refuse (a prompt past the context, a duplicate rid, bad values) gets
        a 200 stream of one error event, as SGLang's; a body its JSON contract or FastAPI
        refuses is a 400 either way."""
        body, big = await self.read(request)
        try:
            job = await self.off_loop(big, lambda: self._parse(body))
            self._check(job)
        except (ApiError, ValueError) as exc:
            if body.get("stream") is not True or not _refused_in_stream(exc):
                raise
            event = stream_error(exc)
            return await self.stream(
                request, [], lambda k, out: [], error=stream_error, tail=lambda: [event]
            )
        async with self.gate.generating():
            if job.stream:
                render = self._renderer(job)
                return await self.stream(request, job.requests, render, error=stream_error)
            resp = json_response(await self._reply(job))
            return await answer(request, resp)

    async def generate_local(self, body: Json) -> tuple[int, Json]:
        """``/generate`` for a client in this process: ``(status, body)`` as over HTTP.

        The same parsing, refusals, traffic gate and reply, without the loopback HTTP
        round trip, which costs CPU on both ends. Non-stream bodies only; the client
        streams over HTTP. A stopped (or shutting down) server raises ``ServerClosed``; an
        engine that stops with the call open raises ``ServerGone``. Its caller is
        ``in_process.InProcessGenerator``.
        """
        if self.gate.closed or self._engine_task is None or self._engine_task.done():
            raise ServerClosed(f"{self.url or 'engine server'}: not running")
        try:
            job = self._admit(body)
            if job.stream:
                raise bad_request("in-process /generate does not stream: use HTTP")
            async with self.gate.generating():
                return 200, await self._while_engine_runs(self._reply(job))
        except (ServerClosed, ServerGone):  # not the request's fault: no error reply
            raise
        except Exception as exc:
            return error_reply(exc, "/generate")

    async def _while_engine_runs(self, reply: Awaitable[Json]) -> Json:
        """``reply``'s result, or ``ServerGone`` if the engine task ends first.

        Over HTTP, aiohttp cancels the handlers still open at shutdown and the caller sees
        its connection close; an in-process caller has no connection, so without this a
        call the engine never answers (one waiting at an engine-level pause, say) would
        wait for its timeout. ``reply`` runs in the caller's task, so its engine
        admission stays in the step the gate let it in (``pause`` relies on it); the
        engine task's end cancels the open calls (``_engine_ended``)."""
        me = asyncio.current_task()
        assert me is not None
        self._local_calls[me] = False
        try:
            return await reply
        except asyncio.CancelledError:
            if self._local_calls[me] and me.uncancel() == 0:
                why = f"{self.url or 'engine server'}: the engine stopped mid-call"
                raise ServerGone(why) from None
            raise
        finally:
            del self._local_calls[me]

    def _engine_ended(self, task: asyncio.Task[None]) -> None:
        """The engine task ended (stopped or failed): nothing can answer now. Refuse calls
        held at the gate, and end the open in-process calls (``_while_engine_runs``)."""
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("engine task failed", error=f"{type(exc).__name__}: {exc}")
        self.ready = False
        self.gate.close()
        for call, gone in self._local_calls.items():
            if not gone:
                self._local_calls[call] = True
                call.cancel()

    def _admit(self, body: Json) -> GenerateJob:
        """Parse a body and refuse it (``ApiError``, ``ValueError``) before anything starts."""
        return self._check(self._parse(body))

    def _parse(self, body: Json) -> GenerateJob:
        """``/generate``'s body as engine requests (thread-safe: ``off_loop`` runs it)."""
        return parse_generate(body, self.engine.tokenizer, self.context_length)

    def _check(self, job: GenerateJob) -> GenerateJob:
        for item in job.requests:
            self.engine.check(item)
        return job

    @property
    def context_length(self) -> int | None:
        """The engine's context in tokens, when it says (a text that cannot fit it is
        refused before it is tokenized)."""
        return getattr(self.engine, "context_length", None) or None

    async def read(self, request: web.Request) -> tuple[Json, bool]:
        """A generation route's JSON body (413 past ``max_body_bytes``, before it is all
        read), and whether it is big enough to be parsed off the event loop."""
        raw = await read_body(request, self.max_body_bytes)
        big = len(raw) > INLINE_BODY_BYTES
        return (await asyncio.to_thread(decode_json, raw) if big else decode_json(raw)), big

    async def off_loop(self, big: bool, parse: Callable[[], T]) -> T:
        """``parse()`` (tokenizing, a chat template), on a worker thread when ``big``."""
        return await asyncio.to_thread(parse) if big else parse()

    async def _reply(self, job: GenerateJob) -> Json:
        """A non-stream job's reply: one payload, or a list for a batch."""
        finals = await self.collect(job.requests)
        if (failure := failed_status(finals)) is not None:
            raise failure
        payloads = [self._payload(job, k, out) for k, out in enumerate(finals)]
        return payloads[0] if job.single else payloads

    def _renderer(self, job: GenerateJob) -> Callable[[int, GenerateOutput], list[Json]]:
        """``/generate`` SSE events: item ``k``'s first and final outputs, and one whenever
        ``stream_interval`` (default 1) tokens were added since its last event, as SGLang
        does (tokens 1, 1 + i, 1 + 2i, ...). A weight swap wakes callers with no new token;
        that gives no event."""
        sent = [-1] * len(job.requests)

        def render(k: int, out: GenerateOutput) -> list[Json]:
            every = job.requests[k].sampling.stream_interval or 1
            fresh = len(out.output_ids) - sent[k]
            if out.finish_reason is None and sent[k] >= 0 and fresh < every:
                return []
            sent[k] = len(out.output_ids)
            return [self._payload(job, k, out)]

        return render

    def _payload(self, job: GenerateJob, k: int, out: GenerateOutput) -> Json:
        request, tokenizer = job.requests[k], self.engine.tokenizer
        payload: Json = {
            "text": decode_output(tokenizer, request, out),
            "output_ids": out.output_ids,
            "meta_info": meta_info(
                request,
                out,
                version_text(self.engine),
                text_in_logprobs=job.text_in_logprobs,
                tokenizer=tokenizer,
                names=self.engine.version_names,
            ),
        }
        if job.return_prompt_token_ids:
            payload["prompt_token_ids"] = request.input_ids
        if job.stream and not job.single:
            payload["index"] = k
        return payload


async def serve_until_signalled(server: EngineServer, host: str, port: int) -> None:
    """``asyncrl serve``: listen, print the URL once warmed up, stop on SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    url = await server.start(host, port)
    print(f"asyncrl serve: ready on {url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


# ----------------------------------------------------------------------------- helpers


async def _open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Cache-Control": "no-cache"})
    resp.content_type = "text/event-stream"
    await resp.prepare(request)
    return resp


def _refused_in_stream(exc: Exception) -> bool:
    """Whether SGLang refuses ``exc`` inside the stream: a ``ValueError`` of its tokenizer
    manager (``bad_request``'s shape, an engine check), not its JSON contract's or
    FastAPI's (a 400 before any stream)."""
    if isinstance(exc, ApiError):
        return isinstance(exc.body, dict) and isinstance(exc.body.get("error"), dict)
    return True
