"""One request inside the torch engine: its state (``Seq``), how it is admitted
(``new_seq``), when it ends (``finish_reason``), and how waiting prompts are grouped for a
prefill (``similar_lengths``)."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.engines.base import FinishReason, GenerateOutput, GenerateRequest
from asyncrl.engines.torch.sampling import RowState


@dataclass(eq=False)
class Seq:
    """One request's state, shared by its caller (event loop) and the step (thread)."""

    req: GenerateRequest
    row: RowState
    started: float
    prompt: list[int]  # what to prefill: the request's ids (plus output after a retract)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[float, int]]] | None = None  # per output token, when asked for
    input_logprobs: list[float | None] | None = None
    input_top: list[list[tuple[float, int]] | None] | None = None
    chosen: list[list[tuple[float, int]]] | None = None  # token_ids_logprob, per token
    input_chosen: list[list[tuple[float, int]] | None] | None = None
    stop_regex: list[re.Pattern[str]] = field(default_factory=list)
    grammar: Any = None  # an xgrammar matcher for a constrained request (grammar.py)
    finish: FinishReason | None = None
    cached: int = 0  # prompt tokens served by a copy of their KV (``served_tokens``)
    aborted: bool = False
    queued: bool = True
    updated: asyncio.Event = field(default_factory=asyncio.Event)

    def snapshot(self) -> GenerateOutput:
        """What the caller sees now (copies: the step thread keeps appending)."""
        return GenerateOutput(
            rid=self.req.rid,
            output_ids=list(self.output),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            top_logprobs=None if self.top is None else list(self.top),
            finish_reason=self.finish,
            prompt_tokens=len(self.req.input_ids),
            cached_tokens=self.cached,
            input_logprobs=self.input_logprobs,
            input_top_logprobs=self.input_top,
            token_ids_logprobs=None if self.chosen is None else list(self.chosen),
            input_token_ids_logprobs=self.input_chosen,
            queued=self.queued and self.finish is not None,
            e2e_latency=time.monotonic() - self.started,
        )


def new_seq(request: GenerateRequest, seed: int | None, eos: list[int]) -> Seq:
    """``request``'s state as the step sees it: its sampler row (``seed``'s stream; EOS and
    stop ids blocked before ``min_new_tokens``), its stop patterns, its prompt to prefill."""
    p = request.sampling
    row = RowState(
        params=p,
        generator=None if seed is None else torch.Generator().manual_seed(seed),
        seen=(
            torch.tensor(request.input_ids, dtype=torch.long)
            if p.repetition_penalty != 1.0
            else None
        ),
        counts={},
        num_generated=0,
        blocked=([] if p.ignore_eos else list(eos)) + list(p.stop_token_ids or []),
    )
    seq = Seq(request, row, time.monotonic(), list(request.input_ids))
    seq.stop_regex = [re.compile(pattern) for pattern in p.stop_regexes]
    if request.top_logprobs_num > 0:
        seq.top = []
    if request.token_ids_logprob is not None:
        seq.chosen = []
    return seq


def finish_reason(
    seq: Seq, position: int, eos: list[int], tokenizer: Any, context_length: int
) -> FinishReason | None:
    """Why ``seq`` ends after its newest token (at ``position``), or None: a stop token or
    EOS (once ``min_new_tokens`` are out), a stop string or regex, its length, the context."""
    p, token = seq.req.sampling, seq.output[-1]
    if seq.row.num_generated >= p.min_new_tokens and (
        token in (p.stop_token_ids or ()) or (not p.ignore_eos and token in eos)
    ):
        return FinishReason(type="stop", matched=token)
    # Stop strings and regexes are not held back by min_new_tokens (SGLang's check)
    matched = _stop_string(seq, tokenizer)
    if matched is None:
        matched = _stop_regex(seq, tokenizer)
    if matched is not None:
        return FinishReason(type="stop", matched=matched)
    if seq.grammar is not None and seq.grammar.is_terminated():  # it took a stop token
        return FinishReason(type="stop", matched=token)
    limit = p.max_new_tokens
    if limit is not None and len(seq.output) >= limit:
        return FinishReason(type="length", length=limit)
    if position + 1 >= context_length:
        return FinishReason(type="length", length=len(seq.output))
    return None


def _stop_string(seq: Seq, tokenizer: Any) -> str | None:
    """A stop string in the newest text (the window a new token can complete)."""
    stops = seq.req.sampling.stop_strings
    if not stops or tokenizer is None:
        return None
    longest = max(len(s) for s in stops)
    tail = tokenizer.decode(seq.output[-(longest + 8) :])
    newest = tokenizer.decode(seq.output[-1:])
    window = tail[-(longest + len(newest)) :]
    return next((s for s in stops if s in window), None)


def _stop_regex(seq: Seq, tokenizer: Any) -> str | None:
    """The first ``stop_regex`` pattern found in the decoded output (SGLang reports the
    pattern as ``matched``). The whole output is decoded, as a match may span any
    length: O(output) per step, only for requests that set ``stop_regex``."""
    if not seq.stop_regex or tokenizer is None:
        return None
    text = tokenizer.decode(seq.output)
    return next((p.pattern for p in seq.stop_regex if p.search(text)), None)


def similar_lengths(seqs: list[Seq], waste: float = 0.25) -> list[list[Seq]]:
    """``seqs`` by prompt length in chunks whose left padding is at most ``waste`` of
    their tokens: one prefill of prompts of 16 and 64 tokens would compute 64 for each."""
    chunks: list[list[Seq]] = []
    tokens = 0
    for seq in sorted(seqs, key=lambda s: len(s.prompt)):
        width = len(seq.prompt)  # the longest so far: the chunk's width if it joins
        if chunks and (len(chunks[-1]) + 1) * width <= (1 + waste) * (tokens + width):
            chunks[-1].append(seq)
            tokens += width
        else:
            chunks.append([seq])
            tokens = width
    return chunks


def shared_prompts(seqs: list[Seq]) -> tuple[list[Seq], list[int]]:
    """The distinct prompts of ``seqs`` (the first holder of each) and, for every seq, the
    index of its prompt among them: ``seqs[i].prompt == unique[rows[i]].prompt``; a
    prefill computes each once and copies its KV to every row that holds it."""
    index: dict[tuple[int, ...], int] = {}
    unique: list[Seq] = []
    rows = []
    for seq in seqs:
        key = tuple(seq.prompt)
        if key not in index:
            index[key] = len(unique)
            unique.append(seq)
        rows.append(index[key])
    return unique, rows


def served_tokens(seq: Seq, scored: bool) -> int:
    """``cached_tokens`` of a row whose prompt KV was copied, as SGLang counts a radix
    hit: at most the prompt's length less one (its last token is always computed), and
    none past ``logprob_start_len`` for a request that asks for prompt log-probs."""
    served = min(len(seq.prompt), len(seq.req.input_ids)) - 1
    return max(0, min(served, seq.req.logprob_start_len) if scored else served)


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """Every end-of-sequence id the model's generation config, config and tokenizer name."""
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None)
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))
