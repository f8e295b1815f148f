"""SimEngine: the engine protocol with no model, its time taken from a latency model.

For planning and load-testing (issue 11): the engine answers like any other (token ids,
behaviour log-probs, the weight version of every token, aborts, pauses, weight updates,
``/v1/loads``), so everything around it is the real code, but its tokens are random and
its time is modelled. A request's response length is drawn from a lognormal with the
chosen median and p99/median ratio, cut at ``length_max`` and ``max_new_tokens``. The
engine runs continuous batching: each decode step serves every running request one token
and takes (modelled seconds)::

    step_s = decode_base_s + decode_s_per_seq * running + prefill_s_per_token * admitted

where ``running`` counts the requests decoded in the step (at most ``max_running``) and
``admitted`` the prompt tokens of the requests that join it (their prefill). A weight
update takes ``weight_update_s`` between steps. Modelled time advances ``clock``; the
engine sleeps ``step_s / time_scale`` of wall time per step, so ``time_scale = 10`` runs
ten modelled seconds per second (the control plane around it is not scaled: the load
test of the cluster simulator measures what it can keep up with).

Lognormal: with median ``m`` and ``r = p99 / m``, ``log L ~ N(log m, s)`` with
``s = log r / 2.326`` (2.326 is the standard normal's 99th percentile).

``generate`` yields the cumulative output when the request ends (finished or aborted),
and also every ``stream_interval`` tokens when the request sets one. Yielding every step
(as the torch engine does) copied each output once per token: a 4,096-token response
cost 8 million list copies, the simulator's own overhead rather than the control plane's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from asyncrl.engines.base import (
    EngineError,
    EngineLoad,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    PauseMode,
    check_prompt,
    follow,
    mark_aborted,
)
from asyncrl.engines.sim_latency import LatencyModel


@dataclass(eq=False)
class _Request:
    request: GenerateRequest
    target: int
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    started: bool = False
    aborted: bool = False
    updated: asyncio.Event = field(default_factory=asyncio.Event)
    every: int = 0  # wake the caller every this many tokens (0: only when it ends)

    def snapshot(self) -> GenerateOutput:
        return GenerateOutput(
            rid=self.request.rid,
            output_ids=list(self.output),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=self.finish,
            prompt_tokens=len(self.request.input_ids),
            queued=self.finish is not None and not self.started,
        )


class SimEngine:
    """A model-free engine with modelled time (the ``InferenceEngine`` protocol)."""

    Config = LatencyModel

    def __init__(
        self,
        latency: LatencyModel | None = None,
        *,
        vocab_size: int = 32000,
        eos_token_id: int = 2,
        max_running: int = 256,
        context_length: int = 65536,
        seed: int = 0,
    ) -> None:
        self.latency = latency or LatencyModel()
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_running = max_running
        self.context_length = context_length
        self.version = 0
        self.clock = 0.0  # modelled seconds
        self.steps = 0
        self.stepped = asyncio.Event()  # set after every decode step
        self.tokenizer: Any = None
        self.model_path = "sim"
        self.device = torch.device("cpu")
        # /get_model_info reads model.config; a model-free engine has only its shape.
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size))
        self._rng = np.random.default_rng(seed)
        self._rids: dict[str, _Request] = {}
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._wake = asyncio.Event()
        self._updates: list[tuple[asyncio.Future[None], int | None]] = []
        self._released = False

    # -- the engine loop ------------------------------------------------------------------
    async def run(self) -> None:
        """Decode steps while there is work, weight updates between them; runs until
        cancelled (the server owns it)."""
        while True:
            if not self._has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._updates:
                await self._apply_updates()
                continue
            self._end_aborted()
            if self._paused or not (self._waiting or self._running):
                continue
            await self._step()

    def _has_work(self) -> bool:
        if self._updates or any(r.aborted for r in self._rids.values()):
            return True
        return not self._paused and bool(self._waiting or self._running)

    async def _step(self) -> None:
        admitted = self._waiting[: self.max_running - len(self._running)]
        del self._waiting[: len(admitted)]
        for req in admitted:
            req.started = True
        self._running.extend(admitted)
        prompt_tokens = sum(len(r.request.input_ids) for r in admitted)
        seconds = self.latency.step_seconds(len(self._running), prompt_tokens)
        await asyncio.sleep(seconds / self.latency.time_scale)
        self.clock += seconds
        self.steps += 1
        self.stepped.set()
        self._decode(self._running)
        self._running = [r for r in self._running if r.finish is None]

    def _decode(self, batch: list[_Request]) -> None:
        """One token for each request of ``batch``; finishes those that reach their end."""
        ids = self._rng.integers(0, self.vocab_size, len(batch))
        logprobs = -self._rng.exponential(1.0, len(batch))
        for req, token, logprob in zip(batch, ids.tolist(), logprobs.tolist(), strict=True):
            done = len(req.output) + 1 >= req.target
            cap = req.request.sampling.max_new_tokens
            # A response that ends before its cap ends with EOS; one at the cap is cut.
            eos = done and (cap is None or req.target < cap)
            req.output.append(self.eos_token_id if eos else int(token))
            req.logprobs.append(float(logprob))
            req.versions.append(self.version)
            if done:
                self._finish(req, _eos(self.eos_token_id) if eos else _length(len(req.output)))
            elif req.every and len(req.output) % req.every == 0:
                req.updated.set()

    def _finish(self, req: _Request, reason: FinishReason) -> None:
        req.finish = reason
        self._rids.pop(req.request.rid, None)
        req.updated.set()

    def _end_aborted(self) -> None:
        for req in [r for r in self._rids.values() if r.aborted]:
            self._finish(req, FinishReason(type="abort", message="Abort request", status_code=200))
        self._waiting = [r for r in self._waiting if r.finish is None]
        self._running = [r for r in self._running if r.finish is None]

    async def _apply_updates(self) -> None:
        updates, self._updates = self._updates, []
        seconds = self.latency.weight_update_s * len(updates)
        await asyncio.sleep(seconds / self.latency.time_scale)
        self.clock += seconds
        for done, version in updates:
            self.version = self.version + 1 if version is None else version
            if not done.done():
                done.set_result(None)

    # -- requests -------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Cumulative outputs, one per decode step the request took part in; the last one
        carries ``finish_reason``."""
        await self._resumed.wait()  # a paused engine holds new requests, as SGLang does
        self.check(request)
        cap = request.sampling.max_new_tokens
        target = self.latency.sample_length(self._rng)
        if cap is not None:
            target = cap if request.sampling.ignore_eos else max(1, min(target, cap))
        req = _Request(request, target, every=request.sampling.stream_interval or 0)
        if cap == 0:
            req.finish = _length(0)
            yield req.snapshot()
            return
        self._rids[request.rid] = req
        self._waiting.append(req)
        self._wake.set()
        async for out in follow(req, self._wake):
            yield out

    def check(self, request: GenerateRequest) -> None:
        """Raise ``EngineError`` (a 400) for a request this engine cannot serve."""
        check_prompt(request, self.vocab_size, self.context_length, self._rids)
        p = request.sampling
        if p.stop_strings or p.stop_regexes:
            raise EngineError("the simulated engine has no text: use stop_token_ids")
        if request.return_logprob and request.logprob_start_len >= 0:
            raise EngineError("the simulated engine has no prompt log-probs")
        if request.top_logprobs_num > 0:
            raise EngineError("the simulated engine has no top log-probs")

    def abort(self, rid: str = "", *, abort_all: bool = False) -> int:
        """Abort by rid prefix or all; each caller gets its partial output."""
        hits = mark_aborted(self._rids, rid, abort_all)
        self._wake.set()
        return hits

    def load(self) -> EngineLoad:
        """Running and waiting requests and the tokens they hold."""
        used = sum(len(r.request.input_ids) + len(r.output) for r in self._running)
        return EngineLoad(
            num_running_reqs=len(self._running),
            num_waiting_reqs=len(self._waiting),
            num_used_tokens=used,
            max_total_num_tokens=self.max_running * self.context_length,
            paused=self._paused,
        )

    # -- pause, weights, memory -----------------------------------------------------------
    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop decoding; ``abort`` also ends every request (partial outputs returned)."""
        self._paused = True
        self._resumed.clear()
        if mode == "abort":
            self.abort(abort_all=True)
            self._end_aborted()

    async def resume(self) -> None:
        """Continue after ``pause``."""
        self._paused = False
        self._resumed.set()
        self._wake.set()

    async def update_weights_from_tensors(
        self, tensors: dict[str, Any], version: int | None
    ) -> None:
        """Take ``weight_update_s`` between decode steps, then serve ``version``."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._updates.append((done, version))
        self._wake.set()
        await done

    async def update_weights_from_disk(self, path: str, version: int | None) -> None:
        """As ``update_weights_from_tensors`` (nothing is read)."""
        await self.update_weights_from_tensors({}, version)

    async def flush_cache(self) -> bool:
        """True when idle (there is no cache; SGLang refuses while requests run)."""
        return not (self._running or self._waiting)

    async def release_memory(self, tags: list[str] | None) -> None:
        self._released = True

    async def resume_memory(self, tags: list[str] | None) -> None:
        self._released = False


def _eos(token: int) -> FinishReason:
    return FinishReason(type="stop", matched=token)


def _length(n: int) -> FinishReason:
    return FinishReason(type="length", length=n)
