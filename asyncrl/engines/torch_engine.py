"""TorchEngine: continuous batching over a Hugging Face causal LM with a KV cache.

One scheduler task owns the running batch and runs one step at a time in a worker
thread (the event loop stays free for HTTP and control calls)::

    step:  apply a pending weight update (a decode-step boundary)
           admit waiting requests: prefill them together, merge their KV into the batch
           decode one token for every running sequence
           finish sequences (EOS, stop token, stop string, length, abort) and drop their KV

The batch's KV cache is one ``DynamicCache`` of shape ``[batch, kv_heads, L, head_dim]``
per layer, left-padded: row ``i`` holds its tokens at the right end, ``mask[i]`` marks
real positions and ``positions[i]`` is its next position id. Merging new rows pads the
shorter side on the left; dropping rows selects the rest and trims columns that became
padding everywhere. The cache never holds a row's newest token: it is the next input.

Every sampled token is stamped with ``version``, the weight version that produced it.
Aborted requests return what they generated so far; ``pause("in_place")`` keeps the
batch and its KV, ``pause("retract")`` drops the KV and re-prefills later, and
``pause("abort")`` aborts everything and returns once every caller has its output.

Users: the HTTP server (``engines/server.py``), tests and ``bench/engine.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncrl.engines.base import (
    EngineLoad,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    PauseMode,
)
from asyncrl.engines.sampling import RowState, sample
from asyncrl.observe.logs import get_logger

log = get_logger("asyncrl.engine")


class EngineError(ValueError):
    """A request the engine cannot serve (the HTTP layer answers 400 with the message)."""


@dataclass(eq=False)
class _Seq:
    """One request's state, shared by its caller (event loop) and the step (thread)."""

    req: GenerateRequest
    row: RowState
    started: float
    prompt: list[int]  # what to prefill: the request's ids (plus output after a retract)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish: FinishReason | None = None
    aborted: bool = False
    queued: bool = True
    updated: asyncio.Event = field(default_factory=asyncio.Event)

    def snapshot(self) -> GenerateOutput:
        return GenerateOutput(
            rid=self.req.rid,
            output_ids=list(self.output),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=self.finish,
            prompt_tokens=len(self.req.input_ids),
            input_logprobs=self.input_logprobs,
            queued=self.queued and self.finish is not None,
            e2e_latency=time.monotonic() - self.started,
        )


class _Batch:
    """The running sequences and their left-padded KV cache."""

    def __init__(self) -> None:
        self.seqs: list[_Seq] = []
        self.cache: Any = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.positions = torch.zeros(0, dtype=torch.long)
        self.last = torch.zeros(0, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum()) + len(self.seqs)


