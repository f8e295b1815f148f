"""The ``/generate`` wire of the embedded server: request parsing and reply formatting.

Pure translation between SGLang's JSON (``docs/sglang_api.md`` sections 1.1 to 1.7) and
the records of ``engines/base.py``, plus the error shapes (``ApiError``) and JSON helpers
every route shares; no engine calls, no traffic control::

    body (dict) -> parse_generate -> GenerateJob (engine requests, flattened per item)
    GenerateOutput -> meta_info / decode_output / finish_json -> the 1.3 object
"""

from __future__ import annotations

import time
import uuid
import weakref
from typing import Any

import msgspec
from aiohttp import web

from asyncrl.engines.base import FinishReason, GenerateOutput, GenerateRequest, SamplingParams

Json = dict[str, Any]
DONE = b"data: [DONE]\n\n"
QUEUED_ABORT = "Abort in waiting queue"
_SAMPLING_KEYS: tuple[str, ...] = SamplingParams.__struct_fields__
#: Top-level /generate keys whose feature this server lacks: refused when truthy.
_UNSUPPORTED = (
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "lora_path",
    "session_params",
    "return_hidden_states",
    "return_routed_experts",
    "custom_logit_processor",
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


# ----------------------------------------------------------------------------- bodies


def json_response(body: Any, status: int = 200) -> web.Response:
    """Compact JSON (msgspec writes NaN and infinities as null, never invalid JSON)."""
    return web.Response(
        body=msgspec.json.encode(body), status=status, content_type="application/json"
    )


def sse(obj: Any) -> bytes:
    """One server-sent event: ``data: <compact json>`` and a blank line (1.6)."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def too_large(size: int, limit: int) -> ApiError:
    """A body over the route's limit: refused before it is read whole (413)."""
    message = (
        f"the request body is {size} bytes or more, over this server's limit of "
        f"{limit} bytes (asyncrl serve --max-body-mb)"
    )
    return ApiError(413, message, {"error": {"message": message}})


async def read_body(request: web.Request, limit: int | None = None) -> bytes:
    """The body, refused (``too_large``) as soon as it passes ``limit`` bytes: by its
    declared length before any of it is read, or while a chunked one streams in."""
    if limit is None:
        return await request.read()
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(declared, limit)
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: web.Request, limit: int | None = None) -> Json:
    """The JSON object body (at most ``limit`` bytes); an empty body is ``{}`` (SGLang
    clients send ``{}`` anyway)."""
    return decode_json(await read_body(request, limit))


