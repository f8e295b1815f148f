"""The inference-engine seam: the records, the protocol and the checks every engine uses.

An engine is token-in/token-out (no step re-tokenises text): token ids in, token ids out,
with the behaviour log-prob and the weight version of every sampled token. The records
follow SGLang's ``/generate`` (``docs/sglang_api.md`` section 1), so the HTTP server is a
thin translation and the same rollout code drives any engine, SGLang server or router.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from asyncrl.errors import EngineError

PauseMode = Literal["abort", "in_place", "retract"]

#: Constrained-decoding keys: at most one per request (an engine may refuse them all).
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
#: SGLang's ``json_schema`` value for "any JSON".
ANY_JSON = "$$ANY$$"
#: Below this temperature sampling is greedy (SGLang's ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-6
#: The most completions one request may ask for (``n``): each is a sequence in the batch.
MAX_N = 256


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's ``sampling_params`` (section 1.2); unknown keys are refused on decode.

    Every key is honoured or refused, never ignored: the engine applies the sampling,
    stop and length keys; the HTTP server applies ``n`` (one request per sample), the
    text keys (``skip_special_tokens``, ``spaces_between_special_tokens``,
    ``no_stop_trim``) and ``stream_interval``; ``custom_params`` only feeds a custom logit
    processor, which SGLang also ignores without one; an engine that cannot constrain
    decoding refuses ``GRAMMAR_KEYS``.
    """

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    def verify(self) -> None:
        """Raise ``ValueError`` with SGLang's wording for an out-of-range value."""
        checks = (
            (self.max_new_tokens is None or self.max_new_tokens >= 0,
             "max_new_tokens must be >= 0"),
            (self.min_new_tokens >= 0, "min_new_tokens must be >= 0"),
            (self.max_new_tokens is None or self.min_new_tokens <= self.max_new_tokens,
             "min_new_tokens must be <= max_new_tokens"),
            (math.isfinite(self.temperature) and self.temperature >= 0,
             "temperature must be a finite number >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (disable) or >= 1"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (0 < self.repetition_penalty <= 2, "repetition_penalty must be in (0, 2]"),
            (1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}]"),
            (len(self.stop_strings) <= 32, "at most 32 stop strings"),
            (self.stream_interval is None or self.stream_interval >= 0,
             "stream_interval must be >= 0 (0 or null: every token)"),
        )  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for pattern in self.stop_regexes:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regex: {exc}") from None
        if sum(getattr(self, key) is not None for key in GRAMMAR_KEYS) > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(key, spec)`` of the request's constraint (one of ``GRAMMAR_KEYS``), or None."""
        return next(
            ((k, getattr(self, k)) for k in GRAMMAR_KEYS if getattr(self, k) is not None), None
        )

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def stop_regexes(self) -> list[str]:
        """``stop_regex`` as a list of patterns."""
        if self.stop_regex is None:
            return []
        return [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex)

    @property
    def greedy(self) -> bool:
        """Temperature below ``SAMPLING_EPS`` or top_k 1: take the argmax. SGLang's rule:
        dividing logits by a temperature that small overflows them to inf and NaN."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def logprob_temperature(self) -> float:
        """``T`` of the reported log-probs ``log_softmax(z / T)``: 1 when greedy."""
        return 1.0 if self.greedy else self.temperature


class GenerateRequest(msgspec.Struct, kw_only=True):
    """One sequence to generate (``n > 1`` is expanded by the server into ``rid_i``)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    return_logprob: bool = False
    #: -1: output log-probs only; 0..P: prompt log-probs from that position too.
    logprob_start_len: int = -1
    #: k > 0: the k most likely tokens and their log-probs at every position as well.
    top_logprobs_num: int = 0
    #: These tokens' log-probs at every position as well (SGLang's ``token_ids_logprob``).
    token_ids_logprob: list[int] | None = None


