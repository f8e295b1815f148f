"""A reward model: an HF sequence-classification model scoring (prompt, response) pairs in
batches, in process or behind the reward actor (``actors/reward_model.py``).

    score = logits[label_index]   of the classification head at the pair's last token

(transformers reads the last token that is not padding, by ``config.pad_token_id``, set
from the tokenizer when the model lacks one). A pair longer than ``max_length`` tokens
fails alone, with its length: a truncated pair's score would be the score of another text.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from asyncrl.observe.logs import get_logger
from asyncrl.types import ChatMessage
from asyncrl.wire.codec import Codec, Message
from asyncrl.wire.errors import PeerLost

if TYPE_CHECKING:
    from asyncrl.rollout.reward_config import RewardModelConfig
    from asyncrl.wire.rpc import RpcClient

log = get_logger("asyncrl.reward_model")


class RewardModelError(RuntimeError):
    """A pair could not be scored; the message is the reason."""


class RewardModelRequest(Message):
    """Pairs to score: each prompt (text or chat messages) with its response."""

    prompts: list[str | list[ChatMessage]]
    responses: list[str]


class RewardModelReply(Message):
    """One entry a pair, in order: its score, or why it has none."""

    scores: list[float | None]
    errors: list[str | None]


REQUEST_CODEC = Codec(RewardModelRequest)
REPLY_CODEC = Codec(RewardModelReply)


@dataclass(slots=True)
class _Pending:
    prompt: str | list[ChatMessage]
    response: str
    done: asyncio.Future[float] = field(repr=False)


class RewardModel:
    """The batched scorer; an async context manager that loads the model on entry and
    stops its batch task on exit.

    One task takes up to ``batch_size`` queued pairs, waiting ``batch_wait_ms`` after the
    first for more, and runs one forward on a thread of its own (torch's intra-op threads
    stay with one caller, as the engine's do). A forward that raises fails that batch's
    pairs with the reason, and the next batch runs.
    """

    def __init__(self, config: RewardModelConfig) -> None:
        self.config = config
        self.stats: dict[str, float] = {
            "rm/pairs": 0,
            "rm/batches": 0,
            "rm/failed": 0,
            "rm/forward_s": 0.0,
        }
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="reward-model")
        self._tg: asyncio.TaskGroup | None = None
        self._batcher: asyncio.Task[None] | None = None
        self._running: list[_Pending] = []  # the batch on the model's thread

    async def __aenter__(self) -> Self:
        loop = asyncio.get_running_loop()
        self.model, self.tokenizer = await loop.run_in_executor(self._thread, self._load)
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._batcher = self._tg.create_task(self._batches(), name="reward-model.batches")
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._tg is not None and self._batcher is not None
        self._batcher.cancel()
        await self._tg.__aexit__(None, None, None)
        # Nothing waits forever on a closed model: the batch cut short, then the queue.
        for p in self._running:
            if not p.done.done():
                p.done.set_exception(RewardModelError("the reward model closed"))
        while not self._queue.empty():
            self._queue.get_nowait().done.set_exception(RewardModelError("the reward model closed"))
        # A forward still on the thread finishes there; the loop does not wait on it.
        await asyncio.to_thread(self._thread.shutdown, wait=True)

    def _load(self) -> tuple[Any, Any]:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        tokenizer = AutoTokenizer.from_pretrained(cfg.path)
        model = AutoModelForSequenceClassification.from_pretrained(
            cfg.path, dtype=getattr(torch, cfg.dtype)
        )
        labels = model.config.num_labels
        if cfg.label_index >= labels:
            raise RewardModelError(
                f"reward model {cfg.path}: label_index {cfg.label_index} but the head has "
                f"{labels} label(s)"
            )
        # Pad with the id the head skips: the model's, else the tokenizer's, else EOS.
        if model.config.pad_token_id is not None:
            tokenizer.pad_token_id = model.config.pad_token_id
        elif tokenizer.pad_token_id is None:  # Llama-style tokenizers have none
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        log.info("reward model ready", path=cfg.path, labels=labels, device=cfg.device)
        return model.to(cfg.device).eval(), tokenizer

    # -- scoring ------------------------------------------------------------------------
    async def score(self, prompt: str | list[ChatMessage], response: str) -> float:
        """The score of one pair; ``RewardModelError`` with the reason if it has none."""
        done: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(prompt, response, done))
        return await done

    async def score_many(
        self, prompts: list[str | list[ChatMessage]], responses: list[str]
    ) -> list[float | RewardModelError]:
        """Every pair's score or its error, in order (they join the same batches)."""
        calls = [self.score(p, r) for p, r in zip(prompts, responses, strict=True)]
        out = await asyncio.gather(*calls, return_exceptions=True)
        return [_score_or_error(x) for x in out]

    async def _batches(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self.config.batch_wait_ms / 1000
            while len(batch) < self.config.batch_size:
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), deadline - loop.time()))
                except TimeoutError:
                    break
            batch = [p for p in batch if not p.done.done()]  # their callers gave up
            if batch:
                await self._run(loop, batch)

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[_Pending]) -> None:
        start = time.perf_counter()
        self._running = batch
        try:
            results = await loop.run_in_executor(self._thread, self._forward, batch)
        except Exception as exc:  # the batch fails with the reason; the model goes on
            results = [RewardModelError(f"reward model forward: {type(exc).__name__}: {exc}")]
            results *= len(batch)
        self.stats["rm/forward_s"] += time.perf_counter() - start
        self.stats["rm/batches"] += 1
        for p, result in zip(batch, results, strict=True):
            self.stats["rm/pairs"] += 1
            if p.done.done():
                continue
            if isinstance(result, RewardModelError):
                self.stats["rm/failed"] += 1
                p.done.set_exception(result)
            else:
                p.done.set_result(result)

    def _forward(self, batch: list[_Pending]) -> list[float | RewardModelError]:
        """Scores of ``batch`` (on the model's thread); a pair over ``max_length`` gets its
        error and stays out of the forward."""
        import torch

        out: list[float | RewardModelError] = [0.0] * len(batch)
        ids: list[list[int]] = [[] for _ in batch]
        fits = []
        for i, p in enumerate(batch):  # a pair that cannot be encoded fails alone
            try:
                ids[i] = self.encode(p.prompt, p.response)
            except Exception as exc:  # a chat template may raise on the messages
                reason = f"the pair cannot be encoded: {type(exc).__name__}: {exc}"
                out[i] = RewardModelError(reason)
                continue
            if len(ids[i]) > self.config.max_length:
                out[i] = RewardModelError(
                    f"the pair has {len(ids[i])} tokens, over the reward model's max_length "
                    f"{self.config.max_length}"
                )
            else:
                fits.append(i)
        if not fits:
            return out
        padded = self.tokenizer.pad({"input_ids": [ids[i] for i in fits]}, return_tensors="pt")
        device = self.config.device
        with torch.inference_mode():
            logits = self.model(
                input_ids=padded["input_ids"].to(device),
                attention_mask=padded["attention_mask"].to(device),
            ).logits
        scores = logits[:, self.config.label_index].float().tolist()
        for i, score in zip(fits, scores, strict=True):
            out[i] = score
        return out

    def encode(self, prompt: str | list[ChatMessage], response: str) -> list[int]:
        """The token ids the model scores for one pair: the chat template's text, else
        the prompt and response as a text pair with the tokenizer's special tokens (an
        encoder's ``[CLS] prompt [SEP] response [SEP]``)."""
        if self.tokenizer.chat_template:
            return self.tokenizer(self.text(prompt, response), add_special_tokens=False)[
                "input_ids"
            ]
        head = prompt if isinstance(prompt, str) else "".join(str(m["content"]) for m in prompt)
        return self.tokenizer(head, response)["input_ids"]

    def text(self, prompt: str | list[ChatMessage], response: str) -> str:
        """The text the model scores for one pair: with a chat template, its rendering of
        the prompt's messages (a string prompt is one user turn) and the response as an
        assistant turn, as TRL's reward models read conversations; else the two joined."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if self.tokenizer.chat_template:
            chat = [*messages, {"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(chat, tokenize=False)
        head = prompt if isinstance(prompt, str) else "".join(str(m["content"]) for m in prompt)
        return head + response


def _score_or_error(value: object) -> float | RewardModelError:
    if isinstance(value, float):
        return value
    if isinstance(value, RewardModelError):
        return value
    return RewardModelError(f"{type(value).__name__}: {value}")


class RewardModelClient:
    """Scores one pair at a time through the reward actor (``RpcClient`` to its
    ``reward.score``); a call lost with the actor (it restarts) is sent again until
    ``timeout_s``, the scorer's bound around it."""

    def __init__(self, rpc: RpcClient[RewardModelRequest, RewardModelReply]) -> None:
        self.rpc = rpc

    async def score(self, prompt: str | list[ChatMessage], response: str) -> float:
        request = RewardModelRequest(prompts=[prompt], responses=[response])
        delay = 0.1
        while True:
            try:
                reply = await self.rpc.call(request)
                break
            except PeerLost as exc:  # a score has no side effect: send it again
                log.warning("reward actor lost; retrying", error=str(exc))
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
        score, error = reply.scores[0], reply.errors[0]
        if score is None:
            raise RewardModelError(error or "the reward actor gave no score")
        return score
