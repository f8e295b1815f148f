"""TorchEngine: continuous batching over a Hugging Face causal LM with a KV cache, behind
the ``InferenceEngine`` protocol (what the HTTP server and the rollout actor call).

A facade over three parts: the ``Scheduler`` (queue, batch, one step at a time on a thread
of its own, so the event loop stays free for HTTP), the ``ModelRunner`` (the forward) and
``WeightUpdates`` (every way a version arrives). Admission is bounded by
``max_total_tokens`` KV positions, by default what ``mem_fraction`` of the free memory
holds (SGLang's ``--max-total-tokens``, ``--mem-fraction-static``). Every token is stamped
with the weight version that sampled it. Equal prompts (a group's samples) are prefilled
once: the prompt cache keeps their KV until the weights change (``prompt_cache.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from asyncrl.cores import LentThreads
from asyncrl.engines.base import (
    EngineLoad,
    GenerateOutput,
    GenerateRequest,
    PauseMode,
    check_prompt,
    follow,
    mark_aborted,
)
from asyncrl.engines.config import EngineConfig
from asyncrl.engines.torch.grammar import Grammars
from asyncrl.engines.torch.graph_decode import PoolBatch, static_batch
from asyncrl.engines.torch.heap_trim import HeapTrimmer
from asyncrl.engines.torch.kv_batch import (
    available_memory,
    kv_bytes_per_position,
    kv_position_budget,
)
from asyncrl.engines.torch.requests import Seq, eos_ids, new_seq
from asyncrl.engines.torch.runner import ModelRunner
from asyncrl.engines.torch.scheduler import Scheduler
from asyncrl.engines.torch.updates import WeightUpdates
from asyncrl.errors import EngineError
from asyncrl.observe.logs import get_logger
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
        json_any_whitespace: bool = True,
        cuda_graph: bool = True,
        static_decode: bool | None = None,
        prompt_cache_tokens: int = 4096,
    ) -> None:
        if not 0 < mem_fraction <= 1 or (max_total_tokens is not None and max_total_tokens < 1):
            raise ValueError(
                f"mem_fraction must be in (0, 1] and max_total_tokens >= 1, got "
                f"{mem_fraction} and {max_total_tokens}"
            )
        self.runner = ModelRunner(model, packed=packed, lean=lean)
        self.model, self.device = self.runner.model, self.runner.device
        self.context_length = self.runner.context_length
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.max_total_tokens = max_total_tokens or kv_position_budget(
            kv_bytes_per_position(model.config, next(model.parameters()).dtype),
            available_memory(self.device),
            mem_fraction,
        )
        # On CUDA decode runs on a static KV pool under CUDA graphs (``graph_decode.py``);
        # ``static_decode`` True runs that path eagerly elsewhere (tests), False never.
        static = self.device.type == "cuda" and cuda_graph
        batch = None
        if static_decode or (static_decode is None and static):
            batch = static_batch(
                self.runner,
                model.config,
                rows=max_running,
                max_total_tokens=max_total_tokens,
                mem_fraction=mem_fraction,
                graphs=static,
            )
        if batch is not None:
            self.runner.context_length = self.context_length = batch.pool.max_len
            self.max_total_tokens = batch.pool.rows * batch.pool.max_len
        self.eos_ids = eos_ids(model, tokenizer)
        vocab = (model.get_output_embeddings() or model.get_input_embeddings()).weight.shape[0]
        self.grammars = Grammars(
            tokenizer, int(vocab), self.eos_ids, any_whitespace=json_any_whitespace
        )
        self.scheduler = Scheduler(
            self.runner,
            tokenizer=tokenizer,
            eos_ids=self.eos_ids,
            max_running=max_running,
            max_total_tokens=self.max_total_tokens,
            version=version,
            batch=batch,
            prompt_cache_tokens=prompt_cache_tokens,
        )
        self.stats = self.scheduler.stats
        self.model_path = model_path
        #: SGLang clients' names of versions (``weight_version`` strings; routes).
        self.version_names: dict[int, str] = {}
        self.base_path = model_path  # what adapter versions merge onto
        self.torn = False  # a failed in-place update left a mix of versions: stay paused
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._wake = asyncio.Event()
        # Requests without a sampling_seed get one drawn from this stream: the same seed
        # gives the same stream (0 by default, as vLLM's engines); None draws from the OS.
        self._seeds = random.Random(seed)
        self.weights = WeightUpdates(self)
        self._stepped = asyncio.Event()  # set after every step (pause waits on it)
        self._steps: ThreadPoolExecutor | None = None  # the step thread, while run() runs
        # Before each step, the thread count to run it on (``cores.py``); None: fixed.
        self._threads: LentThreads | None = None
        self._threads_now = 0  # the step thread's count as last set by _step
        # The KV and activations live in host memory on CPU: give what is freed back.
        self._heap = HeapTrimmer() if self.device.type == "cpu" else None

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
            cfg.model_path,
            device=cfg.device,
            dtype=cfg.dtype,
            max_running=cfg.max_running,
            max_total_tokens=cfg.max_total_tokens,
            mem_fraction=cfg.mem_fraction,
            packed=cfg.packed_weights,
            lean=cfg.lean_forward,
            json_any_whitespace=cfg.json_any_whitespace,
            cuda_graph=cfg.cuda_graph,
            prompt_cache_tokens=cfg.prompt_cache_tokens,
            seed=seed,
            version=version,
        )

    @property
    def version(self) -> int:
        """The weight version now loaded (stamped on each token sampled)."""
        return self.scheduler.version

    @version.setter
    def version(self, version: int) -> None:
        self.scheduler.version = version

    @property
    def paused(self) -> bool:
        """True between ``pause`` and ``resume``."""
        return self.scheduler.paused

    # -- lifecycle -----------------------------------------------------------------------
    async def run(self) -> None:
        """The scheduler loop; run it as a task for as long as the engine serves.

        Steps run on one thread of their own: OpenMP keeps a team of worker threads per
        calling thread, and the default executor's changing workers each start a team
        that spins against the last one's.
        """
        loop = asyncio.get_running_loop()
        self._steps = steps = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._threads_now = 0  # a new step thread: its count is set at its first step
        sched = self.scheduler
        try:
            while True:
                if not sched.has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                try:
                    await loop.run_in_executor(steps, self._step)
                except Exception as exc:  # fail every caller loudly rather than hang them
                    log.exception("engine step failed")
                    sched.fail_all(f"engine error: {type(exc).__name__}: {exc}")
                for seq in [*sched.batch.seqs, *sched.just_finished]:
                    seq.updated.set()
                self._stepped.set()
        finally:  # a step under way finishes on its thread, which then exits
            self._steps = None
            steps.shutdown(wait=False)

    def _step(self) -> None:
        lent = self._threads  # read once: set_threads may drop it from the loop thread
        threads = lent() if lent is not None else self._threads_now
        if threads != self._threads_now:
            torch.set_num_threads(threads)
            self._threads_now = threads
        self.scheduler.step()
        if lent is not None and threads > lent.own:  # after the step, as "steps" counts
            self.stats["lent_thread_steps"] += 1
        if self._heap is not None:
            self._heap.maybe()

    def follow_threads(self, threads: LentThreads) -> None:
        """On a CPU, run each step on ``threads()`` threads: the cores an idle trainer
        lends (``cores.py``); on another device it changes nothing."""
        if self.device.type == "cpu":
            self._threads = threads

    async def set_threads(self, threads: int) -> None:
        """Run the engine's steps on ``threads`` intra-op threads from now on. OpenMP keeps
        the count per calling thread, so it is set on the step thread itself."""
        self._threads = None  # a fixed count from now on, whatever a trainer lends
        self._threads_now = threads
        torch.set_num_threads(threads)  # for a step thread that starts later
        if self._steps is not None:
            await asyncio.get_running_loop().run_in_executor(
                self._steps, torch.set_num_threads, threads
            )

    # -- requests ------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Cumulative outputs as tokens arrive; the last one carries ``finish_reason``."""
        await self._resumed.wait()  # SGLang: a paused server holds new requests
        self.check(request)
        seq = await self._admit(request)
        if self.torn:  # nothing samples from a mix of two versions: the partial goes back
            seq.aborted = True
        async for out in follow(seq, self._wake):
            yield out

    async def _admit(self, request: GenerateRequest) -> Seq:
        """Queue ``request``; one without a ``sampling_seed`` draws one from the engine's
        stream (greedy probes leave the stream alone). A constrained one is registered
        (abort, pause and the duplicate check see it) while its grammar compiles."""
        seed = request.sampling.sampling_seed
        if seed is None and not request.sampling.greedy:
            seed = self._seeds.getrandbits(63)
        seq = new_seq(request, seed, self.eos_ids)
        self.scheduler.register(seq)
        if (constraint := request.sampling.grammar) is not None:
            try:
                seq.grammar = await asyncio.to_thread(self.grammars.matcher, *constraint)
            except BaseException:
                self.scheduler.unregister(seq)
                raise
        self.scheduler.queue(seq)  # aborted meanwhile: the next step ends it
        self._wake.set()
        return seq

    def check(self, request: GenerateRequest) -> None:
        """Raise ``EngineError`` (a 400) for a request this engine cannot serve."""
        check_prompt(request, self.runner.vocab_size, self.context_length, self.scheduler.rids)
        ids = request.input_ids
        if request.logprob_start_len > len(ids):
            raise EngineError(
                f"logprob_start_len ({request.logprob_start_len}) is greater than the "
                f"prompt length ({len(ids)})"
            )
        if request.top_logprobs_num < 0:
            raise EngineError(f"top_logprobs_num must be >= 0, got {request.top_logprobs_num}")
        vocab = self.runner.vocab_size
        if any(not 0 <= t < vocab for t in request.token_ids_logprob or ()):
            raise EngineError(f"token_ids_logprob: ids must be in [0, {vocab})")
        p = request.sampling
        if p.grammar is not None and p.min_new_tokens > 0:
            raise EngineError(
                "min_new_tokens cannot be combined with a grammar: once its value is whole "
                "the grammar allows only EOS, which min_new_tokens forbids"
            )
        if (p.stop_strings or p.stop_regexes) and self.tokenizer is None:
            raise EngineError(
                "stop and stop_regex match decoded text and this model has no tokenizer: "
                "use stop_token_ids"
            )

    def abort(self, rid: str = "", *, abort_all: bool = False, prefix: bool = False) -> int:
        """Abort as SGLang's ``/abort_request`` does, by every rid that starts with
        ``prefix``, or all (``base.mark_aborted``); returns how many."""
        hits = mark_aborted(self.scheduler.rids, rid, abort_all, prefix=prefix)
        self._wake.set()
        return hits

    def load(self) -> EngineLoad:
        """Running and waiting requests and token usage."""
        sched = self.scheduler
        return EngineLoad(
            num_running_reqs=len(sched.batch),
            num_waiting_reqs=len(sched.waiting),
            num_used_tokens=sched.batch.num_tokens,
            max_total_num_tokens=self.max_total_tokens,
            paused=sched.paused,
        )

    # -- pause, weights, memory ----------------------------------------------------------
    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating, as SGLang's ``pause_generation``: ``in_place`` keeps the batch
        and its KV; ``retract`` drops the KV, to prefill again on resume; ``abort`` aborts
        everything and returns once every caller has its partial output."""
        self.hold()
        if mode == "abort":
            for seq in list(self.scheduler.rids.values()):
                seq.aborted = True
            self._wake.set()
            while self.scheduler.rids:  # every caller gets its partial output first
                self._stepped.clear()
                await self._stepped.wait()
        elif mode == "retract":
            await self.at_boundary(self.scheduler.retract)

    async def resume(self) -> None:
        """Continue after ``pause`` (not while the weights are torn: see
        ``update_weights_in_place``)."""
        if self.torn:
            log.warning("resume refused: the weights are torn until an update completes")
            return
        self.scheduler.paused = False
        self._resumed.set()
        self._wake.set()

    def hold(self) -> None:
        """Pause at once, without waiting: new requests wait, no step decodes."""
        self.scheduler.paused = True
        self._resumed.clear()

    def abort_torn(self) -> None:
        """Abort every request, and let held ones in to be aborted (``torn`` weights)."""
        for seq in self.scheduler.rids.values():
            seq.aborted = True
        self._resumed.set()
        self._wake.set()

    async def _between_steps(self, fn: Callable[[], object]) -> None:
        """``fn`` at a step boundary, or now when the engine is not running (no step can
        race it, and none would come to run it)."""
        if self._steps is None:
            fn()
        else:
            await self.at_boundary(fn)

    async def at_boundary(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the step thread between two steps; its exception is raised here."""
        fut = asyncio.get_running_loop().create_future()
        self.scheduler.jobs.append((fn, fut))
        self._wake.set()
        await fut

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
        await self.weights.join_group(
            master_address, master_port, rank, world_size, group_name, backend
        )

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
        await self.weights.from_distributed(
            names, dtypes, shapes, group_name, version, flattened=flattened
        )

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the group; ``EngineError`` when no group of that name was joined."""
        await self.weights.leave_group(group_name)

    async def flush_cache(self) -> bool:
        """Drop the prompt cache; refused (False) while requests run, as SGLang does."""
        if self.scheduler.rids:
            return False
        await self._between_steps(self.scheduler.prompts.clear)
        return True

    async def release_memory(self, tags: list[str] | None) -> None:
        """Free the KV cache (must be idle) and move weights to CPU if on an accelerator.
        On the CPU that frees the packed and fused copies of the weights (``cpu_linear``);
        the first step after ``resume_memory`` makes them again."""
        if self.scheduler.rids:
            raise EngineError("release_memory_occupation needs an idle engine: pause first")
        if tags is None or "weights" in tags:

            def release() -> None:
                self.model.to("cpu")
                self.runner.invalidate()
                self.scheduler.prompts.clear()

            await self.at_boundary(release)
        if tags is None or "kv_cache" in tags:
            await self._between_steps(self.scheduler.prompts.clear)
        await self._static_memory(tags, release=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    async def resume_memory(self, tags: list[str] | None) -> None:
        """Move weights back to the engine's device and make the KV pool again (the
        decode graphs are captured again: their tensors moved)."""
        if tags is None or "weights" in tags:
            await self.at_boundary(lambda: self.model.to(self.device))
        await self._static_memory(tags, release=False)

    async def _static_memory(self, tags: list[str] | None, *, release: bool) -> None:
        """Free or make again the static KV pool (``kv_cache``); the decode graphs read
        the pool and the weights, so either moving drops them."""
        batch = self.scheduler.batch
        if not isinstance(batch, PoolBatch):
            return
        if tags is None or "kv_cache" in tags:
            await self.at_boundary(batch.pool.release if release else batch.pool.restore)
        await self.at_boundary(batch.decoder.invalidate)  # on the step thread, between steps


with contextlib.suppress(Exception):  # keep torch from oversubscribing the event loop's core
    torch.set_num_interop_threads(1)
