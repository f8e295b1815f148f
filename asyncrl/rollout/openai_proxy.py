"""The OpenAI-compatible proxy that an agent written against the official ``openai`` client
talks to, unchanged: sessions, each call checked and continued as one token trajectory
against the engine, and OpenAI's reply and error shapes, so what is trained is exactly
what the engine sampled. The protocol, its limits and the weight-update rules are in
``docs/agents.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import structlog
from aiohttp import web

from asyncrl.engines.base import SamplingParams
from asyncrl.engines.server.generate_wire import DONE, ApiError, json_response, read_json, sse
from asyncrl.engines.server.openai_routes import chat_template_ids
from asyncrl.engines.server.tool_stream import (
    ToolStream,
    arguments_text,
    content_of,
    forced_tools,
    parses_tool_calls,
)
from asyncrl.rollout.base import RolloutContext
from asyncrl.rollout.multi_turn import HermesParser, ObservationRenderer, ToolCall, ToolCallParser
from asyncrl.types import Sample, pack_int32

if TYPE_CHECKING:
    import openai

log = structlog.get_logger(__name__)

Json = dict[str, Any]

#: The largest final state kept in ``metadata["final_state"]`` (bigger ones are dropped).
MAX_STATE_BYTES = 64 * 1024

#: Consecutive aborts with no new token after which a call fails (a wedged engine).
_MAX_EMPTY_ABORTS = 50

#: Sampling fields the run decides (the trained policy); an agent's values are overridden.
_POLICY_FIELDS = ("temperature", "top_p", "top_k", "min_p")


@dataclass(frozen=True, slots=True)
class Session:
    """What an agent needs to reach the model for one episode."""

    base_url: str
    api_key: str
    model: str = "asyncrl-policy"

    def client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` for this session (needs the ``openai`` package).

        It shares one connection pool per event loop with every other session's client:
        a pool of its own would set up an SSL context per episode, most of the proxy's
        cost. Closing the client leaves the shared pool open.
        """
        import openai

        kwargs.setdefault("http_client", _shared_http_client())
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


_HTTP_CLIENTS: dict[int, Any] = {}  # id(event loop) -> its shared pool


def _shared_http_client() -> Any:
    """The event loop's shared pool for ``Session.client`` (its ``aclose`` does nothing,
    since each session's client closes it; the loop's end frees it)."""
    import openai

    class _Shared(openai.DefaultAsyncHttpxClient):  # type: ignore[misc]
        async def aclose(self) -> None:
            return None

        async def close_pool(self) -> None:
            await super().aclose()

    key = id(asyncio.get_running_loop())
    if key not in _HTTP_CLIENTS:
        _HTTP_CLIENTS.clear()  # a new loop: the old loop's pool is unusable
        _HTTP_CLIENTS[key] = _Shared()
    return _HTTP_CLIENTS[key]


async def _close_shared_http_client() -> None:
    """Close the running loop's shared pool, if any (the proxy does, when it stops)."""
    client = _HTTP_CLIENTS.pop(id(asyncio.get_running_loop()), None)
    if client is not None:
        await client.close_pool()


