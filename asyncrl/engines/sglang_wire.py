"""The SGLang wire as the client reads and writes it: records, errors and reply parsing.

Pure (no sockets): the result and error types callers see, the parsing of ``/generate``
replies in every shape ``docs/sglang_api.md`` records (sections 1.3, 1.6, 1.7, 3.5, 4.2
and 5.1), SSE line framing, and the checks on the ``sampling_params`` a client may send.
``client/sglang.py`` re-exports the public names; callers import them from there.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import aiohttp
import msgspec

from asyncrl.engines.base import FinishReason, SamplingParams

#: ``finish_reason.message`` prefixes of a request aborted before it started (5.1).
_QUEUED_ABORTS = ("Abort in waiting queue", "Abort before prefill")


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
    #: None: one broadcast per tensor; "flattened_bucket": one of all their bytes.
    load_format: str | None = None


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


class StreamState:
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
        """Fold one chunk in; the cumulative result so far."""
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


def stream_failure(chunk: dict[str, Any], url: str) -> SGLangError | None:
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


async def sse_events(content: aiohttp.StreamReader, url: str) -> AsyncIterator[Any]:
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
    struct.verify()
    if struct.n != 1:
        raise ValueError(f"sampling_params.n is {struct.n}; send n requests with distinct rids")
    return sent


def generate_body(
    input_ids: Sequence[int],
    sampling_params: SamplingParams | Mapping[str, Any] | None,
    rid: str,
    *,
    return_logprob: bool = True,
    stream: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``/generate`` body (section 1.1); ``extra`` adds top-level keys (``lora_path``)."""
    return {
        **(extra or {}),
        "input_ids": list(input_ids),
        "rid": rid,
        "sampling_params": sampling_dict(sampling_params),
        "return_logprob": return_logprob,
        "stream": stream,
    }


def _non_defaults(params: SamplingParams) -> dict[str, Any]:
    out = {}
    for field in msgspec.structs.fields(params):
        default = field.default
        if default is msgspec.NODEFAULT:
            default = field.default_factory()
        if (value := getattr(params, field.name)) != default:
            out[field.encode_name] = msgspec.to_builtins(value)
    return out


def version_tuple(text: Any) -> tuple[int, ...] | None:
    """``"0.5.21rc1"`` -> ``(0, 5, 21)``; None when the text holds no version."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or ""))
    return None if match is None else tuple(int(g or 0) for g in match.groups())


def load_count(load: Any) -> int:
    """Running plus waiting requests in a ``/v1/loads`` or ``/get_load`` answer (as slime)."""
    if isinstance(load, list):
        return sum(load_count(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return load_count(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    running, waiting = load.get("num_running_reqs", 0), load.get("num_waiting_reqs", 0)
    return (running if isinstance(running, int) else 0) + (
        waiting if isinstance(waiting, int) else 0
    )


def router_refused(status: int, payload: Any) -> bool:
    """A router's 503 "no_available_workers": nothing was forwarded, so a retry is safe."""
    error = payload.get("error") if isinstance(payload, dict) else None
    return status == 503 and isinstance(error, dict) and error.get("code") == "no_available_workers"
