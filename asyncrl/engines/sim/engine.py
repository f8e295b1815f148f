"""``SimEngine``: the engine protocol with no model, its time taken from a latency model.

For planning and load tests: it answers like any engine (token ids, behaviour log-probs,
the weight version of every token, aborts, pauses, weight updates, ``/v1/loads``), so
everything around it is the real code, but its tokens are random and its time is
modelled (``latency.py``: step time, response lengths, ``token_stride``). It is a
discrete-event simulation: the batch changes only when a request ends, joins, is aborted
or is due a partial output, so its Python work grows with events, not tokens.
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
    EngineLoad,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    PauseMode,
    check_prompt,
    follow,
    mark_aborted,
    refuse_grammar,
)
from asyncrl.engines.sim.latency import LatencyModel
from asyncrl.errors import EngineError


@dataclass(eq=False)
class _Request:
    request: GenerateRequest
    target: int
    count: int = 0  # tokens decoded; ``output`` holds them once drawn (``_draw``)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    started: bool = False
    aborted: bool = False
    updated: asyncio.Event = field(default_factory=asyncio.Event)
    every: int = 0  # wake the caller every this many tokens (0: only when it ends)
    header: list[int] = field(default_factory=list)  # the first ids of a new response

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

    def steps_to_event(self) -> int:
        """Decode steps until this request ends or its caller is due a partial output."""
        left = self.target - self.count
        return min(left, self.every - self.count % self.every) if self.every else left


class SimEngine:
    """A model-free engine with modelled time (the ``InferenceEngine`` protocol).

    Modelled time runs ``time_scale`` times faster than the loop's clock. The engine sleeps
    from one event to the next (``_decode_to_event``), its steps laid end to end from an
    anchor on that clock, so a loop that wakes it late does not slow modelled time; what
    it cannot hide is a control plane slow to send requests or read results, which is what
    the cluster simulator's load test measures. ``clock``: the modelled seconds spent.
    """

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
        #: SGLang clients' names of versions (``weight_version`` strings; routes).
        self.version_names: dict[int, str] = {}
        self.clock = 0.0  # modelled seconds spent decoding and loading weights
        self.steps = 0
        self.stepped = asyncio.Event()  # set after every run of decode steps
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
        self._anchor = 0.0  # loop time at which the next decode step starts
        # Random ids are neither EOS (it only ends a response) nor the header's marker.
        self._marker = vocab_size - 1 if eos_token_id != vocab_size - 1 else vocab_size - 2
        self._alphabet = np.setdiff1d(np.arange(vocab_size), [eos_token_id, self._marker])
        self._index = np.zeros(vocab_size, dtype=np.int64)
        self._index[self._alphabet] = np.arange(len(self._alphabet))

    # -- the engine loop ------------------------------------------------------------------
    async def run(self) -> None:
        """Decode while there is work, weight updates between steps; runs until cancelled
        (the server owns it)."""
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            if not self._has_work():
                await self._wake.wait()
                self._anchor = loop.time()  # idle time is not modelled work
                continue
            if self._updates:
                await self._apply_updates()
                continue
            self._end_aborted()
            if self._paused or not (self._waiting or self._running):
                continue
            await self._decode_to_event()

    def _has_work(self) -> bool:
        if self._updates or any(r.aborted for r in self._rids.values()):
            return True
        return not self._paused and bool(self._waiting or self._running)

    def _admit(self) -> int:
        """Move waiting requests into the batch; returns their prompt tokens (prefill)."""
        admitted = self._waiting[: self.max_running - len(self._running)]
        del self._waiting[: len(admitted)]
        for req in admitted:
            req.started = True
        self._running.extend(admitted)
        if admitted:  # a request joins no earlier than it arrived, however late the loop is
            self._anchor = max(self._anchor, asyncio.get_running_loop().time())
        return sum(len(r.request.input_ids) for r in admitted)

    async def _decode_to_event(self) -> None:
        """Decode steps up to the next one where a request ends or is due a partial output,
        or, when woken early (a request, abort, pause or update), up to the end of the step
        in flight. Step ``i`` ends at ``anchor + (first + (i - 1) rest) / time_scale``."""
        prefill = self._admit()
        first = self.latency.step_seconds(len(self._running), prefill)
        rest = self.latency.step_seconds(len(self._running), 0)
        steps = min(r.steps_to_event() for r in self._running)
        scale = self.latency.time_scale

        def ends(n: int) -> float:
            return self._anchor + (first + (n - 1) * rest) / scale

        if await self._sleep_until(ends(steps), interruptible=True):
            elapsed = (asyncio.get_running_loop().time() - self._anchor) * scale
            if elapsed > first:  # the step in flight is the one after those done
                steps = steps if rest <= 0 else min(steps, 2 + int((elapsed - first) // rest))
            else:
                steps = 1
            await self._sleep_until(ends(steps), interruptible=False)
        self._anchor = ends(steps)
        self.clock += first + (steps - 1) * rest
        self.steps += steps
        self._advance(steps)
        self.stepped.set()

    async def _sleep_until(self, when: float, *, interruptible: bool) -> bool:
        """Sleep until loop time ``when``; True if ``_wake`` cut it short."""
        delay = when - asyncio.get_running_loop().time()
        if delay <= 0:
            return False
        if not interruptible:
            await asyncio.sleep(delay)
            return False
        try:
            async with asyncio.timeout(delay):
                await self._wake.wait()
        except TimeoutError:
            return False
        return True

    def _advance(self, steps: int) -> None:
        """Every running request decodes ``steps`` tokens; those at their end finish, those
        at a ``stream_interval`` boundary wake their caller."""
        for req in self._running:
            req.count += steps
            if req.count >= req.target:
                self._draw(req)
                cap = req.request.sampling.max_new_tokens
                # A response that ends before its cap ends with EOS; one at the cap is cut.
                if cap is None or req.target < cap:
                    req.output[-1] = self.eos_token_id
                    self._finish(req, _eos(self.eos_token_id))
                else:
                    self._finish(req, _length(req.count))
            elif req.every and req.count % req.every == 0:
                self._draw(req)
                req.updated.set()
        self._running = [r for r in self._running if r.finish is None]

    def _draw(self, req: _Request) -> None:
        """Draw the tokens decoded since the last draw (the header, then random ids; log-probs;
        the current version): the engine counts tokens and draws them only when read."""
        n = req.count - len(req.output)
        if n <= 0:
            return
        ids = self._alphabet[self._rng.integers(0, len(self._alphabet), n)]
        head = req.header[len(req.output) : len(req.output) + n]
        ids[: len(head)] = head
        req.output.extend(ids.tolist())
        req.logprobs.extend((-self._rng.exponential(1.0, n)).tolist())
        req.versions.extend([self.version] * n)

    def _finish(self, req: _Request, reason: FinishReason) -> None:
        req.finish = reason
        self._rids.pop(req.request.rid, None)
        req.updated.set()

    def _end_aborted(self) -> None:
        for req in [r for r in self._rids.values() if r.aborted]:
            self._draw(req)
            self._finish(req, FinishReason(type="abort", message="Abort request", status_code=200))
        self._waiting = [r for r in self._waiting if r.finish is None]
        self._running = [r for r in self._running if r.finish is None]

    async def _apply_updates(self) -> None:
        updates, self._updates = self._updates, []
        seconds = self.latency.weight_update_s * len(updates)
        now = asyncio.get_running_loop().time()
        self._anchor = max(self._anchor, now) + seconds / self.latency.time_scale
        await self._sleep_until(self._anchor, interruptible=False)
        self.clock += seconds
        for req in self._running:
            self._draw(req)  # the tokens so far carry the version they were decoded with
        for done, version in updates:
            self.version = self.version + 1 if version is None else version
            if not done.done():
                done.set_result(None)

    # -- requests -------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Cumulative outputs: when the request ends (finished or aborted), and every
        ``stream_interval`` tokens when it sets one; the last carries ``finish_reason``."""
        await self._resumed.wait()  # a paused engine holds new requests, as SGLang does
        self.check(request)
        cap = request.sampling.max_new_tokens
        target, header = self._plan(request.input_ids)
        if cap is not None:
            target = cap if request.sampling.ignore_eos else max(1, min(target, cap))
        req = _Request(request, target, header=header, every=request.sampling.stream_interval or 0)
        if cap == 0:
            req.finish = _length(0)
            yield req.snapshot()
            return
        self._rids[request.rid] = req
        self._waiting.append(req)
        if len(self._running) < self.max_running:  # else it joins when one ends, an event
            self._wake.set()
        async for out in follow(req, self._wake):
            yield out

    def _plan(self, input_ids: list[int]) -> tuple[int, list[int]]:
        """(tokens to decode, ids to start with). A new response draws its length and
        starts with a 3-id header recording it: ``[marker, total // b, total % b]`` in the
        ids that are neither EOS nor the marker (``b`` of them). A prompt holding a header
        continues one of our responses (APRIL, an abort on update): it decodes what its
        drawn length has left, as a model would go on to the same EOS, with no state kept
        between requests, engines or processes (a fresh length for every resumption would
        make APRIL look worse than it is)."""
        ids = np.asarray(input_ids)
        marks = np.flatnonzero(ids[:-2] == self._marker) if len(ids) > 2 else ids[:0]
        b = len(self._alphabet)
        if len(marks):
            at = int(marks[-1])
            total = int(self._index[ids[at + 1]] * b + self._index[ids[at + 2]])
            return max(1, total - (len(ids) - at)), []
        total = min(self.latency.wire_length(self._rng), b * b - 1)
        return total, [
            self._marker,
            int(self._alphabet[total // b]),
            int(self._alphabet[total % b]),
        ]

    def check(self, request: GenerateRequest) -> None:
        """Raise ``EngineError`` (a 400) for a request this engine cannot serve."""
        check_prompt(request, self.vocab_size, self.context_length, self._rids)
        p = request.sampling
        if p.stop_strings or p.stop_regexes:
            raise EngineError("the simulated engine has no text: use stop_token_ids")
        refuse_grammar(p, "the simulated engine")
        if request.return_logprob and request.logprob_start_len >= 0:
            raise EngineError("the simulated engine has no prompt log-probs")
        if request.top_logprobs_num > 0 or request.token_ids_logprob is not None:
            raise EngineError("the simulated engine has no top or chosen tokens' log-probs")

    def abort(self, rid: str = "", *, abort_all: bool = False, prefix: bool = False) -> int:
        """Abort as ``TorchEngine.abort`` does; each caller gets its partial output."""
        hits = mark_aborted(self._rids, rid, abort_all, prefix=prefix)
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
        """Half of ``switch_s`` (weights and cache off the accelerator)."""
        await self._switch()
        self._released = True

    async def resume_memory(self, tags: list[str] | None) -> None:
        """The other half of ``switch_s``."""
        await self._switch()
        self._released = False

    async def _switch(self) -> None:
        seconds = self.latency.switch_s / 2
        await asyncio.sleep(seconds / self.latency.time_scale)
        self.clock += seconds


def _eos(token: int) -> FinishReason:
    return FinishReason(type="stop", matched=token)


def _length(n: int) -> FinishReason:
    return FinishReason(type="length", length=n)