@dataclass(frozen=True, slots=True)
class AgentTask:
    """One data row, as the agent sees it: the prompt as written (text or chat messages,
    not rendered), its label, metadata and tool schemas."""

    uid: str
    prompt: str | list[dict[str, Any]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None


Agent = Callable[[Session, AgentTask], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """``max_calls`` chat completions per episode; an episode longer than ``timeout_s``
    fails; ``host`` the proxy binds."""

    max_calls: int = 16
    timeout_s: float = 600.0
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.max_calls < 1 or self.timeout_s <= 0:
            raise ValueError(f"max_calls must be >= 1 and timeout_s > 0: {self}")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> ApiError:
    """OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return ApiError(status, message, body)


def _text(content: Any) -> str:
    """A message's content as text (OpenAI text parts are joined; other parts are refused:
    this proxy trains text models)."""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type", "text") == "text" for p in content):
            raise _error(400, "only text content parts are supported")
        return "".join(str(p.get("text", "")) for p in content)
    return content if isinstance(content, str) else ""


def _arguments(raw: Any) -> Any:
    """Tool-call arguments in a canonical form (a JSON string is parsed)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return raw
    return json.dumps(raw, sort_keys=True)


def message_key(message: Any) -> tuple[Any, ...]:
    """What must match when an agent sends a message back: role, stripped text, tool calls."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _error(400, f"messages: each message needs a string role, got {message!r}")
    raw = message.get("tool_calls") or []
    fns = [c.get("function") if isinstance(c, dict) else None for c in raw]
    if not isinstance(raw, list) or not all(isinstance(f, dict) for f in fns):
        raise _error(400, f"tool_calls: expected a list of {{'function': {{...}}}}, got {raw!r}")
    calls = tuple((f.get("name"), _arguments(f.get("arguments"))) for f in fns)
    return message["role"], _text(message.get("content")).strip(), calls


class Episode:
    """The proxy's side of one session: the sample it fills and the conversation so far."""

    def __init__(self, sample: Sample, key: str, aborts: int) -> None:
        self.sample, self.key, self.aborts_at_start = sample, key, aborts
        self.history: list[tuple[Any, ...]] = []  # message_key of every message so far
        self.tools: str | None = None  # the first call's tools, canonical JSON
        self.call_names: dict[str, str] = {}  # tool_call id -> tool name
        self.calls = 0
        self.busy = False
        self.truncated: str | None = None  # "length" or "max_turns" once a limit is hit
        self.owner: asyncio.Task[Any] | None = None  # the workflow task, cancelled on abort
        self.handler: asyncio.Task[Any] | None = None  # the call in progress
        self.aborted = False
        self.closed = False

    def snapshot(self) -> tuple[Any, ...]:
        """What a call changes, so a call that fails can be undone (a retry starts clean)."""
        s = self.sample
        return (
            s.response_length,
            s.packed_prompt,
            list(self.history),
            self.tools,
            self.calls,
            self.truncated,
            len(s.metadata.get("tool_calls", ())),
        )

    def restore(self, state: tuple[Any, ...]) -> None:
        length, prompt, self.history, self.tools, self.calls, self.truncated, calls = state
        self.sample.truncate_response(length)
        self.sample.packed_prompt = prompt
        if "tool_calls" in self.sample.metadata:
            del self.sample.metadata["tool_calls"][calls:]


class OpenAIProxy:
    """The OpenAI-compatible server in front of one rollout actor's engines (module doc)."""

    def __init__(
        self,
        ctx: RolloutContext,
        config: ProxyConfig | None = None,
        parser: ToolCallParser | None = None,
    ) -> None:
        if ctx.tokenizer is None or not getattr(ctx.tokenizer, "chat_template", None):
            raise ValueError("the OpenAI proxy needs a tokenizer with a chat template")
        self.ctx, self.config = ctx, config or ProxyConfig()
        self.parser = parser or HermesParser()
        self.renderer = ObservationRenderer(ctx.tokenizer)
        self.eos_id = ctx.tokenizer.eos_token_id
        self.episodes: dict[str, Episode] = {}
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._warned: set[str] = set()

    async def __aenter__(self) -> OpenAIProxy:
        app = web.Application(middlewares=[_errors], client_max_size=64 * 2**20)
        app.router.add_post("/s/{session}/v1/chat/completions", self._chat)
        app.router.add_get("/s/{session}/v1/models", self._models)
        # A call whose client went away is cancelled (and undone), never left writing.
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.config.host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await _close_shared_http_client()

    @contextlib.asynccontextmanager
    async def session(self, sample: Sample) -> AsyncIterator[tuple[Session, Episode]]:
        """A fresh session filling ``sample``; closed (its URL a 404) when the block ends."""
        sid = secrets.token_hex(8)
        episode = Episode(sample, secrets.token_urlsafe(24), self.ctx.aborts())
        episode.owner = asyncio.current_task()
        self.episodes[sid] = episode
        try:
            yield Session(f"{self.url}/s/{sid}/v1", episode.key), episode
        finally:
            episode.closed = True
            del self.episodes[sid]
            if episode.handler is not None and not episode.handler.done():
                episode.handler.cancel()  # a call the agent walked away from writes nothing

    # -- HTTP ---------------------------------------------------------------------------
    def _episode(self, request: web.Request) -> Episode:
        episode = self.episodes.get(request.match_info["session"])
        if episode is None:
            raise _error(404, "no such session (the episode is over)", "not_found_error")
        auth = request.headers.get("Authorization", "")
        if not secrets.compare_digest(auth.encode(), f"Bearer {episode.key}".encode()):
            raise _error(401, "invalid API key for this session", "authentication_error")
        return episode

    async def _models(self, request: web.Request) -> web.Response:
        self._episode(request)
        model = {"id": "asyncrl-policy", "object": "model", "created": 0, "owned_by": "asyncrl"}
        return json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        episode = self._episode(request)
        body = await read_json(request)
        if episode.busy:
            raise _error(400, "one call at a time per session: the episode is one conversation")
        episode.busy, episode.handler = True, asyncio.current_task()
        state = episode.snapshot()
        try:
            reply, stream = await self._complete(episode, body)
            if not body.get("stream"):
                return json_response(reply)
            return await _write_sse(request, stream.chunks(reply, _include_usage(body)))
        except BaseException:  # refused, failed or cancelled: the call leaves no trace
            if not episode.aborted:
                episode.restore(state)
            raise
        finally:
            episode.busy, episode.handler = False, None

    # -- one completion -----------------------------------------------------------------
    async def _complete(self, episode: Episode, body: Json) -> tuple[Json, _ReplyStream]:
        """The turn's reply, and the same reply as stream deltas (``stream=true``)."""
        _check_options(body)
        parser = self.parser if _parses_tool_calls(body) else None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _error(400, "messages: expected a non-empty list of messages")
        keys = [message_key(m) for m in messages]
        start = time.time()
        if episode.calls >= self.config.max_calls:
            episode.truncated = episode.truncated or "max_turns"
        elif episode.truncated is None:  # once truncated, every call gets the empty reply
            extend = self._extend if episode.calls else self._start
            extend(episode, messages, keys, body)
        episode.calls += 1
        if episode.truncated:
            return self._reply(body, episode, [], None, "length", start), _ReplyStream()
        turn, cut, matched = await self._generate(episode, body)
        text = self._turn_text(turn, matched)
        calls = [c for c in parser.parse(text) if c.error is None] if parser else []
        reason = "tool_calls" if calls else ("length" if cut else "stop")
        content = content_of(parser, text) if calls else text  # as /v1: unstripped
        reply = self._reply(body, episode, turn, (content, calls), reason, start)
        return reply, _ReplyStream(text, parser, lambda k: _call_id(episode, k))

    def _start(self, episode: Episode, messages: list[Any], keys: list[Any], body: Json) -> None:
        """The first call: its rendered messages are the sample's prompt."""
        ids = chat_template_ids(self.ctx.tokenizer, messages, body)
        episode.sample.packed_prompt = pack_int32(ids)
        episode.tools = json.dumps(body.get("tools"), sort_keys=True)
        episode.history = keys

    def _extend(self, episode: Episode, messages: list[Any], keys: list[Any], body: Json) -> None:
        """A later call: check the history, then append the new messages' delta."""
        old = len(episode.history)
        if json.dumps(body.get("tools"), sort_keys=True) != episode.tools:
            raise _error(400, "tools changed during the episode: offer the same tools each call")
        if keys[:old] != episode.history:
            at = _first_difference(keys, episode.history)
            raise _error(
                400,
                f"messages[{at}] differs from the conversation so far: an episode must append "
                "to its messages and send each reply back unchanged",
            )
        new = messages[old:]
        if not new:
            raise _error(400, "no new message since the last reply")
        if any(k[0] == "assistant" for k in keys[old:]):
            raise _error(
                400,
                "an assistant message the model did not write cannot be "
                "appended: add tool, user or system messages",
            )
        episode.history = keys
        self._append_delta(episode, [self._flat(m, episode) for m in new])

    def _flat(self, message: Json, episode: Episode) -> Json:
        flat = {"role": message["role"], "content": _text(message.get("content"))}
        if message["role"] == "tool":
            name = message.get("name") or episode.call_names.get(str(message.get("tool_call_id")))
            flat["name"] = name or ""
        return flat

    def _append_delta(self, episode: Episode, messages: list[Json]) -> None:
        s = episode.sample
        closed = s.response_length > 0 and int(s.response_tokens[-1]) == self.eos_id
        try:
            tokens = self.renderer.render(messages, turn_closed=closed)
        except Exception as exc:  # jinja raises its own errors; all mean the same here
            raise _error(400, f"the chat template cannot render these messages: {exc}") from None
        if s.response_length + len(tokens) >= self._budget():
            episode.truncated = "length"  # no room left for another turn
            return
        role = "tool" if all(m["role"] == "tool" for m in messages) else "user"
        version = int(s.token_versions[-1])
        s.append_response(tokens, np.zeros(len(tokens)), version, loss_mask=0, role=role)

    def _budget(self) -> int:
        return self.ctx.budget

    async def _generate(self, episode: Episode, body: Json) -> tuple[list[int], bool, str | None]:
        """One assistant turn; an abort by a weight update continues on the new weights.
        Returns the turn's tokens, whether it was cut at its token limit, and the stop
        string it ended on (None: EOS, a stop token, or no stop)."""
        s = episode.sample
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        left = self._budget() - s.response_length
        limit = left if asked is None else min(left, int(asked))
        params = self._request_sampling(body)
        turn: list[int] = []
        kind, empty_aborts, matched = "length", 0, None
        while limit > 0:
            if self.ctx.aborts() != episode.aborts_at_start:
                self._abort(episode)
            if empty_aborts >= _MAX_EMPTY_ABORTS:
                raise RuntimeError(f"the engine aborted this call {empty_aborts} times in a row")
            ids = np.concatenate([s.prompt_tokens, s.response_tokens]).tolist()
            sampling = self.ctx.sampling_with(**params, max_new_tokens=limit)
            result = await self.ctx.engine.generate(
                ids, sampling, rid=f"{s.uid}#{s.attempts}#{episode.calls}#{len(turn)}#"
            )
            if result.output_ids:
                if result.logprobs is None:
                    raise ValueError("the engine returned no log-probs (return_logprob is needed)")
                s.append_response(result.output_ids, result.logprobs, result.versions)
                turn += result.output_ids
                limit -= len(result.output_ids)
            reason = self.ctx.finish(result, sampling)
            kind = reason.type if reason is not None else "abort"
            if reason is not None and kind != "abort":
                matched = reason.matched
                break
            empty_aborts = 0 if result.output_ids else empty_aborts + 1
            if not result.output_ids:
                await asyncio.sleep(0.01 * empty_aborts)  # a paused engine: back off
        if len(turn) >= left and kind != "stop":
            episode.truncated = "length"  # the whole budget is spent, the reply unfinished
        return turn, kind != "stop", matched if isinstance(matched, str) else None

    def _abort(self, episode: Episode) -> None:
        if not episode.aborted and not episode.closed and episode.owner is not None:
            episode.aborted = True
            episode.owner.cancel()  # the agent's Python state cannot be resumed: restart
        raise _error(503, "the episode was aborted (its rollout is being drained)", "server_error")

    def _request_sampling(self, body: Json) -> Json:
        for name in _POLICY_FIELDS:
            if body.get(name) is not None and name not in self._warned:
                self._warned.add(name)
                log.warning(
                    "agent sampling overridden by the run's",
                    field=name,
                    asked=body[name],
                    used=getattr(self.ctx.sampling, name),
                )
        asked = {k: body[k] for k in ("stop", "stop_token_ids") if body.get(k) is not None}
        try:  # the agent's own stops, parsed at this edge
            typed = msgspec.convert(asked, SamplingParams)
        except msgspec.ValidationError as exc:
            raise _error(400, f"invalid stop: {exc}") from None
        return {k: getattr(typed, k) for k in asked}

    def _turn_text(self, turn: list[int], stop: str | None = None) -> str:
        """The turn's text; a matched ``stop`` string is cut off, as OpenAI's content
        excludes it (its tokens stay in the trained sample)."""
        tokenizer = self.ctx.tokenizer
        ids = turn[:-1] if turn and turn[-1] == tokenizer.eos_token_id else turn
        text = str(tokenizer.decode(ids, skip_special_tokens=False))
        if stop and (at := text.rfind(stop)) >= 0:
            text = text[:at]
        return text

    @staticmethod
    def _tool_call(episode: Episode, call: ToolCall, k: int) -> Json:
        """OpenAI's shape of one parsed call; its id names the tool for the result message."""
        cid = _call_id(episode, k)
        episode.call_names[cid] = call.name
        function = {"name": call.name, "arguments": arguments_text(call)}
        return {"id": cid, "type": "function", "function": function}

    def _reply(
        self,
        body: Json,
        episode: Episode,
        turn: list[int],
        parsed: tuple[str, list[ToolCall]] | None,
        reason: str,
        start: float,
    ) -> Json:
        text, calls = parsed or ("", [])
        tool_calls = [self._tool_call(episode, call, k) for k, call in enumerate(calls)]
        message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls or None}
        if parsed is not None:
            episode.history.append(message_key(message))
            record = episode.sample.metadata.setdefault("tool_calls", [])
            record.extend({"name": c.name, "error": None} for c in calls)
        s = episode.sample
        usage = {
            "prompt_tokens": len(s.prompt_tokens) + s.response_length - len(turn),
            "completion_tokens": len(turn),
        }
        return {
            "id": f"chatcmpl-{secrets.token_hex(6)}",
            "object": "chat.completion",
            "created": int(start),
            "model": body.get("model") or "asyncrl-policy",
            "choices": [
                {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
            ],
            "usage": {**usage, "total_tokens": usage["prompt_tokens"] + len(turn)},
        }


def _call_id(episode: Episode, k: int) -> str:
    """The id of the turn's ``k``-th call, the same in a reply and in its stream."""
    return f"call_{episode.calls}_{k}"


class _ReplyStream:
    """A finished turn as OpenAI's stream chunks: its text through a ``ToolStream`` when
    calls are parsed, so an agent that accumulates the deltas holds the reply's message;
    an empty reply (a spent budget) has no deltas."""

    def __init__(
        self,
        text: str = "",
        parser: ToolCallParser | None = None,
        call_id: Callable[[int], str] | None = None,
    ) -> None:
        self.text, self.parser, self.call_id = text, parser, call_id

    def deltas(self) -> list[Json]:
        if self.parser is not None and self.call_id is not None:
            return ToolStream(self.parser, self.call_id).finish(self.text)
        return [{"content": self.text}] if self.text else []

    def chunks(self, reply: Json, include_usage: bool) -> list[Json]:
        """The role chunk, the deltas, the finish, then the usage when asked for."""
        head = {key: reply[key] for key in ("id", "created", "model")}
        head["object"] = "chat.completion.chunk"

        def chunk(delta: Json, reason: str | None = None) -> Json:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return {**head, "choices": [choice]}

        deltas = [{"role": "assistant", "content": ""}, *self.deltas()]
        events = [*map(chunk, deltas), chunk({}, reply["choices"][0]["finish_reason"])]
        if include_usage:
            events.append({**head, "choices": [], "usage": reply["usage"]})
        return events


def _include_usage(body: Json) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


async def _write_sse(request: web.Request, events: list[Json]) -> web.StreamResponse:
    """``events`` as server-sent events (``data: {json}``), then ``data: [DONE]``."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    for event in events:
        await resp.write(sse(event))
    await resp.write(DONE)
    await resp.write_eof()
    return resp


def _first_difference(keys: list[Any], history: list[Any]) -> int:
    """Index of the first message that differs from ``history`` (or where it stops short)."""
    pairs = zip(keys, history, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(keys), len(history)))


#: Request fields this proxy cannot honour while training; refused rather than ignored.
_UNSUPPORTED = ("response_format", "functions", "function_call", "logit_bias", "audio")
_WHY = {
    "response_format": ": a grammar renormalises the engine's log-probs over the tokens it "
    "allows, and the trainer recomputes them over the whole vocabulary",
}


def _check_options(body: Json) -> None:
    for key in _UNSUPPORTED:
        if body.get(key) is not None:
            why = _WHY.get(key, "")
            raise _error(400, f"{key} is not supported by the training proxy{why}")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise _error(400, "logprobs are not returned by the training proxy (it records them)")
    _parses_tool_calls(body)
    if body.get("n") not in (None, 1):
        raise _error(400, "n > 1 is not supported: one episode is one conversation")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise _error(400, f"{key} must be a positive integer, got {value!r}")


def _parses_tool_calls(body: Json) -> bool:
    """``tool_choice``: ``auto`` parses calls, ``none`` does not; a forced call is a 400
    (its grammar would renormalise the log-probs the trainer recomputes unmasked)."""
    try:
        forced = forced_tools(body)
        parses = parses_tool_calls(body)
    except ApiError as exc:
        raise _error(400, exc.message) from None
    if forced is not None:
        choice = body["tool_choice"]
        why = _WHY["response_format"]
        raise _error(400, f"tool_choice {choice!r} is not supported by the training proxy{why}")
    return parses


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every refusal and failure in OpenAI's error shape (the client reads its message)."""
    try:
        return await handler(request)
    except ApiError as exc:
        body = exc.body if "error" in (exc.body or {}) else _error(exc.status, exc.message).body
        return json_response(body, exc.status)
    except web.HTTPException:
        raise
    except Exception as exc:  # the engine failed: the agent sees a 500 that says why
        log.warning("proxy call failed", path=request.path, error=repr(exc))
        message = f"{type(exc).__name__}: {exc}"
        return json_response(_error(500, message, "server_error").body, 500)
