"""TorchEngine: continuous batching over a Hugging Face causal LM with a KV cache.

One scheduler task owns the running batch and runs one step at a time in a worker
thread (the event loop stays free for HTTP and control calls)::

    step:  apply a pending weight update (a decode-step boundary)
           admit waiting requests: prefill them together, merge their KV into the batch
           decode one token for every running sequence
           finish sequences (EOS, stop token, stop string or regex, length, abort) and
           drop their KV

The running batch and its left-padded KV cache are a ``KVBatch`` (``kv_batch.py``): rows
are merged in after their prefill and selected out when they finish. A request is
admitted while rows x the longest final length (prompt plus ``max_new_tokens``) stays
within ``max_total_tokens``, by default what ``mem_fraction`` of the free memory holds at
the cache's peak (SGLang's ``--max-total-tokens``, ``--mem-fraction-static``).

Every sampled token is stamped with ``version``, the weight version that produced it.
Aborted requests return what they generated so far; ``pause("in_place")`` keeps the
batch and its KV, ``pause("retract")`` drops the KV and re-prefills later, and
``pause("abort")`` aborts everything and returns once every caller has its output.
A request without a ``sampling_seed`` gets one drawn from the engine's own stream
(``seed``: the same seed replays the same stream, 0 by default as in vLLM, None draws
from the OS); a job mixes each engine's seed with the actor's name, so no two engines
sample in lockstep.

No KV outlives its request (there is no prefix cache), so ``cached_tokens`` is 0: a
resumed partial rollout and a retracted request prefill their whole prompt again.

One request's state and finish rules are ``requests.py``; the sampler ``sampling.py``; the
batch's KV ``kv_batch.py``. Users: the HTTP server (``engines/server/app.py``), tests and
``bench/engine.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from asyncrl.engines.base import (
    EngineLoad,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    PauseMode,
    check_prompt,
    follow,
    mark_aborted,
)
from asyncrl.engines.config import EngineConfig
from asyncrl.engines.torch import cpu_linear as cpu_linear
from asyncrl.engines.torch.heap_trim import HeapTrimmer
from asyncrl.engines.torch.kv_batch import (
    KVBatch,
    available_memory,
    kv_bytes_per_position,
    kv_position_budget,
    new_cache,
)
from asyncrl.engines.torch.lean_forward import lean_forward
from asyncrl.engines.torch.requests import Seq, eos_ids, finish_reason, new_seq, similar_lengths
from asyncrl.engines.torch.sampling import Sampled, prompt_logprobs, sample_rows
from asyncrl.engines.torch.updates import WeightUpdates
from asyncrl.errors import EngineError
from asyncrl.observe.logs import get_logger
from asyncrl.sdpa_kernels import varying_shapes
from asyncrl.wire.messages import BlobManifest

log = get_logger("asyncrl.engine")


class TorchEngine:
    """Continuous-batching engine; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        tokenizer: Any = None,
        max_running: int = 64,
        max_total_tokens: int | None = None,
        mem_fraction: float = 0.2,
        version: int = 0,
        model_path: str = "",
        seed: int | str | None = 0,
        packed: bool = True,
        lean: bool = True,
    ) -> None:
        self.model = model.eval()
        cpu_linear.use_for(model, packed=packed)
        self._lean = lean_forward(model, packed=packed) if lean else None
        # transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns).
        forward = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward else "past_key_values"
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_running = max_running
        if not 0 < mem_fraction <= 1 or (max_total_tokens is not None and max_total_tokens < 1):
            raise ValueError(f"mem_fraction must be in (0, 1] and max_total_tokens >= 1, got "
                             f"{mem_fraction} and {max_total_tokens}")  # fmt: skip
        # SGLang's --max-total-tokens, or what --mem-fraction-static of the free memory holds
        self.max_total_tokens = max_total_tokens or kv_position_budget(
            kv_bytes_per_position(model.config, next(model.parameters()).dtype),
            available_memory(self.device),
            mem_fraction,
        )
        self.context_length = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.eos_ids = eos_ids(model, tokenizer)
        self.version, self.model_path = version, model_path
        #: SGLang clients' names of versions (``weight_version`` strings; routes).
        self.version_names: dict[int, str] = {}
        self.base_path = model_path  # what adapter versions merge onto
        self._waiting: deque[Seq] = deque()
        self._batch: KVBatch[Seq] = KVBatch()
        self._rids: dict[str, Seq] = {}
        self._paused = False
        self.torn = False  # a failed in-place update left a mix of versions: stay paused
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._wake = asyncio.Event()
        self._updates: deque[tuple[Any, asyncio.Future[None]]] = deque()
        # Requests without a sampling_seed get one drawn from this stream: the same seed
        # gives the same stream (0 by default, as vLLM's engines); None draws from the OS
        # (a restarted actor's: ``rollout/engines.py::engine_seed``).
        self._seeds = random.Random(seed)
        self._just_finished: list[Seq] = []
        self.weights = WeightUpdates(self)
        self._stepped = asyncio.Event()  # set after every step (pause waits on it)
        self._steps: ThreadPoolExecutor | None = None  # the step thread, while run() runs
        # The KV and activations live in host memory on CPU: give what is freed back.
        self._heap = HeapTrimmer() if self.device.type == "cpu" else None
        self.stats: dict[str, float] = {"steps": 0, "prefills": 0, "generated_tokens": 0,
                                        "update_pause_s": 0.0}  # fmt: skip

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

    @classmethod
    def from_config(
        cls, cfg: EngineConfig, *, seed: int | str | None, version: int = 0
    ) -> TorchEngine:
        """The engine ``cfg`` describes (``rollout.engine``, ``asyncrl serve``'s flags);
        ``seed``: its sampling stream (``cfg.seed`` mixed as the caller decides)."""
        if not cfg.model_path:
            raise ValueError("the torch engine needs model_path (an HF model directory)")
        return cls.from_pretrained(
            cfg.model_path, device=cfg.device, dtype=cfg.dtype, max_running=cfg.max_running,
            max_total_tokens=cfg.max_total_tokens, mem_fraction=cfg.mem_fraction,
            packed=cfg.packed_weights, lean=cfg.lean_forward, seed=seed, version=version,
        )  # fmt: skip

    # -- lifecycle -----------------------------------------------------------------------
    async def run(self) -> None:
        """The scheduler loop; run it as a task for as long as the engine serves.

        Every step runs on one thread of its own: OpenMP keeps a team of worker threads
        per calling thread, and the default executor's changing workers each started a
        team that spun against the last one's (a 1-sequence step of SmolLM2-135M on 2
        threads: 57 ms from ``asyncio.to_thread``, 41 ms from one thread).
        """
        loop = asyncio.get_running_loop()
        self._steps = steps = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        try:
            while True:
                if not self._has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                try:
                    await loop.run_in_executor(steps, self._step)
                except Exception as exc:  # fail every caller loudly rather than hang them
                    log.exception("engine step failed")
                    self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
                for seq in [*self._batch.seqs, *self._just_finished]:
                    seq.updated.set()
                self._stepped.set()
        finally:  # a step under way finishes on its thread, which then exits
            self._steps = None
            steps.shutdown(wait=False)

    async def set_threads(self, threads: int) -> None:
        """Run the engine's steps on ``threads`` intra-op threads from now on. OpenMP keeps
        the count per calling thread, so it is set on the step thread itself."""
        torch.set_num_threads(threads)  # for a step thread that starts later
        if self._steps is not None:
            await asyncio.get_running_loop().run_in_executor(
                self._steps, torch.set_num_threads, threads
            )

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
        self._batch = KVBatch()

    # -- requests ------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Cumulative outputs as tokens arrive; the last one carries ``finish_reason``."""
        await self._resumed.wait()  # SGLang: a paused server holds new requests
        seq = self._admit(request)
        if self.torn:  # nothing samples from a mix of two versions: the partial goes back
            seq.aborted = True
        async for out in follow(seq, self._wake):
            yield out

    def _admit(self, request: GenerateRequest) -> Seq:
        self.check(request)
        seed = request.sampling.sampling_seed
        if seed is None and not request.sampling.greedy:  # probes leave the stream alone
            seed = self._seeds.getrandbits(63)
        seq = new_seq(request, seed, self.eos_ids)
        self._rids[request.rid] = seq
        self._waiting.append(seq)
        self._wake.set()
        return seq

    def check(self, request: GenerateRequest) -> None:
        """Raise ``EngineError`` (a 400) for a request this engine cannot serve."""
        check_prompt(request, self._vocab_size, self.context_length, self._rids)
        ids = request.input_ids
        if request.logprob_start_len > len(ids):
            raise EngineError(
                f"logprob_start_len ({request.logprob_start_len}) is greater than the "
                f"prompt length ({len(ids)})"
            )
        if request.top_logprobs_num < 0:
            raise EngineError(f"top_logprobs_num must be >= 0, got {request.top_logprobs_num}")
        p = request.sampling
        if (p.stop_strings or p.stop_regexes) and self.tokenizer is None:
            raise EngineError(
                "stop and stop_regex match decoded text and this model has no tokenizer: "
                "use stop_token_ids"
            )

    @property
    def _vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    def abort(self, rid: str = "", *, abort_all: bool = False, prefix: bool = False) -> int:
        """Abort as SGLang's ``/abort_request`` does, by every rid that starts with
        ``prefix``, or all (``base.mark_aborted``); returns how many."""
        hits = mark_aborted(self._rids, rid, abort_all, prefix=prefix)
        self._wake.set()
        return hits

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
        """Continue after ``pause`` (not while the weights are torn: see
        ``update_weights_in_place``)."""
        if self.torn:
            log.warning("resume refused: the weights are torn until an update completes")
            return
        self._paused = False
        self._resumed.set()
        self._wake.set()

    # SGLang's weight routes (``updates.py``)
    async def update_weights_from_disk(self, path: str, version: int | None) -> None:
        """Load every ``*.safetensors`` file of ``path`` at a step boundary."""
        await self.weights.from_disk(path, version)

    async def update_weights_from_tensors(
        self, tensors: dict[str, torch.Tensor], version: int | None
    ) -> None:
        """Copy ``tensors`` (``state_dict`` names) into the model at a step boundary."""
        await self.weights.from_tensors(tensors, version)

    def takes_in_place(self, manifest: BlobManifest | None) -> bool:
        """Whether ``update_weights_in_place`` can write ``manifest``'s tensors."""
        return self.weights.takes_in_place(manifest)

    async def update_weights_in_place(
        self, fill: Callable[[dict[str, torch.Tensor]], Awaitable[object]], version: int
    ) -> None:
        """Write a new version straight into the model's tensors during a pause."""
        await self.weights.in_place(fill, version)

    def _invalidate(self) -> None:
        """Drop the copies made of the weights (packed, fused): they are made again."""
        cpu_linear.invalidate(self.model)
        if self._lean is not None:
            self._lean.invalidate()

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
        """Join the trainer's group as SGLang does (blocking rendezvous, in a thread)."""
        await self.weights.join_group(master_address, master_port, rank, world_size,
                                      group_name, backend)  # fmt: skip

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
        """Receive the tensors by ``broadcast(src=0)``, then load them."""
        await self.weights.from_distributed(names, dtypes, shapes, group_name, version,
                                            flattened=flattened)  # fmt: skip

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the group; ``EngineError`` when no group of that name was joined."""
        await self.weights.leave_group(group_name)

    async def flush_cache(self) -> bool:
        """Nothing is cached across requests; refuse while requests run, as SGLang does."""
        return not self._rids

    async def release_memory(self, tags: list[str] | None) -> None:
        """Free the KV cache (must be idle) and move weights to CPU if on an accelerator.
        On the CPU that frees the packed and fused copies of the weights (``cpu_linear``),
        as large as the linear weights themselves; the first step after ``resume_memory``
        makes them again."""
        if self._rids:
            raise EngineError("release_memory_occupation needs an idle engine: pause first")
        if tags is None or "weights" in tags:

            def release() -> None:
                self.model.to("cpu")
                self._invalidate()

            await self._at_boundary(release)
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
        if self._heap is not None:
            self._heap.maybe()

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

    def _done(self, seq: Seq) -> None:
        self._just_finished.append(seq)
        self._rids.pop(seq.req.rid, None)

    def _prefill_waiting(self) -> None:
        """Admit waiting requests while the cache at its fullest fits ``max_total_tokens``
        positions: rows x the longest final length, as every row is padded to the longest
        (``kv_batch.py``). An empty batch admits one whatever its length."""
        new: list[Seq] = []
        rows = len(self._batch)
        longest = max(map(self._final_length, self._batch.seqs), default=0)
        while self._waiting and rows + len(new) < self.max_running:
            width = max(longest, self._final_length(self._waiting[0]))
            if (rows or new) and (rows + len(new) + 1) * width > self.max_total_tokens:
                break
            longest = width
            new.append(self._waiting.popleft())
        for chunk in similar_lengths(new):
            self._prefill(chunk)

    def _final_length(self, seq: Seq) -> int:
        """Positions ``seq`` holds when it ends: its prompt and all it may generate."""
        budget = seq.req.sampling.max_new_tokens
        if budget is None:
            return self.context_length
        return min(len(seq.req.input_ids) + budget, self.context_length)

    def _prefill(self, seqs: list[Seq]) -> None:
        width = max(len(s.prompt) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s.prompt) :] = torch.tensor(s.prompt)
            mask[i, width - len(s.prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # Only a request for prompt log-probs needs logits at every prompt position; the
        # rest need the last one (a [b, width, V] projection is most of a short prompt's
        # prefill with a 49k vocabulary, and its fp32 copy hundreds of MB).
        scored = [s.req.logprob_start_len >= 0 and s.input_logprobs is None for s in seqs]
        cache = new_cache()
        logits = self._forward(ids, mask, positions, cache, keep=0 if any(scored) else 1)
        self.stats["prefills"] += 1
        for i, s in enumerate(seqs):
            s.queued = False
            if scored[i]:
                s.input_logprobs, s.input_top = prompt_logprobs(
                    logits[i, width - len(s.prompt) :],
                    s.prompt,
                    s.req.logprob_start_len,
                    s.req.top_logprobs_num,
                    temperature=s.row.params.logprob_temperature,
                )
        self._merge(seqs, cache, mask, logits[:, -1, :].float())

    def _merge(self, seqs: list[Seq], cache: Any, mask: torch.Tensor, last: torch.Tensor) -> None:
        tokens = [0] * len(seqs)  # placeholders for rows that leave at the finish check
        live = []
        for i, s in enumerate(seqs):
            if s.req.sampling.max_new_tokens == 0:  # SGLang: prefill only (prompt log-probs)
                s.finish = FinishReason(type="length", length=0)
            else:
                live.append(i)
        if live:
            sampled = self._sample([seqs[i] for i in live], last[live])
            for i, token in zip(live, sampled, strict=True):
                tokens[i] = token
        self._batch.add(seqs, cache, mask, tokens)
        self._finish_checks()

    def _decode(self) -> None:
        b = self._batch
        mask = torch.cat([b.mask, torch.ones(len(b), 1, dtype=torch.long)], dim=1)
        logits = self._forward(b.last[:, None], mask, b.positions[:, None], b.cache, keep=1)
        b.mask, b.positions = mask, b.positions + 1
        logits = logits[:, -1, :].float()  # sampled where it is (sampling.py)
        b.last = torch.tensor(self._sample(b.seqs, logits))
        self._finish_checks()

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any, keep: int
    ) -> torch.Tensor:
        """Logits ``[b, keep or t, V]`` of ``ids`` (``keep`` 0: every position), their KV
        into ``cache`` (filled in place): the lean forward where it covers the model."""
        ids, mask, positions = (t.to(self.device) for t in (ids, mask, positions))
        with varying_shapes(ids.device):  # a new KV length every step: no cuDNN plans
            if self._lean is not None:
                return self._lean(ids, mask, positions, cache, keep)
            return self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **{self._cache_kwarg: cache}, logits_to_keep=keep,
            ).logits  # fmt: skip

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> list[int]:
        """Sample each row's next token from its row of ``logits`` and record it (a
        device error surfaces before this, where the whole batch fails); a row that
        cannot be sampled fails alone, with a placeholder token until its finish check."""
        rows = [s.row for s in seqs]
        results = sample_rows(logits, rows, [s.req.top_logprobs_num for s in seqs])
        return [self._record(s, r) for s, r in zip(seqs, results, strict=True)]

    def _record(self, seq: Seq, result: Sampled | RuntimeError) -> int:
        if isinstance(result, RuntimeError):  # e.g. no finite probability: this request alone
            seq.finish = FinishReason(
                type="abort", message=f"sampling failed: {result}", status_code=400,
                err_type="BadRequestError",
            )  # fmt: skip
            return 0
        token, logprob, top = result
        seq.output.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(self.version)
        if seq.top is not None and top is not None:
            seq.top.append(top)
        seq.row.num_generated += 1
        seq.row.counts[token] = seq.row.counts.get(token, 0) + 1
        if seq.row.seen is not None:
            seq.row.seen = torch.cat([seq.row.seen, torch.tensor([token])])
        self.stats["generated_tokens"] += 1
        return token

    def _finish_checks(self) -> None:
        for seq, pos in zip(self._batch.seqs, self._batch.positions.tolist(), strict=True):
            if seq.finish is None:
                seq.finish = finish_reason(seq, pos, self.eos_ids, self.tokenizer,
                                           self.context_length)  # fmt: skip
        self._drop(lambda s: s.finish is not None, abort=False)

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
        b.select(keep, self.device)

    def _retract(self) -> None:
        """Put running sequences back in the queue; their KV is recomputed on resume."""
        for seq in reversed(self._batch.seqs):
            seq.prompt = [*seq.req.input_ids, *seq.output]
            self._waiting.appendleft(seq)
        self._batch = KVBatch()

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


with contextlib.suppress(Exception):  # keep torch from oversubscribing the event loop's core
    torch.set_num_interop_threads(1)
