"""The SGLang-compatible HTTP server over an embedded engine (``asyncrl serve``).

Rollout code, slime, AReaL and the real sglang-router talk to it exactly as to an SGLang
server: the shapes are ``reference/sglang_api.md`` sections 1 to 3 and checklist 7.2.
One ``EngineServer`` owns one engine (a ``TorchEngine``) and its aiohttp application::

    HTTP /generate, /v1/*  -> parse + validate (400 before anything starts)
                           -> traffic gate (pause, weight-update lock)
                           -> engine.generate() per item -> JSON, or SSE chunks
    HTTP control routes    -> engine.abort / pause / resume / update_weights_* / load

The engine's ``run()`` loop is a task for the application's life (``cleanup_ctx``); a
1-token warm-up runs first and ``/health`` answers 503 until it is done. The traffic gate
gives SGLang's two guarantees: ``pause_generation`` (abort mode) returns only after every
in-flight ``/generate`` call has been answered, and new calls wait until
``continue_generation``; a weight update outside a pause waits for in-flight calls and
holds new ones (SGLang's model-update lock).

Versions: the engine's int version is reported as a string (``"42"``); ``weight_version``
parameters arrive as strings and must be numeric. Nothing is ever unpickled, so
``update_weights_from_tensor`` is refused; use the disk or distributed paths.

Users: ``asyncrl serve`` (``cli.py``) and tests; clients reach it through
``SGLangClient`` (``sglang_client.py``), slime, AReaL or sglang-router.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import msgspec
from aiohttp import web

from asyncrl.engines.base import FinishReason, GenerateOutput, GenerateRequest, SamplingParams
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.observe.logs import get_logger

log = get_logger("asyncrl.server")

Json = dict[str, Any]
DONE = b"data: [DONE]\n\n"
QUEUED_ABORT = "Abort in waiting queue"
HEALTH_TIMEOUT_S = 20.0
_SAMPLING_KEYS: tuple[str, ...] = SamplingParams.__struct_fields__
#: Top-level /generate keys whose feature this server lacks: refused when truthy.
_UNSUPPORTED = (
    "input_embeds", "image_data", "video_data", "audio_data", "lora_path", "session_params",
    "token_ids_logprob", "return_hidden_states", "return_routed_experts",
    "custom_logit_processor",
)  # fmt: skip
_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)


# ----------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An HTTP error carrying SGLang's body for it (the error middleware sends it)."""

    def __init__(self, status: int, message: str, body: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.body = status, message, body


def invalid_body(message: str) -> ApiError:
    """A body that is not JSON or has wrong types (FastAPI's validation shape, 1.7)."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None}
    return ApiError(400, message, {**body, "code": 400})


def contract_error(message: str) -> ApiError:
    """A ``sampling_params`` the generated contract refuses: ``error`` is a string (1.7)."""
    return ApiError(400, message, {"error": message})


def bad_request(message: str) -> ApiError:
    """A ``ValueError`` in the handler: ``{"error": {"message"}}`` (1.7)."""
    return ApiError(400, message, {"error": {"message": message}})


def openai_error(message: str, status: int = 400, kind: str | None = None) -> Json:
    """The OpenAI routes' top-level error object (3.5)."""
    kind = kind or ("BadRequestError" if status == 400 else "InternalServerError")
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def _is_openai(request: web.Request) -> bool:
    return request.path in ("/v1/chat/completions", "/v1/completions")


@web.middleware
async def _errors(request: web.Request, handler: Callable[..., Awaitable[Any]]) -> Any:
    """Turn refusals into SGLang's error bodies; the server keeps serving after any of them."""
    try:
        return await handler(request)
    except ApiError as exc:
        body = openai_error(exc.message, exc.status) if _is_openai(request) else exc.body
        return json_response(body, status=exc.status)
    except ValueError as exc:  # EngineError, SamplingParams.verify: the request's fault
        body = openai_error(str(exc)) if _is_openai(request) else {"error": {"message": str(exc)}}
        return json_response(body, status=400)
    except web.HTTPException:
        raise
    except Exception as exc:  # a bug: answer 500 with the cause instead of a bare page
        log.exception("request failed", path=request.path)
        message = f"{type(exc).__name__}: {exc}"
        return json_response(openai_error(message, 500, "InternalServerError"), status=500)


# ----------------------------------------------------------------------------- bodies


def json_response(body: Any, status: int = 200) -> web.Response:
    """Compact JSON (msgspec writes NaN and infinities as null, never invalid JSON)."""
    return web.Response(
        body=msgspec.json.encode(body), status=status, content_type="application/json"
    )


def sse(obj: Any) -> bytes:
    """One server-sent event: ``data: <compact json>`` and a blank line (1.6)."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def read_json(request: web.Request) -> Json:
    """The JSON object body; an empty body is ``{}`` (SGLang clients send ``{}`` anyway)."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise invalid_body(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid_body(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def coerce(key: str, value: Any, kind: type) -> Any:
    """``value`` as ``kind``, accepting numeric strings for ints (AReaL's ``master_port``)."""
    if kind is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if kind is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if kind is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise invalid_body(f"{key}: expected {kind.__name__}, got {type(value).__name__} {value!r}")


def field(body: Json, key: str, kind: type, default: Any = None) -> Any:
    """``body[key]`` coerced to ``kind``; missing or null gives ``default``."""
    value = body.get(key)
    return default if value is None else coerce(key, value, kind)


def parse_version(value: Any) -> int | None:
    """A ``weight_version`` parameter (``"42"`` or 42) as the engine's int version."""
    if value is None:
        return None
    text = str(value).strip()
    if isinstance(value, bool) or not text.lstrip("-").isdigit():
        raise ValueError(f"weight_version must be an integer (optimizer steps), got {value!r}")
    return int(text)


def parse_sampling(raw: Any) -> SamplingParams:
    """Validate one ``sampling_params`` object as SGLang 0.5.22+ does (1.2, 1.7)."""
    if not isinstance(raw, dict):
        raise contract_error(f"invalid type: expected a map for sampling_params, got {raw!r}")
    if unknown := [key for key in raw if key not in _SAMPLING_KEYS]:
        expected = ", ".join(f"`{key}`" for key in _SAMPLING_KEYS)
        raise contract_error(f"unknown field `{unknown[0]}`, expected one of {expected}")
    try:
        params = msgspec.convert(raw, SamplingParams)
    except msgspec.ValidationError as exc:
        raise contract_error(f"sampling_params: {exc}") from None
    try:
        params.verify()
        _check_supported(params)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return params


def _check_supported(params: SamplingParams) -> None:
    """Refuse sampling keys the engine would otherwise ignore without a word."""
    if params.stop_regex:
        raise ValueError("stop_regex is not supported by this server: use stop")


# ----------------------------------------------------------------------------- /generate input


class GenerateJob(msgspec.Struct, kw_only=True):
    """One ``/generate`` call after parsing: the engine requests, flattened (item ``k``).

    ``single`` (one prompt, ``n == 1``) answers with an object, otherwise a list in item
    order; a batch with ``n`` samples puts prompt ``i``'s samples at ``i * n + j``.
    """

    requests: list[GenerateRequest]
    single: bool
    stream: bool = False
    text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False


def parse_generate(body: Json, tokenizer: Any) -> GenerateJob:
    """Validate a ``/generate`` body (1.1) into engine requests; raises ``ApiError``."""
    for key in _UNSUPPORTED:
        if body.get(key):
            raise bad_request(f"{key} is not supported by this server")
    prompts, batch = _prompts(body, tokenizer)
    count = len(prompts)
    raw = body.get("sampling_params") or {}
    raws = raw if isinstance(raw, list) else [raw] * count
    if len(raws) != count:
        raise bad_request(f"sampling_params has {len(raws)} entries for {count} prompts")
    params = [parse_sampling(r) for r in raws]
    n = params[0].n
    if any(p.n != n for p in params):
        raise bad_request("The parallel_sample_num should be the same for all samples.")
    flags = {
        key: [v for v in _per_prompt(body, key, kind, default, count) for _ in range(n)]
        for key, kind, default in (
            ("return_logprob", bool, False), ("logprob_start_len", int, -1),
            ("top_logprobs_num", int, 0),
        )
    }  # fmt: skip
    if any(flags["top_logprobs_num"]):
        raise bad_request("top_logprobs_num is not supported by this server (use 0)")
    rids = _rids(body.get("rid"), count, n)
    requests = [
        GenerateRequest(
            rid=rids[k],
            input_ids=prompts[k // n],
            sampling=params[k // n],
            return_logprob=flags["return_logprob"][k],
            logprob_start_len=flags["logprob_start_len"][k],
        )
        for k in range(count * n)
    ]
    if len(set(rids)) != len(rids):
        raise bad_request(f"Duplicate request ID detected in one call: {rids}")
    return GenerateJob(
        requests=requests,
        single=not batch and n == 1,
        stream=field(body, "stream", bool, False),
        text_in_logprobs=field(body, "return_text_in_logprobs", bool, False),
        return_prompt_token_ids=field(body, "return_prompt_token_ids", bool, False),
    )


def _prompts(body: Json, tokenizer: Any) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether the body was a batch."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("Either text or input_ids should be provided (exactly one).")
    if ids is not None:
        if not isinstance(ids, list):
            raise invalid_body(f"input_ids: expected a list of ints, got {ids!r}")
        if ids and all(isinstance(item, list) for item in ids):
            return ids, True
        return [ids], False
    if isinstance(text, str):
        return [_encode(tokenizer, text)], False
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return [_encode(tokenizer, t) for t in text], True
    raise invalid_body(f"text: expected a string or a non-empty list of strings, got {text!r}")


def _encode(tokenizer: Any, text: str) -> list[int]:
    if tokenizer is None:
        raise bad_request("text input needs a tokenizer and this model has none: send input_ids")
    return list(tokenizer.encode(text))


def _per_prompt(body: Json, key: str, kind: type, default: Any, count: int) -> list[Any]:
    """A per-request field: a scalar for every prompt or a list with one per prompt."""
    value = body.get(key)
    if value is None:
        return [default] * count
    if not isinstance(value, list):
        return [coerce(key, value, kind)] * count
    if len(value) != count:
        raise bad_request(f"{key} has {len(value)} entries for {count} prompts")
    return [default if v is None else coerce(key, v, kind) for v in value]


def _rids(rid: Any, count: int, n: int) -> list[str]:
    """Request ids: given, ``<rid>_<k>`` for batches and ``n > 1``, else random."""
    total = count * n
    if rid is None:
        return [uuid.uuid4().hex for _ in range(total)]
    if isinstance(rid, str):
        return [rid] if total == 1 else [f"{rid}_{k}" for k in range(total)]
    if not isinstance(rid, list) or not all(isinstance(r, str) for r in rid):
        raise invalid_body(f"rid: expected a string or a list of strings, got {rid!r}")
    if len(rid) == total:
        return list(rid)
    if len(rid) == count:
        return [f"{r}_{j}" for r in rid for j in range(n)]
    raise bad_request(f"rid has {len(rid)} entries for {count} prompts x n={n}")


# ----------------------------------------------------------------------------- /generate output


def finish_json(reason: FinishReason | None) -> Json | None:
    """SGLang's ``finish_reason`` object; a running abort names its null status (1.4)."""
    if reason is None:
        return None
    out = msgspec.to_builtins(reason)
    if reason.type == "abort" and reason.message != QUEUED_ABORT:
        out.setdefault("status_code", None)
        out.setdefault("err_type", None)
    return out


def version_spans(versions: list[int]) -> list[Json]:
    """``weight_versions``: ``[start, end)`` output-token ranges per weight version (1.3)."""
    spans: list[Json] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def decode_output(tokenizer: Any, request: GenerateRequest, out: GenerateOutput) -> str:
    """``text``: a matched stop token's text is dropped and a stop string cut off, unless
    ``no_stop_trim``; ``output_ids`` always keep the stop token (1.2)."""
    if tokenizer is None:
        return ""
    p, reason, ids = request.sampling, out.finish_reason, out.output_ids
    trim = not p.no_stop_trim and reason is not None and reason.type == "stop"
    if trim and isinstance(reason.matched, int) and ids:
        ids = ids[:-1]
    text = tokenizer.decode(
        ids,
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
    )
    if trim and isinstance(reason.matched, str) and (cut := text.find(reason.matched)) >= 0:
        text = text[:cut]
    return text


def _token_texts(tokenizer: Any, ids: list[int], wanted: bool) -> list[str | None]:
    if not wanted or tokenizer is None:
        return [None] * len(ids)
    return [tokenizer.decode([t]) for t in ids]


def meta_info(
    request: GenerateRequest, out: GenerateOutput, version: int, *, text_in_logprobs: bool,
    tokenizer: Any,
) -> Json:  # fmt: skip
    """The ``meta_info`` object (1.3); a queued abort has no prompt or cached tokens (5.1)."""
    meta: Json = {"id": out.rid, "finish_reason": finish_json(out.finish_reason)}
    if not out.queued:
        meta["prompt_tokens"] = out.prompt_tokens
    meta["weight_version"] = str(version)
    meta["num_retractions"] = 0
    if request.return_logprob:
        meta |= _logprob_fields(request, out, tokenizer if text_in_logprobs else None)
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = len(out.output_ids)
    if not out.queued:
        meta["cached_tokens"] = out.cached_tokens
    if out.finish_reason is not None:
        meta["weight_versions"] = version_spans(out.versions)
        meta["e2e_latency"] = out.e2e_latency
        meta["response_sent_to_client_ts"] = time.time()
    return meta


def _logprob_fields(request: GenerateRequest, out: GenerateOutput, tokenizer: Any) -> Json:
    """``[logprob, token_id, text | null]`` triples; the text only with a tokenizer given."""
    prompt = request.input_ids[max(request.logprob_start_len, 0) :]
    prompt = prompt if out.input_logprobs is not None else []
    texts = _token_texts(tokenizer, prompt + out.output_ids, tokenizer is not None)
    inputs = zip(out.input_logprobs or [], prompt, texts, strict=False)
    outputs = zip(out.logprobs, out.output_ids, texts[len(prompt) :], strict=True)
    return {
        "input_token_logprobs": [list(triple) for triple in inputs],
        "output_token_logprobs": [list(triple) for triple in outputs],
        "output_token_logprobs_length": len(out.output_ids),
    }


def failed_status(outs: list[GenerateOutput]) -> ApiError | None:
    """An engine-side abort with an HTTP status is an HTTP error for non-stream callers."""
    for out in outs:
        reason = out.finish_reason
        if reason is not None and reason.status_code and reason.status_code >= 400:
            message = reason.message or "request failed"
            if reason.status_code == 400:
                return bad_request(message)
            kind = reason.err_type or "InternalServerError"
            return ApiError(reason.status_code, message, openai_error(message, reason.status_code,
                                                                      kind))  # fmt: skip
    return None


# ----------------------------------------------------------------------------- traffic gate


class TrafficGate:
    """Who may start generating: the pause gate and SGLang's model-update lock.

    ``calls`` counts ``/generate`` calls past the gate until their answer is written, so
    ``drained()`` is "every admitted call has been answered". A weight update outside a
    pause (``updating``) closes the gate to new calls and waits for ``drained()``.
    """

    def __init__(self) -> None:
        self.open = asyncio.Event()  # cleared between pause and continue
        self.no_update = asyncio.Event()  # cleared while an update holds the lock
        self.idle = asyncio.Event()
        for event in (self.open, self.no_update, self.idle):
            event.set()
        self.calls = 0
        self._update_lock = asyncio.Lock()

    @property
    def paused(self) -> bool:
        """Between ``pause_generation`` and ``continue_generation``."""
        return not self.open.is_set()

    @contextlib.asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        """Hold one call's place; returns without yielding when the gate is open, so the
        caller's engine admission happens in the same step (``pause`` relies on it)."""
        while not (self.open.is_set() and self.no_update.is_set()):
            await (self.no_update if self.open.is_set() else self.open).wait()
        self.calls += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.calls -= 1
            if not self.calls:
                self.idle.set()

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
        engine: TorchEngine,
        *,
        served_model_name: str | None = None,
        server_args: Json | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_name = served_model_name or engine.model_path
        self.server_args = server_args or {}
        self.gate = TrafficGate()
        self.ready = False
        self.url = ""
        self._engine_task: asyncio.Task[None] | None = None
        self._warmup: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._started = time.time()
        self.app = self._build_app()

    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=1 << 28)
        app.cleanup_ctx.append(self._engine_lifetime)
        app.on_shutdown.append(self._on_shutdown)
        r = app.router
        for method in ("POST", "PUT"):
            r.add_route(method, "/generate", self.generate)
        posts = {
            "/abort_request": self.abort_request,
            "/pause_generation": self.pause_generation,
            "/continue_generation": self.continue_generation,
            "/update_weights_from_disk": self.update_weights_from_disk,
            "/init_weights_update_group": self.init_weights_update_group,
            "/update_weights_from_distributed": self.update_weights_from_distributed,
            "/destroy_weights_update_group": self.destroy_weights_update_group,
            "/update_weights_from_tensor": self.update_weights_from_tensor,
            "/update_weight_version": self.update_weight_version,
            "/begin_weight_update": self.begin_weight_update,
            "/end_weight_update": self.end_weight_update,
        }
        for path, handler in posts.items():
            r.add_post(path, handler)
        both = {
            "/flush_cache": self.flush_cache,
            "/release_memory_occupation": self.release_memory,
            "/resume_memory_occupation": self.resume_memory,
        }
        for path, handler in both.items():
            r.add_get(path, handler)
            r.add_post(path, handler)
        gets = {
            "/health": self.health,
            "/health_generate": self.health_generate,
            "/ready": self.ready_route,
            "/get_weight_version": self.weight_version,
            "/weight_version": self.weight_version,
            "/get_model_info": self.model_info,
            "/model_info": self.model_info,
            "/get_server_info": self.server_info,
            "/server_info": self.server_info,
            "/v1/models": self.models,
            "/v1/loads": self.loads,
            "/get_load": self.get_load,
            "/version": self.version,
        }
        for path, handler in gets.items():
            r.add_get(path, handler)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/v1/completions", self.completions)
        return app

    # -- lifecycle ------------------------------------------------------------------------
    async def _engine_lifetime(self, app: web.Application) -> AsyncIterator[None]:
        self._engine_task = asyncio.create_task(self.engine.run(), name="engine-run")
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
        # Answer every open call with its partial output so the shutdown does not wait.
        self.ready = False
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
        """``POST|PUT /generate`` (section 1)."""
        job = parse_generate(await read_json(request), self.engine.tokenizer)
        for item in job.requests:  # every refusal before anything starts
            self.engine.check(item)
        async with self.gate.generating():
            if job.stream:
                sent = [-1] * len(job.requests)

                def render(k: int, out: GenerateOutput) -> list[Json]:
                    # One event per new token(s): a weight swap wakes callers with none.
                    if out.finish_reason is None and len(out.output_ids) == sent[k]:
                        return []
                    sent[k] = len(out.output_ids)
                    return [self._payload(job, k, out)]

                return await self.stream(request, job.requests, render, error=_stream_error)
            finals = await self.collect(job.requests)
            if (failure := failed_status(finals)) is not None:
                raise failure
            payloads = [self._payload(job, k, out) for k, out in enumerate(finals)]
            resp = json_response(payloads[0] if job.single else payloads)
            return await _answer(request, resp)

    def _payload(self, job: GenerateJob, k: int, out: GenerateOutput) -> Json:
        request, tokenizer = job.requests[k], self.engine.tokenizer
        payload: Json = {
            "text": decode_output(tokenizer, request, out),
            "output_ids": out.output_ids,
            "meta_info": meta_info(
                request, out, self.engine.version, text_in_logprobs=job.text_in_logprobs,
                tokenizer=tokenizer,
            ),
        }  # fmt: skip
        if job.return_prompt_token_ids:
            payload["prompt_token_ids"] = request.input_ids
        if job.stream and not job.single:
            payload["index"] = k
        return payload

    # -- abort, pause -------------------------------------------------------------------------
    async def abort_request(self, request: web.Request) -> web.Response:
        """``/abort_request``: by rid prefix or all; empty 200 before the outputs exist (2.9)."""
        body = await read_json(request)
        rid = field(body, "rid", str, "")
        self.engine.abort(rid, abort_all=field(body, "abort_all", bool, False))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        """``/pause_generation`` (2.8): abort mode returns once every call is answered."""
        mode = field(await read_json(request), "mode", str, "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise invalid_body(f"mode: expected 'abort', 'retract' or 'in_place', got {mode!r}")
        self.gate.open.clear()
        # Calls that passed the gate start their items this tick; let them reach the engine
        # so the pause sees (and, in abort mode, aborts) them.
        await asyncio.sleep(0)
        await self.engine.pause(mode)
        if mode == "abort":
            await self.gate.drained()
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        """``/continue_generation`` (2.8)."""
        await read_json(request)
        await self.engine.resume()
        self.gate.open.set()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    # -- weights ------------------------------------------------------------------------------
    async def _admin(self, request: web.Request, action: Callable[[Json], Awaitable[Json]]) -> Any:
        """Run an admin action: ``{"success": true, ...}`` or 400 ``{"success": false}`` (2)."""
        body = await read_json(request)
        try:
            reply = await action(body)
        except ApiError as exc:
            return json_response({"success": False, "message": exc.message}, status=400)
        except ValueError as exc:  # EngineError or a bad parameter: the caller's to fix
            log.warning("admin call refused", path=request.path, error=str(exc))
            return json_response({"success": False, "message": str(exc)}, status=400)
        except Exception as exc:  # a failed load or collective: SGLang answers 400, not 500
            log.exception("admin call failed", path=request.path)
            return json_response({"success": False, "message": f"{exc!r}"}, status=400)
        return json_response({"success": True, **reply})

    def _abort_first(self, body: Json, default: bool = False) -> None:
        if field(body, "abort_all_requests", bool, default):
            self.engine.abort(abort_all=True)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """``/update_weights_from_disk`` (2.1)."""

        async def action(body: Json) -> Json:
            path = field(body, "model_path", str)
            if not path:
                raise ValueError("model_path is required")
            version = parse_version(body.get("weight_version"))
            self._abort_first(body)
            async with self.gate.updating():
                await self.engine.update_weights_from_disk(path, version)
            return {"message": _updated("model weights", self.engine.version),
                    "num_paused_requests": 0}  # fmt: skip

        return await self._admin(request, action)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """``/init_weights_update_group`` (2.2): rank = rank_offset (one TP rank here)."""

        async def action(body: Json) -> Json:
            default_backend = "nccl" if self.engine.device.type == "cuda" else "gloo"
            await self.engine.init_weights_update_group(
                master_address=field(body, "master_address", str, "127.0.0.1"),
                master_port=_required(body, "master_port", int),
                rank=field(body, "rank_offset", int, 1),
                world_size=_required(body, "world_size", int),
                group_name=field(body, "group_name", str, "weight_update_group"),
                backend=field(body, "backend", str, default_backend),
            )
            return {"message": "Succeeded to initialize custom process group."}

        return await self._admin(request, action)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """``/update_weights_from_distributed`` (2.3): receive by broadcast, then load."""

        async def action(body: Json) -> Json:
            if body.get("load_format") not in (None, "direct"):
                raise ValueError(f"load_format {body['load_format']!r} is not supported")
            version = parse_version(body.get("weight_version"))
            self._abort_first(body)
            async with self.gate.updating():
                await self.engine.update_weights_from_distributed(
                    names=_required(body, "names", list),
                    dtypes=[d.removeprefix("torch.") for d in _required(body, "dtypes", list)],
                    shapes=_required(body, "shapes", list),
                    group_name=field(body, "group_name", str, "weight_update_group"),
                    version=version,
                )
            return {"message": _updated("parameter online", self.engine.version)}

        return await self._admin(request, action)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        """``/destroy_weights_update_group`` (2.2)."""

        async def action(body: Json) -> Json:
            group = field(body, "group_name", str, "weight_update_group")
            await self.engine.destroy_weights_update_group(group)
            return {"message": "Succeeded to destroy custom process group."}

        return await self._admin(request, action)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """Refused: its payload is a pickle, and this server never unpickles (2.4)."""
        await read_json(request)
        message = "not supported: use update_weights_from_disk or update_weights_from_distributed"
        return json_response({"success": False, "message": message}, status=400)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """``/update_weight_version`` (2.6); ``abort_all_requests`` defaults to true."""

        async def action(body: Json) -> Json:
            version = parse_version(body.get("new_version"))
            if version is None:
                raise ValueError("new_version is required")
            self._abort_first(body, default=True)
            self.engine.version = version
            return {"message": f"Weight version updated to {version}", "new_version": str(version)}

        return await self._admin(request, action)

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """A no-op session opener (2.5): updates here need no session."""
        return await self._admin(request, _no_op("Weight update session begun."))

    async def end_weight_update(self, request: web.Request) -> web.Response:
        """A no-op session closer (2.5)."""
        return await self._admin(request, _no_op("Weight update session ended."))

    # -- cache and memory ---------------------------------------------------------------------
    async def flush_cache(self, request: web.Request) -> web.Response:
        """``/flush_cache`` (2.10): text/plain, 400 while requests run or wait."""
        if await self.engine.flush_cache():
            return web.Response(text=_FLUSHED)
        load = self.engine.load()
        return web.Response(
            status=400,
            text=f"Cache not flushed: {load.num_running_reqs} running and "
            f"{load.num_waiting_reqs} waiting requests.\n",
        )

    async def release_memory(self, request: web.Request) -> web.Response:
        """``/release_memory_occupation`` (2.7): JSON null; needs an idle engine."""
        await self.engine.release_memory(_tags(await read_json(request)))
        return json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        """``/resume_memory_occupation`` (2.7): JSON null."""
        await self.engine.resume_memory(_tags(await read_json(request)))
        return json_response(None)

    # -- discovery ----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """``/health``: 200 empty once warmed up, 503 while starting or stopping (2.11)."""
        return web.Response(status=200 if self.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """``/health_generate``: a real 1-token generation; 503 if none within 20 s."""
        if not self.alive:
            return web.Response(status=503)
        try:
            await self.probe()
        except (TimeoutError, ValueError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def ready_route(self, request: web.Request) -> web.Response:
        """``/ready``: 200 when up and not paused (0.5.20+)."""
        return web.Response(status=200 if self.alive and not self.gate.paused else 503)

    async def weight_version(self, request: web.Request) -> web.Response:
        """``/get_weight_version`` and ``/weight_version`` (2.6)."""
        return json_response({"weight_version": str(self.engine.version)})

    async def model_info(self, request: web.Request) -> web.Response:
        """``/get_model_info`` and ``/model_info`` (2.12)."""
        config = self.engine.model.config
        return json_response({
            "model_path": self.engine.model_path,
            "tokenizer_path": self.engine.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(self.engine.version),
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
            "served_model_name": self.served_model_name,
        })  # fmt: skip

    async def server_info(self, request: web.Request) -> web.Response:
        """``/get_server_info`` and ``/server_info``: the fields of 2.13 and the server args."""
        from asyncrl import __version__

        e = self.engine
        load = e.load()
        return json_response({
            **self.server_args,
            "model_path": e.model_path,
            "tokenizer_path": e.model_path,
            "served_model_name": self.served_model_name,
            "tp_size": 1,
            "dp_size": 1,
            "context_length": e.context_length,
            "max_running_requests": e.max_running,
            "max_total_num_tokens": e.max_total_tokens,
            "max_req_input_len": e.context_length - 1,
            "weight_version": str(e.version),
            "device": e.device.type,
            "internal_states": [{"dp_rank": 0, "paused": load.paused,
                                 "num_running_reqs": load.num_running_reqs}],
            "startup_time": self._started,
            "version": __version__,
        })  # fmt: skip

    async def models(self, request: web.Request) -> web.Response:
        """``/v1/models`` (2.14)."""
        name = self.served_model_name
        card = {"id": name, "object": "model", "created": int(self._started),
                "owned_by": "sglang", "root": name, "parent": None,
                "max_model_len": self.engine.context_length}  # fmt: skip
        return json_response({"object": "list", "data": [card]})

    async def loads(self, request: web.Request) -> web.Response:
        """``/v1/loads`` (2.14): the core fields for the one data-parallel rank."""
        from asyncrl import __version__

        load = self.engine.load()
        usage = load.num_used_tokens / max(load.max_total_num_tokens, 1)
        row = {
            "dp_rank": 0,
            "num_running_reqs": load.num_running_reqs,
            "num_waiting_reqs": load.num_waiting_reqs,
            "num_used_tokens": load.num_used_tokens,
            "max_total_num_tokens": load.max_total_num_tokens,
            "token_usage": usage,
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": usage,
        }
        device = self.engine.device.type
        return json_response({
            "timestamp": datetime.now(UTC).isoformat(),
            "version": __version__,
            "accelerator": None if device == "cpu" else device,
            "num_accelerators": 0 if device == "cpu" else 1,
            "loads": [row],
        })  # fmt: skip

    async def get_load(self, request: web.Request) -> web.Response:
        """``/get_load`` (deprecated, polled by sglang-router 0.3.2)."""
        load = self.engine.load()
        return json_response([{
            "dp_rank": 0,
            "num_reqs": load.num_running_reqs + load.num_waiting_reqs,
            "num_waiting_reqs": load.num_waiting_reqs,
            "num_tokens": load.num_used_tokens,
        }])  # fmt: skip

    async def version(self, request: web.Request) -> web.Response:
        """``/version``."""
        from asyncrl import __version__

        return json_response({"version": __version__})

    # -- OpenAI routes (section 3) --------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``: the chat template, then the native path (3.1-3.3)."""
        body = await read_json(request)
        call = OpenAICall.parse(body, [self._chat_prompt(body)], self, chat=True)
        return await self._openai(request, call)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``: ``prompt`` as text(s) or token ids (3.4)."""
        body = await read_json(request)
        if field(body, "logprobs", int, 0) > 0:
            raise bad_request("top logprobs are not supported: use logprobs=0 for token logprobs")
        call = OpenAICall.parse(body, _completion_prompts(body, self.engine.tokenizer), self,
                                chat=False)  # fmt: skip
        return await self._openai(request, call)

    async def _openai(self, request: web.Request, call: OpenAICall) -> web.StreamResponse:
        for item in call.requests:
            self.engine.check(item)
        async with self.gate.generating():
            if call.stream:
                deltas = OpenAIStream(call, self.engine.tokenizer)
                return await self.stream(
                    request, call.requests, deltas.render, tail=deltas.tail,
                    error=lambda exc: openai_error(str(exc)),
                )  # fmt: skip
            finals = await self.collect(call.requests)
            if (failure := failed_status(finals)) is not None:
                raise failure
            return await _answer(request, json_response(call.reply(finals, self.engine.version)))

    def _chat_prompt(self, body: Json) -> list[int]:
        """``input_ids`` as given (0.5.15+), else the tokenizer's chat template."""
        if body.get("input_ids") is not None:
            return coerce("input_ids", body["input_ids"], list)
        messages, tokenizer = body.get("messages"), self.engine.tokenizer
        if not isinstance(messages, list) or not messages:
            raise invalid_body("messages: expected a non-empty list of messages")
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template: use /v1/completions")
        return chat_template_ids(tokenizer, messages, body)


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


def _stream_error(exc: Exception) -> Json:
    """A refusal after the stream started: one error event, then ``[DONE]`` (1.6)."""
    return {"error": {"message": str(exc), "type": "invalid_request_error", "code": 400,
                      "retryable": False}}  # fmt: skip


def _required(body: Json, key: str, kind: type) -> Any:
    value = field(body, key, kind)
    if value is None:
        raise ValueError(f"{key} is required")
    return value


def _tags(body: Json) -> list[str] | None:
    tags = body.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise invalid_body(f"tags: expected a list of strings or null, got {tags!r}")
    return tags


def _updated(what: str, version: int) -> str:
    return f"Succeeded to update {what}. Weight version updated to {version}."


def _no_op(message: str) -> Callable[[Json], Awaitable[Json]]:
    async def action(body: Json) -> Json:
        return {"message": message}

    return action


async def _answer(request: web.Request, resp: web.Response) -> web.Response:
    """Write a reply inside the traffic gate, so a pause returns only after it went out."""
    await resp.prepare(request)
    await resp.write_eof()
    return resp


# ----------------------------------------------------------------------------- OpenAI (3)

#: OpenAI request key -> SGLang sampling key (SGLang's extras keep their names).
_OPENAI_SAMPLING = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "no_stop_trim", "n": "n",
    "seed": "sampling_seed", "min_tokens": "min_new_tokens", "logit_bias": "logit_bias",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "regex": "regex", "ebnf": "ebnf", "custom_params": "custom_params",
}  # fmt: skip
_NON_STREAM_ONLY = ("return_token_ids", "return_prompt_token_ids", "return_meta_info")


def chat_template_ids(tokenizer: Any, messages: list[Any], body: Json) -> list[int]:
    """Render ``messages`` with the tokenizer's chat template and tokenize the text."""
    import jinja2

    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid_body("chat_template_kwargs: expected an object")
    cont = field(body, "continue_final_message", bool, False)
    try:
        text = tokenizer.apply_chat_template(
            [_flat_message(m) for m in messages], tools=body.get("tools"), tokenize=False,
            add_generation_prompt=not cont, continue_final_message=cont, **kwargs,
        )  # fmt: skip
    except (jinja2.TemplateError, TypeError, KeyError) as exc:
        raise bad_request(f"the chat template failed on these messages: {exc}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def _flat_message(message: Any) -> Json:
    """A message whose content is text (OpenAI content parts are joined)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise invalid_body(f"messages: each message needs a string role, got {message!r}")
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {**message, "content": content or ""}


def _completion_prompts(body: Json, tokenizer: Any) -> list[list[int]]:
    """``prompt``: a string, strings, token ids or lists of token ids (3.4)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [_encode(tokenizer, prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [_encode(tokenizer, p) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            return prompt
        return [prompt]
    raise invalid_body(f"prompt: expected text, texts or token ids, got {prompt!r}")


def openai_sampling(body: Json, max_tokens: int | None) -> SamplingParams:
    """The OpenAI sampling fields as ``SamplingParams`` (checked like /generate's)."""
    raw = {dst: body[src] for src, dst in _OPENAI_SAMPLING.items() if body.get(src) is not None}
    raw["max_new_tokens"] = max_tokens
    try:
        params = msgspec.convert(raw, SamplingParams)
    except msgspec.ValidationError as exc:
        raise bad_request(str(exc)) from None
    params.verify()
    _check_supported(params)
    return params


class OpenAICall(msgspec.Struct, kw_only=True):
    """One chat or completion call: the engine requests (choice ``k``) and what to return."""

    id: str
    model: str
    chat: bool
    prompts: list[list[int]]
    requests: list[GenerateRequest]
    n: int
    stream: bool
    logprobs: bool
    include_usage: bool
    echo: bool
    extras: frozenset[str]
    tokenizer: Any = None
    created: int = msgspec.field(default_factory=lambda: int(time.time()))

    @classmethod
    def parse(cls, body: Json, prompts: list[list[int]], server: EngineServer, *, chat: bool
              ) -> OpenAICall:  # fmt: skip
        """Validate the body (3.1, 3.4); refusals are 400s in the OpenAI error shape."""
        stream = field(body, "stream", bool, False)
        extras = frozenset(k for k in _NON_STREAM_ONLY if field(body, k, bool, False))
        if stream and extras:
            raise bad_request(f"{sorted(extras)} are not supported with stream=true")
        if chat and field(body, "top_logprobs", int, 0):
            raise bad_request("top_logprobs are not supported by this server")
        default = None if chat else 16
        max_tokens = field(body, "max_completion_tokens", int) if chat else None
        max_tokens = field(body, "max_tokens", int, default) if max_tokens is None else max_tokens
        if not chat and max_tokens is not None and max_tokens <= 0:
            raise bad_request(f"max_tokens must be positive, got {max_tokens}")
        params = openai_sampling(body, max_tokens)
        rid = body.get("rid")
        rids = _rids(rid, len(prompts), params.n)
        requests = [
            GenerateRequest(rid=r, input_ids=prompts[k // params.n], sampling=params,
                            return_logprob=True)
            for k, r in enumerate(rids)
        ]  # fmt: skip
        options = body.get("stream_options") or {}
        model = body.get("model")
        return cls(
            id=rid if isinstance(rid, str) else rids[0], chat=chat, prompts=prompts,
            model=model if isinstance(model, str) else server.served_model_name,
            requests=requests, n=params.n, stream=stream,
            # chat: a bool; completions: an int of alternatives, where 0 still means "on"
            logprobs=field(body, "logprobs", bool, False) if chat
            else field(body, "logprobs", int) is not None,
            include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
            echo=not chat and field(body, "echo", bool, False), extras=extras,
            tokenizer=server.engine.tokenizer,
        )  # fmt: skip

    def text(self, k: int, out: GenerateOutput) -> str:
        """Choice ``k``'s text (with the prompt first when ``echo``)."""
        text = decode_output(self.tokenizer, self.requests[k], out)
        if self.echo and self.tokenizer is not None:
            text = self.tokenizer.decode(self.requests[k].input_ids) + text
        return text

    def usage(self, finals: list[GenerateOutput]) -> Json:
        """Prompt tokens count once per prompt, completion tokens once per choice."""
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(f.output_ids) for f in finals)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}  # fmt: skip

    def logprobs_json(self, ids: list[int], logprobs: list[float], offset: int = 0) -> Any:
        """Chat: ``{"content": [...]}``; completions: tokens, offsets and logprobs (3.2, 3.4)."""
        if not self.logprobs:
            return None
        tokens = [str(t) for t in _token_texts(self.tokenizer, ids, True)] if self.tokenizer \
            else [str(t) for t in ids]  # fmt: skip
        if self.chat:
            return {"content": [
                {"token": t, "bytes": list(t.encode()), "logprob": lp, "top_logprobs": []}
                for t, lp in zip(tokens, logprobs, strict=True)
            ]}  # fmt: skip
        offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens,
                "top_logprobs": None}  # fmt: skip

    def choice(self, k: int, out: GenerateOutput, version: int) -> Json:
        """One non-stream choice."""
        reason, matched = _openai_finish(out.finish_reason)
        text = self.text(k, out)
        lps = self.logprobs_json(out.output_ids, out.logprobs)
        body: Json = (
            {"index": k, "message": {"role": "assistant", "content": text,
                                     "reasoning_content": None, "tool_calls": None},
             "logprobs": lps}
            if self.chat else {"index": k, "text": text, "logprobs": lps}
        )  # fmt: skip
        body |= {"finish_reason": reason, "matched_stop": matched}
        request = self.requests[k]
        if "return_token_ids" in self.extras:
            body["prompt_token_ids"] = request.input_ids
            body["response_token_ids" if self.chat else "token_ids"] = out.output_ids
        if "return_prompt_token_ids" in self.extras:
            body["prompt_token_ids"] = request.input_ids
        if "return_meta_info" in self.extras:
            body["meta_info"] = meta_info(request, out, version, text_in_logprobs=False,
                                          tokenizer=self.tokenizer)  # fmt: skip
        return body

    def reply(self, finals: list[GenerateOutput], version: int) -> Json:
        """The whole non-stream response (3.2, 3.4)."""
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self.choice(k, out, version) for k, out in enumerate(finals)],
            "usage": self.usage(finals),
            "metadata": {"weight_version": str(version),
                         "weight_versions": version_spans(finals[0].versions)},
        }  # fmt: skip

    def chunk(self, choices: list[Json], **extra: Any) -> Json:
        """A stream chunk around ``choices``."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}  # fmt: skip


class OpenAIStream:
    """Turns cumulative engine outputs into OpenAI deltas per choice (3.3).

    Text that ends in an incomplete UTF-8 character is held back until it completes; a stop
    string already sent before the final trim cannot be taken back (SGLang has the same
    limit).
    """

    def __init__(self, call: OpenAICall, tokenizer: Any) -> None:
        self.call = call
        self.sent_text = [""] * len(call.requests)
        self.sent_ids = [0] * len(call.requests)
        self.finals: list[GenerateOutput] = []

    def render(self, k: int, out: GenerateOutput) -> list[Json]:
        """The chunks for choice ``k``'s new output (none while nothing new is complete)."""
        call, final = self.call, out.finish_reason is not None
        events = []
        if call.chat and self.sent_ids[k] == 0 and not self.sent_text[k]:
            events.append(self._choice(k, {"role": "assistant", "content": ""}, None, None))
        text, prev = call.text(k, out), self.sent_text[k]
        delta = text[len(prev) :] if text.startswith(prev) else ""
        if delta.endswith("\ufffd") and not final:
            return events
        ids = out.output_ids[self.sent_ids[k] :]
        lps = call.logprobs_json(ids, out.logprobs[self.sent_ids[k] :], len(prev))
        self.sent_text[k], self.sent_ids[k] = prev + delta, len(out.output_ids)
        if final:
            self.finals.append(out)
        if delta or final:
            reason, matched = _openai_finish(out.finish_reason)
            content = {"content": delta} if call.chat else delta
            events.append(self._choice(k, content, reason, matched, lps))
        return events

    def _choice(self, k: int, delta: Any, reason: str | None, matched: Any, lps: Any = None
                ) -> Json:  # fmt: skip
        key = "delta" if self.call.chat else "text"
        choice = {"index": k, key: delta, "logprobs": lps, "finish_reason": reason,
                  "matched_stop": matched}  # fmt: skip
        return self.call.chunk([choice])

    def tail(self) -> list[Json]:
        """The usage chunk (empty choices) when ``stream_options.include_usage``."""
        if not self.call.include_usage:
            return []
        return [self.call.chunk([], usage=self.call.usage(self.finals))]


def _openai_finish(reason: FinishReason | None) -> tuple[str | None, Any]:
    """OpenAI's ``finish_reason`` string and ``matched_stop``."""
    if reason is None:
        return None, None
    return reason.type, reason.matched if reason.type == "stop" else None