class FinishReason(msgspec.Struct, kw_only=True, omit_defaults=True):
    """SGLang's ``finish_reason`` object (section 1.4)."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class GenerateOutput(msgspec.Struct, kw_only=True):
    """Everything generated so far for one request (cumulative; the last one is final).

    ``logprobs[i]``, ``versions[i]`` and ``top_logprobs[i]`` belong to ``output_ids[i]``.
    ``top_logprobs`` rows are ``(logprob, token_id)`` pairs, most likely first, from the
    same distribution as ``logprobs`` (None unless ``top_logprobs_num > 0``);
    ``token_ids_logprobs`` rows hold the requested ``token_ids_logprob`` in request order.
    The ``input_`` lists cover the prompt from ``logprob_start_len``, with None at the
    first prompt position. ``cached_tokens`` counts prompt tokens whose KV came from a
    cache instead of this request's prefill. ``queued`` is True when the request was
    aborted before it started (SGLang's "Abort in waiting queue").
    """

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    input_logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[float, int]]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    token_ids_logprobs: list[list[tuple[float, int]]] | None = None
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    queued: bool = False
    e2e_latency: float = 0.0


class EngineLoad(msgspec.Struct, kw_only=True):
    """What ``/v1/loads`` reports for the engine's one data-parallel rank."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    paused: bool = False


class InferenceEngine(Protocol):
    """What the HTTP server, the rollout actor's engine host and the tests use of an
    engine (``TorchEngine``, ``VLLMEngine``, ``SimEngine``). Versions are ints (trained
    batches); ``version_names`` keeps a client's string names of them."""

    version: int
    version_names: dict[int, str]
    model_path: str
    model: Any  # its ``config`` is the HF config
    tokenizer: Any  # None: token ids only
    context_length: int
    device: Any  # a torch.device

    async def run(self) -> None:
        """The engine's loop; the server runs it as a task while it serves."""
        ...

    def check(self, request: GenerateRequest) -> None:
        """Raise ``EngineError`` (a 400) for a request this engine cannot serve."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Cumulative outputs as tokens arrive; the last carries ``finish_reason``."""
        ...

    def abort(self, rid: str = "", *, abort_all: bool = False, prefix: bool = False) -> int:
        """Abort by rid (or rid prefix) or all; callers get their partial output. A count."""
        ...

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating; ``abort`` returns once every caller has its partial output."""
        ...

    async def resume(self) -> None:
        """Continue after ``pause`` (SGLang's ``continue_generation``)."""
        ...

    async def update_weights_from_disk(self, path: str, version: int | None) -> None:
        """Load a safetensors/HF directory between decode steps; set ``version``."""
        ...

    async def update_weights_from_tensors(
        self, tensors: dict[str, Any], version: int | None
    ) -> None:
        """Copy named tensors into the model between decode steps; set ``version``."""
        ...

    async def flush_cache(self) -> bool:
        """Drop cached KV; False (nothing done) while requests run or wait."""
        ...

    async def release_memory(self, tags: list[str] | None) -> None:
        """Free the KV cache and/or move weights off the device (colocated training)."""
        ...

    async def resume_memory(self, tags: list[str] | None) -> None:
        """Undo ``release_memory``."""
        ...

    def load(self) -> EngineLoad:
        """Running and waiting requests and token usage."""
        ...


@runtime_checkable
class GroupEngine(InferenceEngine, Protocol):
    """An engine that joins the trainer's weight group (torch, vLLM): SGLang's distributed
    update routes. The server refuses those routes for any other engine."""

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join the group (a blocking rendezvous, off the event loop)."""
        ...

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        version: int | None,
        *,
        flattened: bool = False,
    ) -> None:
        """Receive a version by broadcast from rank 0, then load it."""
        ...

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the group."""
        ...


# -- what every engine does with a request ------------------------------------------------
class Tracked(Protocol):
    """An engine's record of one request: set ``updated`` on progress, ``aborted`` to stop."""

    finish: FinishReason | None
    aborted: bool
    updated: asyncio.Event

    def snapshot(self) -> GenerateOutput: ...


def refuse_grammar(p: SamplingParams, engine: str) -> None:
    """``EngineError`` naming the constraint, for an engine without constrained decoding."""
    for key in GRAMMAR_KEYS:
        if getattr(p, key) is not None:
            raise EngineError(f"{key} (constrained decoding) is not supported by {engine}")


def check_prompt(
    request: GenerateRequest, vocab_size: int, context_length: int, live: Mapping[str, Any]
) -> None:
    """The checks of every engine (SGLang's wording): sampling values, a non-empty prompt
    of ids in the vocabulary that fits the context, and a request id not in ``live``."""
    request.sampling.verify()
    ids = request.input_ids
    if not ids:
        raise EngineError("input_ids is empty: the prompt needs at least one token")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in ids):
        raise EngineError(f"input_ids must be integers in [0, {vocab_size})")
    if len(ids) >= context_length:
        raise EngineError(
            f"The input ({len(ids)} tokens) is longer than the model's context length "
            f"({context_length} tokens)."
        )
    asked = request.sampling.max_new_tokens
    if asked is not None and len(ids) + asked > context_length:  # SGLang 0.5.23, not cut
        raise EngineError(
            f"Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {len(ids) + asked} tokens: "
            f"{len(ids)} tokens from the input messages and {asked} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit."
        )
    if request.rid in live:
        raise EngineError(f"Duplicate request ID detected: {request.rid}")
    _check_sampling_ids(request.sampling, vocab_size)


def _check_sampling_ids(p: SamplingParams, vocab_size: int) -> None:
    """Token ids in ``stop_token_ids`` and ``logit_bias`` must be in the vocabulary: one
    outside it would fail the engine's whole step, every running request with it."""
    for token in p.stop_token_ids or ():
        if not 0 <= int(token) < vocab_size:
            raise EngineError(f"stop_token_ids: {token} is not in [0, {vocab_size})")
    for key in p.logit_bias or {}:
        try:
            token = int(key)
        except ValueError:
            raise EngineError(f"logit_bias: key {key!r} is not a token id") from None
        if not 0 <= token < vocab_size:
            raise EngineError(f"logit_bias: token {token} is not in [0, {vocab_size})")


async def follow(record: Tracked, wake: asyncio.Event) -> AsyncIterator[GenerateOutput]:
    """Cumulative outputs of ``record`` until it finishes; a caller that goes away aborts
    it (``wake`` tells the engine loop)."""
    try:
        while True:
            await record.updated.wait()
            record.updated.clear()
            out = record.snapshot()
            yield out
            if out.finish_reason is not None:
                return
    finally:
        if record.finish is None:  # the caller went away: stop generating for it
            record.aborted = True
            wake.set()


def mark_aborted(
    live: Mapping[str, Tracked], rid: str, abort_all: bool, *, prefix: bool = False
) -> int:
    """Flag the requests ``rid`` names, or all; returns how many.

    SGLang's ``/abort_request`` (0.5.23): a ``rid`` that names no live request aborts
    nothing (the tokenizer manager looks it up exactly); one that does aborts it and every
    request whose id starts with it (the scheduler's ``startswith``). ``prefix``: every
    request whose id starts with ``rid``, live or not (asyncrl's own cancel of a group,
    whose request ids start ``<group uid>/``)."""
    if not abort_all and (not rid or (not prefix and rid not in live)):
        return 0
    hits = [r for k, r in live.items() if abort_all or k.startswith(rid)]
    for record in hits:
        record.aborted = True
    return len(hits)