def decode_json(raw: bytes) -> Json:
    """A body's JSON object; an empty body is ``{}``."""
    if not raw.strip():
        return {}
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise invalid_body(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # nesting deeper than the decoder's stack
        raise invalid_body("the request body is nested too deeply") from None
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


def parse_version(value: Any, current: int = 0) -> tuple[int | None, str | None]:
    """A ``weight_version`` parameter as ``(the engine's int version, its name)``.

    SGLang takes any string. A number (``"42"`` or 42) is the version itself, unnamed;
    another string names a new version, ``current + 1`` (every token keeps an int
    version), and is what the server reports (``version_text``). None: not given."""
    if value is None:
        return None, None
    text = str(value).strip()
    if isinstance(value, bool) or not isinstance(value, str | int) or not text:
        raise ValueError(f"weight_version must be a string or an integer, got {value!r}")
    if text.lstrip("-").isdigit():
        return int(text), None
    return current + 1, text


def version_text(engine: Any, version: int | None = None) -> str:
    """How a server reports a weight version (default: the engine's): its name when a
    client gave it one, else the number."""
    v = engine.version if version is None else version
    return getattr(engine, "version_names", {}).get(v, str(v))


def parse_sampling(raw: Any) -> SamplingParams:
    """Validate one ``sampling_params`` object as SGLang 0.5.22+ does (1.2, 1.7); typed
    params (an in-process caller's, parsed at its own edge) are only checked."""
    if isinstance(raw, SamplingParams):
        params = raw
    elif not isinstance(raw, dict):
        raise contract_error(f"invalid type: expected a map for sampling_params, got {raw!r}")
    else:
        params = _convert_sampling(raw)
    try:
        params.verify()
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return params


def _convert_sampling(raw: dict[str, Any]) -> SamplingParams:
    if unknown := [key for key in raw if key not in _SAMPLING_KEYS]:
        expected = ", ".join(f"`{key}`" for key in _SAMPLING_KEYS)
        raise contract_error(f"unknown field `{unknown[0]}`, expected one of {expected}")
    try:
        return msgspec.convert(raw, SamplingParams)
    except msgspec.ValidationError as exc:
        raise contract_error(f"sampling_params: {exc}") from None


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


def parse_generate(body: Json, tokenizer: Any, context: int | None = None) -> GenerateJob:
    """Validate a ``/generate`` body (1.1) into engine requests; raises ``ApiError``.
    ``context``: the engine's, to refuse a text that cannot fit before tokenizing it."""
    for key in _UNSUPPORTED:
        if body.get(key):
            raise bad_request(f"{key} is not supported by this server")
    prompts, batch = _prompts(body, tokenizer, context)
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
            ("return_logprob", bool, False),
            ("logprob_start_len", int, -1),
            ("top_logprobs_num", int, 0),
        )
    }
    per_prompt = _token_ids_logprob(body.get("token_ids_logprob"), count)
    chosen = [ids for ids in per_prompt for _ in range(n)]
    if any(k < 0 for k in flags["top_logprobs_num"]):
        raise bad_request(f"top_logprobs_num must be >= 0, got {min(flags['top_logprobs_num'])}")
    rids = request_ids(body.get("rid"), count, n)
    requests = [
        GenerateRequest(
            rid=rids[k],
            input_ids=prompts[k // n],
            sampling=params[k // n],
            return_logprob=flags["return_logprob"][k],
            logprob_start_len=flags["logprob_start_len"][k],
            # SGLang reports alternatives only inside the logprob fields: none to compute
            top_logprobs_num=flags["top_logprobs_num"][k] if flags["return_logprob"][k] else 0,
            token_ids_logprob=chosen[k] if flags["return_logprob"][k] else None,
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


def _prompts(body: Json, tokenizer: Any, context: int | None) -> tuple[list[list[int]], bool]:
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
        return [encode_text(tokenizer, text, context)], False
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return [encode_text(tokenizer, t, context) for t in text], True
    raise invalid_body(f"text: expected a string or a non-empty list of strings, got {text!r}")


def encode_text(tokenizer: Any, text: str, context: int | None = None) -> list[int]:
    """Token ids of a text prompt; a 400 when the model has no tokenizer, or, before any
    tokenizing, when the text cannot fit ``context`` tokens (``check_fits``)."""
    if tokenizer is None:
        raise bad_request("text input needs a tokenizer and this model has none: send input_ids")
    check_fits(tokenizer, text, context)
    return list(tokenizer.encode(text))


_LONGEST: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the text bytes one token stands for: the longest vocabulary
    entry's UTF-8 length (a byte-level entry writes each byte as one character of one or
    two bytes, SentencePiece's space as three). Cached per tokenizer."""
    if tokenizer not in _LONGEST:
        vocab = tokenizer.get_vocab()
        _LONGEST[tokenizer] = max((len(t.encode()) for t in vocab), default=1) or 1
    return _LONGEST[tokenizer]


def check_fits(tokenizer: Any, text: str, context: int | None) -> None:
    """A 400 when ``text`` needs more than ``context`` tokens even if every token stood
    for the most bytes one can: tokens >= ceil(bytes / longest_token_bytes), so a huge
    prompt is refused without tokenizing it (docs/reliability.md)."""
    if context is None or len(text) <= context:  # no text of <= context chars is over
        return
    size = len(text.encode())
    least = -(-size // longest_token_bytes(tokenizer))
    if least > context:
        raise bad_request(
            f"The input ({size} bytes, at least {least} tokens) is longer than the model's "
            f"context length ({context} tokens)."
        )


def _per_prompt(body: Json, key: str, kind: type, default: Any, count: int) -> list[Any]:
    """A per-request field: a scalar for every prompt or a list with one per prompt. A
    bool must be a JSON boolean: SGLang's contract refuses ``"true"`` (``_strict_bool``)."""
    value = body.get(key)
    if value is None:
        return [default] * count
    if kind is bool:
        _strict_bool(value)
    if kind is int:
        _strict_int(value)
    if not isinstance(value, list):
        return [coerce(key, value, kind)] * count
    if len(value) != count:
        raise bad_request(f"{key} has {len(value)} entries for {count} prompts")
    return [default if v is None else coerce(key, v, kind) for v in value]


def _token_ids_logprob(value: Any, count: int) -> list[list[int] | None]:
    """``token_ids_logprob``: one list for every prompt, or a list per prompt; refused
    with the text SGLang 0.5.23's contract (``TokenIdsOrList``) gives."""
    if value is None:
        return [None] * count
    if not isinstance(value, list):
        raise contract_error(
            f"invalid type: {_unexpected(value)}, expected a value or an array of values "
            "for TokenIdsOrList"
        )
    if all(_is_int(v) for v in value):
        return [list(value)] * count
    for row in value:
        if not isinstance(row, list):
            raise contract_error(f"invalid type: {_unexpected(row)}, expected a sequence")
        for v in row:
            if not _is_int(v):
                raise contract_error(f"invalid type: {_unexpected(v)}, expected i64")
    if len(value) != count:
        raise bad_request(f"token_ids_logprob has {len(value)} entries for {count} prompts")
    return [list(row) for row in value]


def _strict_int(value: Any) -> None:
    """SGLang 0.5.23's contract for an ``Int64OrList``: JSON integers only."""
    if isinstance(value, list):
        bad = next((v for v in value if v is not None and not _is_int(v)), None)
        if bad is not None:
            raise contract_error(f"invalid type: {_unexpected(bad)}, expected i64")
    elif not _is_int(value):
        raise contract_error(
            f"invalid type: {_unexpected(value)}, expected a value or an array of values "
            "for Int64OrList"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _strict_bool(value: Any) -> None:
    """SGLang 0.5.23's JSON contract for a ``BoolOrList`` (``api_types``), its error text."""
    values = value if isinstance(value, list) else [value]
    for v in values:
        if not isinstance(v, bool):
            expected = (
                "a boolean"
                if isinstance(value, list)
                else "a value or an array of values for BoolOrList"
            )
            raise contract_error(f"invalid type: {_unexpected(v)}, expected {expected}")


def _unexpected(v: Any) -> str:
    """How serde (and so SGLang's contract) names a JSON value in an error."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{str(v).lower()}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else str(v)


def request_ids(rid: Any, count: int, n: int) -> list[str]:
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


def version_spans(versions: list[int], names: dict[int, str] | None = None) -> list[Json]:
    """``weight_versions``: ``[start, end)`` output-token ranges per weight version (1.3),
    each version by its name when it has one."""
    spans: list[Json] = []
    last = None
    for i, v in enumerate(versions):
        if spans and v == last:
            spans[-1]["end"] = i + 1
        else:
            text = (names or {}).get(v, str(v))
            spans.append({"version": text, "start": i, "end": i + 1})
        last = v
    return spans


def decode_output(tokenizer: Any, request: GenerateRequest, out: GenerateOutput) -> str:
    """``text``: a matched stop token's text is dropped and the text is cut before a
    matched stop string (not a ``stop_regex`` match: ``_stop_at``), unless
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
    if trim and isinstance(reason.matched, str) and (cut := _stop_at(text, reason.matched)) >= 0:
        text = text[:cut]
    return text


def _stop_at(text: str, matched: str) -> int:
    """Where SGLang's ``trim_matched_stop`` cuts: the first occurrence of ``matched`` (-1:
    none). A ``stop_regex`` hit reports its pattern, found only where it appears
    literally, so SGLang keeps a regex match in the text, and so does this server."""
    return text.find(matched)


def token_texts(tokenizer: Any, ids: list[int], wanted: bool) -> list[str | None]:
    """Each token's own text when ``wanted`` (and a tokenizer exists), else None each."""
    if not wanted or tokenizer is None:
        return [None] * len(ids)
    return [tokenizer.decode([t]) for t in ids]


def meta_info(
    request: GenerateRequest,
    out: GenerateOutput,
    version: str,
    *,
    text_in_logprobs: bool,
    tokenizer: Any,
    names: dict[int, str] | None = None,
) -> Json:
    """The ``meta_info`` object (1.3); a queued abort has no prompt or cached tokens (5.1)."""
    meta: Json = {"id": out.rid, "finish_reason": finish_json(out.finish_reason)}
    if not out.queued:
        meta["prompt_tokens"] = out.prompt_tokens
    meta["weight_version"] = version
    meta["num_retractions"] = 0
    if request.return_logprob:
        meta |= _logprob_fields(request, out, tokenizer if text_in_logprobs else None)
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = len(out.output_ids)
    if not out.queued:
        meta["cached_tokens"] = out.cached_tokens
    if out.finish_reason is not None:
        meta["weight_versions"] = version_spans(out.versions, names)
        meta["e2e_latency"] = out.e2e_latency
        meta["response_sent_to_client_ts"] = time.time()
    return meta


def _logprob_fields(request: GenerateRequest, out: GenerateOutput, tokenizer: Any) -> Json:
    """``[logprob, token_id, text | null]`` triples; the text only with a tokenizer given.

    With ``top_logprobs_num`` also ``output_top_logprobs`` / ``input_top_logprobs``: per
    position a list of such triples, most likely first (null at the first prompt token);
    with ``token_ids_logprob`` likewise ``*_token_ids_logprobs``, in the ids' order.
    """
    prompt = request.input_ids[max(request.logprob_start_len, 0) :]
    prompt = prompt if out.input_logprobs is not None else []
    texts = token_texts(tokenizer, prompt + out.output_ids, tokenizer is not None)
    inputs = zip(out.input_logprobs or [], prompt, texts, strict=False)
    outputs = zip(out.logprobs, out.output_ids, texts[len(prompt) :], strict=True)
    fields: Json = {
        "input_token_logprobs": [list(triple) for triple in inputs],
        "output_token_logprobs": [list(triple) for triple in outputs],
        "output_token_logprobs_length": len(out.output_ids),
    }
    text_of = TokenTexts(tokenizer)
    if request.top_logprobs_num > 0:
        fields["input_top_logprobs"] = [text_of.triples(r) for r in out.input_top_logprobs or []]
        fields["output_top_logprobs"] = [text_of.triples(r) for r in out.top_logprobs or []]
    if request.token_ids_logprob is not None:
        fields["input_token_ids_logprobs"] = [
            text_of.triples(r) for r in out.input_token_ids_logprobs or []
        ]
        fields["output_token_ids_logprobs"] = [
            text_of.triples(r) for r in out.token_ids_logprobs or []
        ]
    return fields


class TokenTexts:
    """Each token id's own text (None without a tokenizer), decoded once per reply."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str | None:
        """The text of ``token``, or None when there is no tokenizer."""
        if self.tokenizer is None:
            return None
        if token not in self.cache:
            self.cache[token] = self.tokenizer.decode([token])
        return self.cache[token]

    def triples(self, row: list[tuple[float, int]] | None) -> list[list[Any]] | None:
        """One position's alternatives as ``[logprob, token_id, text | null]`` triples."""
        return None if row is None else [[lp, t, self(t)] for lp, t in row]


def failed_status(outs: list[GenerateOutput]) -> ApiError | None:
    """An engine-side abort with an HTTP status is an HTTP error for non-stream callers."""
    for out in outs:
        reason = out.finish_reason
        if reason is not None and reason.status_code and reason.status_code >= 400:
            message = reason.message or "request failed"
            if reason.status_code == 400:
                return bad_request(message)
            kind = reason.err_type or "InternalServerError"
            return ApiError(
                reason.status_code, message, openai_error(message, reason.status_code, kind)
            )
    return None


def stream_error(exc: Exception) -> Json:
    """A refusal after the stream started: one error event, then ``[DONE]`` (1.6)."""
    return {
        "error": {
            "message": str(exc),
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }


async def answer(request: web.Request, resp: web.Response) -> web.Response:
    """Write a reply inside the traffic gate, so a pause returns only after it went out."""
    await resp.prepare(request)
    await resp.write_eof()
    return resp
