"""The OpenAI-compatible routes of the embedded server (``docs/sglang_api.md`` section 3).

``/v1/chat/completions`` applies the tokenizer's chat template (or takes ``input_ids``)
and ``/v1/completions`` takes text or token ids; both run the same engine requests as
``/generate``, through the traffic gate, and answer in OpenAI's shapes plus SGLang's
extras (``matched_stop``, ``metadata.weight_version``, token ids and ``meta_info`` on
request). Refusals are OpenAI's top-level error object (3.5).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from asyncrl.engines.base import FinishReason, GenerateOutput, GenerateRequest, SamplingParams
from asyncrl.engines.server.generate_wire import (
    Json,
    TokenTexts,
    answer,
    bad_request,
    check_fits,
    coerce,
    decode_output,
    encode_text,
    failed_status,
    field,
    invalid_body,
    json_response,
    meta_info,
    openai_error,
    request_ids,
    version_spans,
    version_text,
)
from asyncrl.engines.server.tool_stream import (
    ToolStream,
    arguments_text,
    content_of,
    forced_call_grammar,
    new_call_id,
    parses_tool_calls,
)

if TYPE_CHECKING:
    from asyncrl.engines.server.app import EngineServer


class OpenAIRoutes:
    """Section 3's routes over one ``EngineServer``."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.engine = server.engine

    def register(self, router: web.UrlDispatcher) -> None:
        """Add ``/v1/chat/completions`` and ``/v1/completions`` to ``router``."""
        router.add_post("/v1/chat/completions", self.chat_completions)
        router.add_post("/v1/completions", self.completions)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``: the chat template, then the native path (3.1-3.3)."""
        body, big = await self.server.read(request)
        call = await self.server.off_loop(
            big, lambda: OpenAICall.parse(body, [self._chat_prompt(body)], self.server, chat=True)
        )
        return await self._openai(request, call)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``: ``prompt`` as text(s) or token ids (3.4)."""
        body, big = await self.server.read(request)
        context = self.server.context_length

        def parse() -> OpenAICall:
            prompts = _completion_prompts(body, self.engine.tokenizer, context)
            return OpenAICall.parse(body, prompts, self.server, chat=False)

        return await self._openai(request, await self.server.off_loop(big, parse))

    async def _openai(self, request: web.Request, call: OpenAICall) -> web.StreamResponse:
        for item in call.requests:
            self.engine.check(item)
        async with self.server.gate.generating():
            if call.stream:
                deltas = OpenAIStream(call, self.engine.tokenizer)
                return await self.server.stream(
                    request,
                    call.requests,
                    deltas.render,
                    tail=deltas.tail,
                    error=lambda exc: openai_error(str(exc)),
                )
            finals = await self.server.collect(call.requests)
            if (failure := failed_status(finals)) is not None:
                raise failure
            reply = call.reply(finals, version_text(self.engine), self.engine.version_names)
            return await answer(request, json_response(reply))

    def _chat_prompt(self, body: Json) -> list[int]:
        """``input_ids`` as given (0.5.15+), else the tokenizer's chat template."""
        if body.get("input_ids") is not None:
            return coerce("input_ids", body["input_ids"], list)
        messages, tokenizer = body.get("messages"), self.engine.tokenizer
        if not isinstance(messages, list) or not messages:
            raise invalid_body("messages: expected a non-empty list of messages")
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template: use /v1/completions")
        return chat_template_ids(tokenizer, messages, body, self.server.context_length)


#: OpenAI request key -> SGLang sampling key (SGLang's extras keep their names).
_OPENAI_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_regex": "stop_regex",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "n": "n",
    "seed": "sampling_seed",
    "min_tokens": "min_new_tokens",
    "logit_bias": "logit_bias",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "regex": "regex",
    "ebnf": "ebnf",
    "json_schema": "json_schema",
    "custom_params": "custom_params",
}
_NON_STREAM_ONLY = ("return_token_ids", "return_prompt_token_ids", "return_meta_info")


def response_format(body: Json) -> dict[str, str]:
    """The sampling key ``response_format`` asks for, as SGLang maps it: ``json_object``
    is ``json_schema: {"type": "object"}``, ``json_schema`` its schema; ``text`` none."""
    fmt = body.get("response_format")
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema: expected a JSON schema object")
        return {"json_schema": json.dumps(schema)}
    raise bad_request(
        f"response_format type {kind!r} is not supported: use 'text', 'json_object' or "
        "'json_schema'"
    )