class TorchEngine:
    """Continuous-batching engine; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        tokenizer: Any = None,
        max_running: int = 64,
        max_total_tokens: int = 1 << 18,
        version: int = 0,
        model_path: str = "",
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_running, self.max_total_tokens = max_running, max_total_tokens
        self.context_length = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.eos_ids = _eos_ids(model, tokenizer)
        self.version, self.model_path = version, model_path
        self._waiting: deque[_Seq] = deque()
        self._batch = _Batch()
        self._rids: dict[str, _Seq] = {}
        self._paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._wake = asyncio.Event()
        self._updates: deque[tuple[Any, asyncio.Future[None]]] = deque()
        self._seed = itertools.count(1)
        self._just_finished: list[_Seq] = []
        self._group_name = ""
        self._stepped = asyncio.Event()  # set after every step (pause waits on it)
        self.stats = {"steps": 0, "prefills": 0, "generated_tokens": 0}

    @classmethod
    def from_pretrained(
        cls, path: str, *, device: str = "cpu", dtype: str = "float32", **kwargs: Any
    ) -> TorchEngine:
        """Load a Hugging Face model directory (and its tokenizer, if it has one)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            tokenizer = None  # token-in/token-out still works; stop strings need one
        return cls(model.to(device), tokenizer=tokenizer, model_path=path, **kwargs)

    # -- lifecycle -----------------------------------------------------------------------
    async def run(self) -> None:
        """The scheduler loop; run it as a task for as long as the engine serves."""
        while True:
            if not self._has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await asyncio.to_thread(self._step)
            except Exception as exc:  # fail every caller loudly rather than hang them
                log.exception("engine step failed")
                self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
            for seq in [*self._batch.seqs, *self._just_finished]:
                seq.updated.set()
            self._stepped.set()

    def _has_work(self) -> bool:
        if self._updates:
            return True
        if self._paused:
            return any(s.aborted for s in self._rids.values())
        return bool(self._waiting or self._batch.seqs)

    def _fail_all(self, message: str) -> None:
        reason = FinishReason(
            type="abort", message=message, status_code=500, err_type="InternalServerError"
        )
        for seq in list(self._rids.values()):
            seq.finish = seq.finish or reason
            self._just_finished.append(seq)
        self._rids.clear()
        self._waiting.clear()
        self._batch = _Batch()

    # -- requests ------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Cumulative outputs as tokens arrive; the last one carries ``finish_reason``."""
        await self._resumed.wait()  # SGLang: a paused server holds new requests
        seq = self._admit(request)
        try:
            while True:
                await seq.updated.wait()
                seq.updated.clear()
                out = seq.snapshot()
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            if seq.finish is None:  # the caller went away: stop generating for it
                seq.aborted = True
                self._wake.set()

    def _admit(self, request: GenerateRequest) -> _Seq:
        self.check(request)
        seed = request.sampling.sampling_seed
        gen = torch.Generator().manual_seed(seed if seed is not None else next(self._seed))
        row = RowState(
            params=request.sampling,
            generator=gen,
            seen=torch.tensor(request.input_ids, dtype=torch.long)
            if request.sampling.repetition_penalty != 1.0
            else None,
            counts={},
            num_generated=0,
            blocked=self._blocked_ids(request),
        )
        seq = _Seq(request, row, time.monotonic(), list(request.input_ids))
        self._rids[request.rid] = seq
        self._waiting.append(seq)
        self._wake.set()
        return seq

    def check(self, request: GenerateRequest) -> None:
        """Raise ``EngineError`` (a 400) for a request this engine cannot serve."""
        request.sampling.verify()
        ids = request.input_ids
        if not ids:
            raise EngineError("input_ids is empty: the prompt needs at least one token")
        vocab = self._vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise EngineError(f"input_ids must be integers in [0, {vocab})")
        if len(ids) >= self.context_length:
            raise EngineError(
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
        if request.rid in self._rids:
            raise EngineError(f"Duplicate request ID detected: {request.rid}")
        if request.logprob_start_len > len(ids):
            raise EngineError(
                f"logprob_start_len ({request.logprob_start_len}) is greater than the "
                f"prompt length ({len(ids)})"
            )

    @property
    def _vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    def _blocked_ids(self, request: GenerateRequest) -> list[int]:
        p = request.sampling
        ids = [] if p.ignore_eos else list(self.eos_ids)
        return ids + list(p.stop_token_ids or [])

    def abort(self, rid: str = "", *, abort_all: bool = False) -> int:
        """Abort by rid prefix (SGLang matches prefixes) or all; returns how many."""
        if not abort_all and not rid:
            return 0
        hits = [s for r, s in self._rids.items() if abort_all or r.startswith(rid)]
        for seq in hits:
            seq.aborted = True
        self._wake.set()
        return len(hits)

    def load(self) -> EngineLoad:
        """Running and waiting requests and token usage."""
        return EngineLoad(
            num_running_reqs=len(self._batch),
            num_waiting_reqs=len(self._waiting),
            num_used_tokens=self._batch.num_tokens,
            max_total_num_tokens=self.max_total_tokens,
            paused=self._paused,
        )

    # -- pause, weights, memory ----------------------------------------------------------
    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating; see the module docstring for the three modes."""
        self._paused = True
        self._resumed.clear()
        if mode == "abort":
            for seq in list(self._rids.values()):
                seq.aborted = True
            self._wake.set()
            while self._rids:  # every caller gets its partial output before we return
                self._stepped.clear()
                await self._stepped.wait()
        elif mode == "retract":
            await self._at_boundary(self._retract)

    async def resume(self) -> None:
        """Continue after ``pause``."""
        self._paused = False
        self._resumed.set()
        self._wake.set()

    async def update_weights_from_disk(self, path: str, version: int | None) -> None:
        """Load every ``*.safetensors`` file of ``path`` at a step boundary."""
        tensors = await asyncio.to_thread(_read_safetensors, path)
        await self.update_weights_from_tensors(tensors, version)
        self.model_path = path

    async def update_weights_from_tensors(
        self, tensors: dict[str, torch.Tensor], version: int | None
    ) -> None:
        """Copy ``tensors`` (names as in ``state_dict``) into the model at a step boundary."""
        _check_names(self.model, tensors)
        await self._at_boundary(lambda: self._load(tensors, version))

    def _load(self, tensors: dict[str, torch.Tensor], version: int | None) -> None:
        params = self.model.state_dict(keep_vars=True)  # tied weights under each name
        with torch.no_grad():
            for name, t in tensors.items():
                params[name].copy_(t.to(params[name].device, params[name].dtype))
        if version is not None:
            self.version = version
        log.info("weights updated", version=self.version, tensors=len(tensors))

    async def _at_boundary(self, fn: Any) -> None:
        """Run ``fn`` in the step thread between two decode steps."""
        fut = asyncio.get_running_loop().create_future()
        self._updates.append((fn, fut))
        self._wake.set()
        await fut

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join the trainer's torch.distributed group (blocking rendezvous, in a thread)."""
        import torch.distributed as dist

        if dist.is_initialized():
            raise EngineError(f"a weights update group already exists ({self._group_name})")
        await asyncio.to_thread(
            dist.init_process_group,
            backend=backend,
            world_size=world_size,
            rank=rank,
            init_method=f"tcp://{master_address}:{master_port}",
        )
        self._group_name = group_name

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        version: int | None,
    ) -> None:
        """Receive each tensor by ``broadcast(src=0)`` in list order, then load them."""
        import torch.distributed as dist

        if not dist.is_initialized() or group_name != self._group_name:
            raise EngineError(f"no weights update group named {group_name!r}: init it first")
        if not len(names) == len(dtypes) == len(shapes):
            raise EngineError("names, dtypes and shapes must have the same length")
        tensors = {
            name: torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True)
        }
        _check_names(self.model, tensors)

        def receive() -> None:
            for t in tensors.values():
                dist.broadcast(t, src=0)

        await asyncio.to_thread(receive)
        await self.update_weights_from_tensors(tensors, version)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the group."""
        import torch.distributed as dist

        if dist.is_initialized() and group_name == self._group_name:
            await asyncio.to_thread(dist.destroy_process_group)
            self._group_name = ""

    async def flush_cache(self) -> bool:
        """Nothing is cached across requests; refuse while requests run, as SGLang does."""
        return not self._rids

    async def release_memory(self, tags: list[str] | None) -> None:
        """Free the KV cache (must be idle) and move weights to CPU if on an accelerator."""
        if self._rids:
            raise EngineError("release_memory_occupation needs an idle engine: pause first")
        if tags is None or "weights" in tags:
            await self._at_boundary(lambda: self.model.to("cpu"))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    async def resume_memory(self, tags: list[str] | None) -> None:
        """Move weights back to the engine's device."""
        if tags is None or "weights" in tags:
            await self._at_boundary(lambda: self.model.to(self.device))

    # -- the step (worker thread) --------------------------------------------------------
    @torch.inference_mode()
    def _step(self) -> None:
        self._just_finished = []
        self._apply_updates()
        self._drop(lambda s: s.aborted, abort=True)
        self._finish_waiting_aborted()
        if not self._paused:
            self._prefill_waiting()
            if self._batch.seqs:
                self._decode()
        self.stats["steps"] += 1

    def _apply_updates(self) -> None:
        while self._updates:
            fn, fut = self._updates.popleft()
            loop = fut.get_loop()
            try:
                fn()
            except Exception as exc:  # reported to the caller, the engine goes on
                loop.call_soon_threadsafe(_settle, fut, exc)
            else:
                loop.call_soon_threadsafe(_settle, fut, None)

    def _finish_waiting_aborted(self) -> None:
        for seq in [s for s in self._waiting if s.aborted]:
            self._waiting.remove(seq)
            seq.finish = FinishReason(type="abort", message="Abort in waiting queue")
            self._done(seq)

    def _done(self, seq: _Seq) -> None:
        self._just_finished.append(seq)
        self._rids.pop(seq.req.rid, None)

    def _prefill_waiting(self) -> None:
        new: list[_Seq] = []
        budget = self.max_total_tokens - self._batch.num_tokens
        while self._waiting and len(self._batch) + len(new) < self.max_running:
            head = self._waiting[0]
            need = len(head.prompt) + (head.req.sampling.max_new_tokens or 0)
            if new and need > budget:
                break
            budget -= need
            new.append(self._waiting.popleft())
        if new:
            self._prefill(new)

    def _prefill(self, seqs: list[_Seq]) -> None:
        width = max(len(s.prompt) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s.prompt) :] = torch.tensor(s.prompt)
            mask[i, width - len(s.prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            use_cache=True,
        )
        self.stats["prefills"] += 1
        logits = out.logits.float()
        for i, s in enumerate(seqs):
            s.queued = False
            if s.req.logprob_start_len >= 0 and s.input_logprobs is None:
                s.input_logprobs = _prompt_logprobs(logits[i], ids[i], len(s.prompt), s.req)
        self._merge(seqs, out.past_key_values, mask, logits[:, -1, :])

    def _merge(self, seqs: list[_Seq], cache: Any, mask: torch.Tensor, last: torch.Tensor) -> None:
        b = self._batch
        tokens = [self._first_token(s, last[i]) for i, s in enumerate(seqs)]
        new_pos = mask.sum(-1)
        if not b.seqs:
            b.cache, b.mask, b.positions = cache, mask, new_pos
            b.last, b.seqs = torch.tensor(tokens), list(seqs)
        else:
            width = max(b.mask.shape[1], mask.shape[1])
            b.cache = _concat_caches(b.cache, b.mask.shape[1], cache, mask.shape[1], width)
            b.mask = torch.cat([_lpad(b.mask, width), _lpad(mask, width)])
            b.positions = torch.cat([b.positions, new_pos])
            b.last = torch.cat([b.last, torch.tensor(tokens)])
            b.seqs += seqs
        self._finish_checks()

    def _first_token(self, seq: _Seq, logits: torch.Tensor) -> int:
        if seq.req.sampling.max_new_tokens == 0:
            # SGLang: prefill only (prompt log-probs); the row leaves at the finish check.
            seq.finish = FinishReason(type="length", length=0)
            return 0
        return self._sample(seq, logits)

    def _decode(self) -> None:
        b = self._batch
        mask = torch.cat([b.mask, torch.ones(len(b), 1, dtype=torch.long)], dim=1)
        out = self.model(
            input_ids=b.last[:, None].to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=b.positions[:, None].to(self.device),
            past_key_values=b.cache,
            use_cache=True,
        )
        b.cache, b.mask, b.positions = out.past_key_values, mask, b.positions + 1
        logits = out.logits[:, -1, :].float()
        b.last = torch.tensor([self._sample(s, logits[i]) for i, s in enumerate(b.seqs)])
        self._finish_checks()

    def _sample(self, seq: _Seq, logits: torch.Tensor) -> int:
        token, logprob = sample(logits.cpu(), seq.row)
        seq.output.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(self.version)
        seq.row.num_generated += 1
        seq.row.counts[token] = seq.row.counts.get(token, 0) + 1
        if seq.row.seen is not None:
            seq.row.seen = torch.cat([seq.row.seen, torch.tensor([token])])
        self.stats["generated_tokens"] += 1
        return token

    def _finish_checks(self) -> None:
        for seq, pos in zip(self._batch.seqs, self._batch.positions.tolist(), strict=True):
            if seq.finish is None:
                seq.finish = self._finish_reason(seq, pos)
        self._drop(lambda s: s.finish is not None, abort=False)

    def _finish_reason(self, seq: _Seq, position: int) -> FinishReason | None:
        p, token = seq.req.sampling, seq.output[-1]
        if seq.row.num_generated >= p.min_new_tokens:
            if token in (p.stop_token_ids or ()) or (not p.ignore_eos and token in self.eos_ids):
                return FinishReason(type="stop", matched=token)
            matched = self._stop_string(seq)
            if matched is not None:
                return FinishReason(type="stop", matched=matched)
        limit = p.max_new_tokens
        if limit is not None and len(seq.output) >= limit:
            return FinishReason(type="length", length=limit)
        if position + 1 >= self.context_length:
            return FinishReason(type="length", length=len(seq.output))
        return None

    def _stop_string(self, seq: _Seq) -> str | None:
        stops = seq.req.sampling.stop_strings
        if not stops or self.tokenizer is None:
            return None
        longest = max(len(s) for s in stops)
        tail = self.tokenizer.decode(seq.output[-(longest + 8) :])
        newest = self.tokenizer.decode(seq.output[-1:])
        window = tail[-(longest + len(newest)) :]
        return next((s for s in stops if s in window), None)

    def _drop(self, done: Any, *, abort: bool) -> None:
        b = self._batch
        keep = [i for i, s in enumerate(b.seqs) if not done(s)]
        if len(keep) == len(b.seqs):
            return
        for i, s in enumerate(b.seqs):
            if i not in keep:
                if abort and s.finish is None:
                    s.finish = FinishReason(type="abort", message="Aborted")
                self._done(s)
        if not keep:
            self._batch = _Batch()
            return
        index = torch.tensor(keep)
        b.cache.batch_select_indices(index.to(self.device))
        b.seqs = [b.seqs[i] for i in keep]
        b.mask, b.positions, b.last = b.mask[index], b.positions[index], b.last[index]
        _trim_left(b)

    def _retract(self) -> None:
        """Put running sequences back in the queue; their KV is recomputed on resume."""
        for seq in reversed(self._batch.seqs):
            seq.prompt = [*seq.req.input_ids, *seq.output]
            self._waiting.appendleft(seq)
        self._batch = _Batch()

    # -- helpers used by tests and the server ---------------------------------------------
    @property
    def paused(self) -> bool:
        """True between ``pause`` and ``resume``."""
        return self._paused


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _lpad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad the last dimension of ``t`` with zeros to ``width``."""
    pad = width - t.shape[-1]
    return t if pad == 0 else torch.nn.functional.pad(t, (pad, 0))


def _concat_caches(a: Any, wa: int, b: Any, wb: int, width: int) -> Any:
    """Batch-concatenate two left-padded caches of widths ``wa``/``wb`` to ``width``."""
    from transformers import DynamicCache

    layers = []
    for la, lb in zip(a.layers, b.layers, strict=True):
        keys = torch.cat([_lpad_kv(la.keys, width), _lpad_kv(lb.keys, width)])
        values = torch.cat([_lpad_kv(la.values, width), _lpad_kv(lb.values, width)])
        layers.append((keys, values))
    return DynamicCache(ddp_cache_data=layers)


def _lpad_kv(t: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad ``[b, heads, L, d]`` along L."""
    pad = width - t.shape[2]
    return t if pad == 0 else torch.nn.functional.pad(t, (0, 0, pad, 0))


def _trim_left(b: _Batch) -> None:
    """Drop leading columns that are padding in every row (after rows left the batch)."""
    live = b.mask.any(dim=0).nonzero()
    start = int(live[0]) if live.numel() else b.mask.shape[1]
    if start == 0:
        return
    b.mask = b.mask[:, start:]
    for layer in b.cache.layers:
        layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]


def _prompt_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, n: int, req: GenerateRequest
) -> list[float | None]:
    """Teacher-forced log-probs of prompt tokens from ``logprob_start_len`` (first: None)."""
    start = ids.shape[0] - n
    logp = torch.log_softmax(logits[start : start + n - 1], -1)
    values = logp.gather(-1, ids[start + 1 : start + n, None].to(logp.device)).squeeze(-1)
    out: list[float | None] = [None, *values.tolist()]
    return out[req.logprob_start_len :]


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None)
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def _check_names(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    known = model.state_dict(keep_vars=True)
    unknown = sorted(set(tensors) - set(known))
    if unknown:
        raise EngineError(f"unknown weight names: {unknown[:5]}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(known[name].shape):
            raise EngineError(
                f"{name}: shape {tuple(t.shape)} does not match {tuple(known[name].shape)}"
            )


with contextlib.suppress(Exception):  # keep torch from oversubscribing the event loop's core
    torch.set_num_interop_threads(1)
