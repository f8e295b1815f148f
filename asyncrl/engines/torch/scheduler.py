"""Scheduler: the waiting queue and the running batch, advanced one step at a time on the
engine's step thread::

    step:  run the jobs queued for a step boundary (weight updates, memory moves)
           admit waiting requests: prefill them together, merge their KV into the batch
           decode one token for every running sequence
           finish sequences (EOS, stop token, stop string or regex, length, abort) and
           drop their KV
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from asyncrl.engines.base import FinishReason
from asyncrl.engines.torch.grammar import mask_rows
from asyncrl.engines.torch.graph_decode import PoolBatch
from asyncrl.engines.torch.kv_batch import KVBatch, cache_of_rows, new_cache
from asyncrl.engines.torch.prompt_cache import Prefilled, PromptCache, prefilled
from asyncrl.engines.torch.requests import (
    Seq,
    finish_reason,
    served_tokens,
    shared_prompts,
    similar_lengths,
)
from asyncrl.engines.torch.runner import ModelRunner
from asyncrl.engines.torch.sampling import (
    Sampled,
    chosen_logprobs,
    prompt_chosen_logprobs,
    prompt_logprobs,
    reported_logprobs,
    sample_rows,
)

#: A job for the next step boundary and the future its caller awaits.
Job = tuple[Callable[[], object], asyncio.Future[None]]


class Scheduler:
    """Continuous batching under a KV budget; every method but ``has_work`` runs on the
    step thread (or while no step runs)."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        tokenizer: Any,
        eos_ids: set[int],
        max_running: int,
        max_total_tokens: int,
        version: int,
        batch: KVBatch[Seq] | PoolBatch | None = None,
        prompt_cache_tokens: int = 0,
    ) -> None:
        self.runner, self.tokenizer, self.eos_ids = runner, tokenizer, eos_ids
        self.max_running, self.max_total_tokens = max_running, max_total_tokens
        self.version = version  # stamped on every token sampled
        self.paused = False
        self.waiting: deque[Seq] = deque()
        self.batch: KVBatch[Seq] | PoolBatch = KVBatch() if batch is None else batch
        self.rids: dict[str, Seq] = {}
        self.prompts = PromptCache(prompt_cache_tokens)
        self.jobs: deque[Job] = deque()
        self.just_finished: list[Seq] = []
        self.stats: dict[str, float] = {
            "steps": 0,
            "prefills": 0,
            "prefill_reused_rows": 0,  # prompt KV copied, not computed
            "lent_thread_steps": 0,  # steps run on threads an idle trainer lent
            "generated_tokens": 0,
            "update_pause_s": 0.0,
        }

    def register(self, seq: Seq) -> None:
        """Known by its rid (abort, pause, duplicates) before it is queued."""
        self.rids[seq.req.rid] = seq

    def unregister(self, seq: Seq) -> None:
        self.rids.pop(seq.req.rid, None)

    def queue(self, seq: Seq) -> None:
        """Wait for admission (an aborted one is ended by the next step)."""
        self.waiting.append(seq)

    def has_work(self) -> bool:
        if self.jobs:
            return True
        if self.paused:
            return any(s.aborted for s in self.rids.values())
        return bool(self.waiting or self.batch.seqs)

    def fail_all(self, message: str) -> None:
        """Finish every request with a 500 (a step raised): no caller hangs."""
        reason = FinishReason(
            type="abort", message=message, status_code=500, err_type="InternalServerError"
        )
        for seq in list(self.rids.values()):
            seq.finish = seq.finish or reason
            self.just_finished.append(seq)
        self.rids.clear()
        self.waiting.clear()
        self.batch.clear()

    @torch.inference_mode()
    def step(self) -> None:
        self.just_finished = []
        self._run_jobs()
        self.prompts.at(self.runner.weights_epoch)  # stale entries go now, not at a prefill
        self._drop(lambda s: s.aborted, abort=True)
        self._finish_waiting_aborted()
        if not self.paused:
            self._prefill_waiting()
            if self.batch.seqs:
                self._decode()
        self.stats["steps"] += 1

    def retract(self) -> None:
        """Put running sequences back at the queue's head, oldest first (a batch's rows
        are not in arrival order: a finished row's place goes to the last); their KV is
        recomputed on resume."""
        for seq in sorted(self.batch.seqs, key=lambda s: s.started, reverse=True):
            seq.prompt = [*seq.req.input_ids, *seq.output]
            self.waiting.appendleft(seq)
        self.batch.clear()

    def final_length(self, seq: Seq) -> int:
        """Positions ``seq`` holds when it ends: its prompt and all it may generate."""
        budget = seq.req.sampling.max_new_tokens
        if budget is None:
            return self.runner.context_length
        return min(len(seq.req.input_ids) + budget, self.runner.context_length)

    def _run_jobs(self) -> None:
        while self.jobs:
            fn, fut = self.jobs.popleft()
            loop = fut.get_loop()
            try:
                fn()
            except Exception as exc:  # reported to the caller, the engine goes on
                loop.call_soon_threadsafe(_settle, fut, exc)
            else:
                loop.call_soon_threadsafe(_settle, fut, None)

    def _finish_waiting_aborted(self) -> None:
        for seq in [s for s in self.waiting if s.aborted]:
            self.waiting.remove(seq)
            seq.finish = FinishReason(type="abort", message="Abort in waiting queue")
            self._done(seq)

    def _done(self, seq: Seq) -> None:
        self.just_finished.append(seq)
        self.rids.pop(seq.req.rid, None)

    def _prefill_waiting(self) -> None:
        """Admit waiting requests while rows x the longest final length stays within
        ``max_total_tokens`` (every row is padded to the longest: ``kv_batch.py``). An
        empty batch admits one whatever its length."""
        new: list[Seq] = []
        rows = len(self.batch)
        longest = max(map(self.final_length, self.batch.seqs), default=0)
        while self.waiting and rows + len(new) < self.max_running:
            width = max(longest, self.final_length(self.waiting[0]))
            if (rows or new) and (rows + len(new) + 1) * width > self.max_total_tokens:
                break
            longest = width
            new.append(self.waiting.popleft())
        for chunk in similar_lengths(new):
            self._prefill(chunk)

    def _prefill(self, seqs: list[Seq]) -> None:
        """Prefill ``seqs``: each distinct prompt once (``shared_prompts``: a group's
        samples), none the prompt cache holds; rows of one prompt get copies of its KV."""
        unique, rows = shared_prompts(seqs)
        scored = [s.req.logprob_start_len >= 0 and s.input_logprobs is None for s in seqs]
        whole = {rows[i] for i, yes in enumerate(scored) if yes}  # logits at every position
        epoch = self.runner.weights_epoch
        parts: list[Prefilled | None] = [
            None if u in whole else self.prompts.get(tuple(s.prompt), epoch)
            for u, s in enumerate(unique)
        ]
        misses = [u for u, part in enumerate(parts) if part is None]
        for s in seqs:
            s.cached = 0
        if len(misses) == len(seqs):  # nothing shared: the forward's cache is the batch's
            cache, mask, logits = self._forward(seqs, keep=0 if whole else 1)
            for j, s in enumerate(seqs):
                if self.prompts.fits(len(s.prompt)):
                    entry = prefilled(cache, j, len(s.prompt), logits[j, -1])
                    self.prompts.put(tuple(s.prompt), entry, epoch)
            self._prompt_logprobs(seqs, scored, logits, list(range(len(seqs))))
            self._merge(seqs, cache, mask, logits[:, -1, :].float())
            return
        logits = torch.zeros(0)
        if misses:
            todo = [unique[u] for u in misses]
            cache, _, logits = self._forward(todo, keep=0 if whole else 1)
            for j, s in enumerate(todo):
                parts[misses[j]] = part = prefilled(cache, j, len(s.prompt), logits[j, -1])
                self.prompts.put(tuple(s.prompt), part, epoch)
            del cache
        at = {u: j for j, u in enumerate(misses)}
        self._prompt_logprobs(seqs, scored, logits, [at.get(r, -1) for r in rows])
        for i, s in enumerate(seqs):
            if rows[i] not in at or unique[rows[i]] is not s:
                s.cached = served_tokens(s, scored[i])
                self.stats["prefill_reused_rows"] += 1
        held = [parts[r] for r in rows]
        cache, mask = cache_of_rows(held)  # type: ignore[arg-type]  (all filled above)
        last = torch.stack([p.last for p in held]).float()  # type: ignore[union-attr]
        self._merge(seqs, cache, mask, last)

    def _forward(self, seqs: list[Seq], keep: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One left-padded forward of ``seqs``' prompts: its cache, mask and logits (the
        last position's, or every position's for ``keep`` 0: prompt log-probs need them,
        and a ``[b, width, V]`` projection is most of a short prompt's prefill)."""
        width = max(len(s.prompt) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s.prompt) :] = torch.tensor(s.prompt)
            mask[i, width - len(s.prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = new_cache()
        logits = self.runner.forward(ids, mask, positions, cache, keep=keep)
        self.stats["prefills"] += 1
        return cache, mask, logits

    def _prompt_logprobs(
        self, seqs: list[Seq], scored: list[bool], logits: torch.Tensor, rows: list[int]
    ) -> None:
        """Prompt log-probs of the ``scored`` seqs from row ``rows[i]`` of ``logits``
        (every position's, left-padded); marks every seq admitted."""
        for i, s in enumerate(seqs):
            s.queued = False
            if not scored[i]:
                continue
            own = logits[rows[i], logits.shape[1] - len(s.prompt) :]
            temperature = s.row.params.logprob_temperature
            s.input_logprobs, s.input_top = prompt_logprobs(
                own, s.prompt, s.req.logprob_start_len, s.req.top_logprobs_num,
                temperature=temperature,
            )  # fmt: skip
            if s.req.token_ids_logprob is not None:
                s.input_chosen = prompt_chosen_logprobs(
                    own, s.prompt, s.req.logprob_start_len, s.req.token_ids_logprob,
                    temperature=temperature,
                )  # fmt: skip

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
        self.batch.add(seqs, cache, mask, tokens)
        self._finish_checks()

    def _decode(self) -> None:
        b = self.batch
        logits = b.decode(self.runner.forward)  # sampled where it is (sampling.py)
        b.last = torch.tensor(self._sample(b.seqs, logits))
        self._finish_checks()

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> list[int]:
        """Sample each row's next token from its row of ``logits`` and record it; a row
        that cannot be sampled fails alone, with a placeholder token until its finish
        check (a device error raises before this and fails the whole batch)."""
        mask_rows(logits, [s.grammar for s in seqs])
        rows = [s.row for s in seqs]
        results = sample_rows(logits, rows, [s.req.top_logprobs_num for s in seqs])
        pairs = enumerate(zip(seqs, results, strict=True))
        return [self._record(s, r, logits[i]) for i, (s, r) in pairs]

    def _record(self, seq: Seq, result: Sampled | RuntimeError, logits: torch.Tensor) -> int:
        if isinstance(result, RuntimeError):  # e.g. no finite probability: this request alone
            seq.finish = FinishReason(
                type="abort",
                message=f"sampling failed: {result}",
                status_code=400,
                err_type="BadRequestError",
            )
            return 0
        token, logprob, top = result
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            seq.finish = FinishReason(
                type="abort",
                message=f"grammar refused token {token}",
                status_code=500,
                err_type="InternalServerError",
            )
            return token
        if seq.chosen is not None:  # from the row's state before this token, on the host
            logp = reported_logprobs(logits.cpu(), seq.row)
            seq.chosen.append(chosen_logprobs(logp, seq.req.token_ids_logprob or []))
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
        context = self.runner.context_length
        for seq, pos in zip(self.batch.seqs, self.batch.positions.tolist(), strict=True):
            if seq.finish is None:
                seq.finish = finish_reason(seq, pos, self.eos_ids, self.tokenizer, context)
        self._drop(lambda s: s.finish is not None, abort=False)

    def _drop(self, done: Callable[[Seq], bool], *, abort: bool) -> None:
        b = self.batch
        keep = [i for i, s in enumerate(b.seqs) if not done(s)]
        if len(keep) == len(b.seqs):
            return
        for i, s in enumerate(b.seqs):
            if i not in keep:
                if abort and s.finish is None:
                    s.finish = FinishReason(type="abort", message="Aborted")
                self._done(s)
        b.select(keep, self.runner.device)


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