def chat_template_ids(
    tokenizer: Any, messages: list[Any], body: Json, context: int | None = None
) -> list[int]:
    """Render ``messages`` with the tokenizer's chat template and tokenize the text (a
    400 first when it cannot fit ``context`` tokens)."""
    import jinja2

    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid_body("chat_template_kwargs: expected an object")
    cont = field(body, "continue_final_message", bool, False)
    try:
        text = tokenizer.apply_chat_template(
            [_flat_message(m) for m in messages],
            tools=body.get("tools"),
            tokenize=False,
            add_generation_prompt=not cont,
            continue_final_message=cont,
            **kwargs,
        )
    except (jinja2.TemplateError, TypeError, KeyError) as exc:
        raise bad_request(f"the chat template failed on these messages: {exc}") from None
    check_fits(tokenizer, text, context)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _flat_message(message: Any) -> Json:
    """A message whose content is text (OpenAI content parts are joined)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise invalid_body(f"messages: each message needs a string role, got {message!r}")
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {**message, "content": content or ""}


def _completion_prompts(body: Json, tokenizer: Any, context: int | None) -> list[list[int]]:
    """``prompt``: a string, strings, token ids or lists of token ids (3.4)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [encode_text(tokenizer, prompt, context)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [encode_text(tokenizer, p, context) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            return prompt
        return [prompt]
    raise invalid_body(f"prompt: expected text, texts or token ids, got {prompt!r}")


def openai_sampling(
    body: Json, max_tokens: int | None, forced_call: str | None = None
) -> SamplingParams:
    """The OpenAI sampling fields as ``SamplingParams`` (checked like /generate's);
    ``forced_call``: the EBNF of a call ``tool_choice`` forces."""
    raw = {dst: body[src] for src, dst in _OPENAI_SAMPLING.items() if body.get(src) is not None}
    raw |= response_format(body)
    if forced_call is not None:
        if raw.keys() & {"json_schema", "regex", "ebnf"}:
            raise bad_request("a forced tool_choice cannot be combined with another constraint")
        raw["ebnf"] = forced_call
    raw["max_new_tokens"] = max_tokens
    try:
        params = msgspec.convert(raw, SamplingParams)
    except msgspec.ValidationError as exc:
        raise bad_request(str(exc)) from None
    params.verify()
    return params


def _logprob_options(body: Json, chat: bool) -> tuple[bool, int]:
    """Whether to return token log-probs, and how many alternatives per token.

    Chat: ``logprobs`` (a bool) and ``top_logprobs`` (which needs ``logprobs``);
    completions: ``logprobs`` is the number of alternatives, where 0 still means "on".
    """
    key = "top_logprobs" if chat else "logprobs"
    if chat:
        on, top = field(body, "logprobs", bool, False), field(body, key, int, 0)
    else:
        top = field(body, key, int)
        on, top = top is not None, top or 0
    if top < 0:
        raise bad_request(f"{key} must be >= 0, got {top}")
    if top and not on:
        raise bad_request("top_logprobs needs logprobs=true")
    return on, top


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
    top_logprobs: int
    include_usage: bool
    echo: bool
    extras: frozenset[str]
    tokenizer: Any = None
    #: The server's tool-call parser when the chat call offers tools and its
    #: ``tool_choice`` lets calls be parsed, else None.
    tool_parser: Any = None
    created: int = msgspec.field(default_factory=lambda: int(time.time()))

    @classmethod
    def parse(
        cls, body: Json, prompts: list[list[int]], server: EngineServer, *, chat: bool
    ) -> OpenAICall:
        """Validate the body (3.1, 3.4); refusals are 400s in the OpenAI error shape."""
        parses = parses_tool_calls(body) and chat and bool(body.get("tools"))
        tool_parser = server.tool_call_parser if parses else None
        stream = field(body, "stream", bool, False)
        extras = frozenset(k for k in _NON_STREAM_ONLY if field(body, k, bool, False))
        if stream and extras:
            raise bad_request(f"{sorted(extras)} are not supported with stream=true")
        logprobs, top = _logprob_options(body, chat)
        default = None if chat else 16
        max_tokens = field(body, "max_completion_tokens", int) if chat else None
        max_tokens = field(body, "max_tokens", int, default) if max_tokens is None else max_tokens
        if not chat and max_tokens is not None and max_tokens <= 0:
            raise bad_request(f"max_tokens must be positive, got {max_tokens}")
        forced = forced_call_grammar(body, tool_parser) if chat else None
        params = openai_sampling(body, max_tokens, forced)
        echo = not chat and field(body, "echo", bool, False)
        rid = body.get("rid")
        rids = request_ids(rid, len(prompts), params.n)
        requests = [
            GenerateRequest(
                rid=r,
                input_ids=prompts[k // params.n],
                sampling=params,
                return_logprob=True,
                top_logprobs_num=top,
                logprob_start_len=0 if echo and logprobs else -1,  # the prompt's, echoed
            )
            for k, r in enumerate(rids)
        ]
        options = body.get("stream_options") or {}
        model = body.get("model")
        return cls(
            id=rid if isinstance(rid, str) else rids[0],
            chat=chat,
            prompts=prompts,
            model=model if isinstance(model, str) else server.served_model_name,
            requests=requests,
            n=params.n,
            stream=stream,
            logprobs=logprobs,
            top_logprobs=top,
            include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
            echo=echo,
            extras=extras,
            tokenizer=server.engine.tokenizer,
            tool_parser=tool_parser,
        )

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
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def token_logprobs(
        self, k: int, out: GenerateOutput, start: int = 0, prompt: bool = True
    ) -> tuple[Any, ...]:
        """Choice ``k``'s ids, log-probs and alternatives from output token ``start``; with
        ``echo`` and ``prompt`` the prompt's come first (the first one's are null)."""
        ids, lps = out.output_ids[start:], list(out.logprobs[start:])
        tops = None if out.top_logprobs is None else out.top_logprobs[start:]
        if self.echo and prompt and out.input_logprobs is not None:
            prompt = self.requests[k].input_ids
            ids, lps = [*prompt, *ids], [*out.input_logprobs, *lps]
            if tops is not None:
                tops = [*(out.input_top_logprobs or [None] * len(prompt)), *tops]
        return ids, lps, tops

    def logprobs_json(
        self,
        ids: list[int],
        logprobs: list[float | None],
        tops: list[list[tuple[float, int]] | None] | None,
        offset: int = 0,
    ) -> Any:
        """Chat: ``{"content": [...]}``; completions: tokens, offsets, logprobs and the
        alternatives as ``{token: logprob}`` per position (3.2, 3.4). ``tops`` holds each
        token's ``(logprob, id)`` alternatives when ``top_logprobs`` asked for them."""
        if not self.logprobs:
            return None
        texts = TokenTexts(self.tokenizer)

        def name(token: int) -> str:
            text = texts(token)
            return str(token) if text is None else text

        tokens = [name(t) for t in ids]
        if self.chat:
            rows = tops or [[] for _ in ids]
            return {
                "content": [
                    {
                        **_chat_logprob(t, lp),
                        "top_logprobs": [_chat_logprob(name(i), v) for v, i in r or ()],
                    }
                    for t, lp, r in zip(tokens, logprobs, rows, strict=True)
                ]
            }
        offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        top = (
            None
            if tops is None
            else [None if row is None else {name(i): v for v, i in row} for row in tops]
        )
        return {
            "text_offset": offsets,
            "token_logprobs": logprobs,
            "tokens": tokens,
            "top_logprobs": top,
        }

    def choice(
        self, k: int, out: GenerateOutput, version: str, names: dict[int, str] | None = None
    ) -> Json:
        """One non-stream choice."""
        reason, matched = _openai_finish(out.finish_reason)
        text = self.text(k, out)
        lps = self.logprobs_json(*self.token_logprobs(k, out))
        calls = self.tool_calls(text)
        if calls:
            text, reason = content_of(self.tool_parser, text) or None, "tool_calls"
        body: Json = (
            {
                "index": k,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "reasoning_content": None,
                    "tool_calls": calls or None,
                },
                "logprobs": lps,
            }
            if self.chat
            else {"index": k, "text": text, "logprobs": lps}
        )
        body |= {"finish_reason": reason, "matched_stop": matched}
        request = self.requests[k]
        if "return_token_ids" in self.extras:
            body["prompt_token_ids"] = request.input_ids
            body["response_token_ids" if self.chat else "token_ids"] = out.output_ids
        if "return_prompt_token_ids" in self.extras:
            body["prompt_token_ids"] = request.input_ids
        if "return_meta_info" in self.extras:
            body["meta_info"] = meta_info(
                request, out, version, text_in_logprobs=False, tokenizer=self.tokenizer, names=names
            )
        return body

    def tool_calls(self, text: str) -> list[Json]:
        """The well-formed tool calls the parser finds in ``text``, in OpenAI's shape."""
        if self.tool_parser is None:
            return []
        found = [c for c in self.tool_parser.parse(text) if c.error is None]
        return [
            {
                "id": new_call_id(i),
                "index": i,
                "type": "function",
                "function": {"name": c.name, "arguments": arguments_text(c)},
            }
            for i, c in enumerate(found)
        ]

    def reply(
        self, finals: list[GenerateOutput], version: str, names: dict[int, str] | None = None
    ) -> Json:
        """The whole non-stream response (3.2, 3.4)."""
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self.choice(k, out, version, names) for k, out in enumerate(finals)],
            "usage": self.usage(finals),
            "metadata": {
                "weight_version": version,
                "weight_versions": version_spans(finals[0].versions, names),
            },
        }

    def chunk(self, choices: list[Json], **extra: Any) -> Json:
        """A stream chunk around ``choices``."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


class OpenAIStream:
    """Turns cumulative engine outputs into OpenAI deltas per choice (3.3).

    Text that ends in an incomplete UTF-8 character is held back until it completes; a stop
    string already sent before the final trim cannot be taken back (SGLang has the same
    limit). With a tool-call parser, each choice's text goes through a ``ToolStream``:
    content and ``tool_calls`` deltas as they settle, a finish reason of ``tool_calls``
    when a call went out, and the tokens' log-probs on the next chunk that goes out.
    """

    def __init__(self, call: OpenAICall, tokenizer: Any) -> None:
        n = len(call.requests)
        self.call = call
        self.opened = [False] * n
        self.sent_text = [""] * n
        self.sent_ids = [0] * n
        self.echoed: set[int] = set()  # choices whose prompt log-probs went out
        self.finals: list[GenerateOutput] = []
        self.tools = [ToolStream(call.tool_parser) for _ in range(n)] if call.tool_parser else []

    def render(self, k: int, out: GenerateOutput) -> list[Json]:
        """The chunks for choice ``k``'s new output (none while nothing new is complete)."""
        call, final = self.call, out.finish_reason is not None
        events = []
        if call.chat and not self.opened[k]:
            self.opened[k] = True
            events.append(self._choice(k, {"role": "assistant", "content": ""}, None, None))
        text, prev = call.text(k, out), self.sent_text[k]
        delta = text[len(prev) :] if text.startswith(prev) else ""
        if delta.endswith("\ufffd") and not final:
            return events
        self.sent_text[k] = prev + delta
        if final:
            self.finals.append(out)
        if self.tools:
            return events + self._tool_chunks(k, out, text)
        lps = self._new_logprobs(k, out, len(prev))
        if delta or final:
            reason, matched = _openai_finish(out.finish_reason)
            content = {"content": delta} if call.chat else delta
            events.append(self._choice(k, content, reason, matched, lps))
        return events

    def _tool_chunks(self, k: int, out: GenerateOutput, text: str) -> list[Json]:
        """Choice ``k``'s settled content and calls; the last chunk carries the finish."""
        tools, final = self.tools[k], out.finish_reason is not None
        deltas = tools.finish(text) if final else tools.feed(text)
        if not deltas and not final:
            return []  # the new tokens' log-probs wait for a chunk
        lps = self._new_logprobs(k, out, 0)
        chunks = [
            self._choice(k, d, None, None, lps if i == 0 else None)
            for i, d in enumerate(deltas or [{"content": ""}])
        ]
        if final:
            reason, matched = _openai_finish(out.finish_reason)
            choice = chunks[-1]["choices"][0]
            choice["finish_reason"] = "tool_calls" if tools.calls else reason
            choice["matched_stop"] = matched
        return chunks

    def _new_logprobs(self, k: int, out: GenerateOutput, offset: int) -> Any:
        """The log-probs of choice ``k``'s tokens not sent yet (marks them sent)."""
        start, self.sent_ids[k] = self.sent_ids[k], len(out.output_ids)
        prompt = k not in self.echoed and out.input_logprobs is not None
        if prompt:
            self.echoed.add(k)
        return self.call.logprobs_json(*self.call.token_logprobs(k, out, start, prompt), offset)

    def _choice(
        self, k: int, delta: Any, reason: str | None, matched: Any, lps: Any = None
    ) -> Json:
        key = "delta" if self.call.chat else "text"
        choice = {
            "index": k,
            key: delta,
            "logprobs": lps,
            "finish_reason": reason,
            "matched_stop": matched,
        }
        return self.call.chunk([choice])

    def tail(self) -> list[Json]:
        """The usage chunk (empty choices) when ``stream_options.include_usage``."""
        if not self.call.include_usage:
            return []
        return [self.call.chunk([], usage=self.call.usage(self.finals))]


def _chat_logprob(token: str, logprob: float) -> Json:
    """One chat log-prob entry: the token's text, its UTF-8 bytes and its log-prob (3.2)."""
    return {"token": token, "bytes": list(token.encode()), "logprob": logprob}


def _openai_finish(reason: FinishReason | None) -> tuple[str | None, Any]:
    """OpenAI's ``finish_reason`` string and ``matched_stop``."""
    if reason is None:
        return None, None
    return reason.type, reason.matched if reason.type == "stop" else None
