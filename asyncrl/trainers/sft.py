"""Supervised fine-tuning with the RL trainer's backend: ``asyncrl sft``.

Rows are chats (loss on the assistant turns) or prompt/response pairs (``load_examples``).
Token-exact: a row is rendered and tokenised once, and each token's loss mask comes from
the character span it covers, so no boundary is re-tokenised. The loss is the token-mean
cross-entropy, label-smoothed when ``label_smoothing = eps > 0``:
``(1 - eps) * NLL + eps * CE(uniform)``.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from asyncrl.buffer.sources import DataError, check_chat, read_objects

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncrl.trainers.base import StepResult, Trainer


class SFTConfig(BaseModel):
    """An ``asyncrl sft`` job: data, schedule and output. The model comes from ``trainer``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    data: str = Field(..., min_length=1, description="jsonl/parquet file, optionally @[a:b].")
    messages_key: str = Field("messages", description="Key of chat rows.")
    prompt_key: str = Field("prompt", description="Key of the prompt of pair rows.")
    response_key: str = Field("response", description="Key of the response of pair rows.")
    max_len: int = Field(2048, ge=2, description="Longer examples are refused, not cut.")
    epochs: int = Field(1, ge=1, description="Passes over the data.")
    batch_size: int = Field(8, ge=1, description="Examples per optimizer step.")
    seed: int = Field(0, description="Shuffle seed (a new order each epoch).")
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=1.0, description="Share eps of each target spread over the vocabulary."
    )
    output_dir: str = Field("runs/sft", description="Metrics and the final HF model go here.")


@dataclass(frozen=True, slots=True)
class SFTExample:
    """One training sequence: token ids and a 0/1 loss mask of the same length."""

    where: str
    tokens: np.ndarray
    loss_mask: np.ndarray


def load_examples(cfg: SFTConfig, tokenizer: PreTrainedTokenizerBase) -> list[SFTExample]:
    """Read, validate and tokenise every selected row; raises ``DataError``.

    Data is jsonl or parquet (``path@[a:b]`` slicing, as for RL prompts), rows of two shapes:

    - chat: ``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered with the
      tokenizer's chat template; the loss covers what the template adds for each assistant
      turn, end-of-turn token included. An optional ``"tools"`` list of JSON schemas goes
      to the template, as the RL data source passes it, so tool-use traces train on the
      prompts RL will show;
    - pairs: ``{"prompt": "...", "response": "..."}``; the loss covers the response and EOS.

    A malformed row, or a template that is not prefix-stable (rendering the first k
    messages is not a prefix of rendering them all), is a ``DataError`` naming file and line.
    """
    examples = [_example(where, obj, cfg, tokenizer) for where, obj in read_objects(cfg.data)]
    for ex in examples:
        if len(ex.tokens) > cfg.max_len:
            raise DataError(f"{ex.where}: {len(ex.tokens)} tokens > max_len {cfg.max_len}")
        if not ex.loss_mask.any():
            raise DataError(f"{ex.where}: nothing to learn (no assistant or response tokens)")
    return examples


def _example(
    where: str, obj: dict[str, Any], cfg: SFTConfig, tokenizer: PreTrainedTokenizerBase
) -> SFTExample:
    if cfg.messages_key in obj:
        messages = check_chat(where, cfg.messages_key, obj[cfg.messages_key])
        return _chat_example(where, messages, tokenizer, _tools(where, obj.get("tools")))
    if cfg.prompt_key in obj and cfg.response_key in obj:
        return _pair_example(where, obj[cfg.prompt_key], obj[cfg.response_key], tokenizer)
    keys = ", ".join(map(repr, obj))
    raise DataError(
        f"{where}: expected {cfg.messages_key!r} (chat) or {cfg.prompt_key!r} and "
        f"{cfg.response_key!r} (pairs); the row has {keys or 'no keys'}"
    )


def _pair_example(
    where: str, prompt: Any, response: Any, tokenizer: PreTrainedTokenizerBase
) -> SFTExample:
    if not isinstance(prompt, str) or not isinstance(response, str) or not response:
        raise DataError(f"{where}: prompt and response must be strings, response non-empty")
    eos = tokenizer.eos_token or ""
    return _masked(where, prompt + response + eos, [(len(prompt), None)], tokenizer)


def _tools(where: str, tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: tools must be a list of JSON-schema objects")
    return tools or None


def _chat_example(
    where: str,
    messages: list[Any],
    tokenizer: PreTrainedTokenizerBase,
    tools: list[dict[str, Any]] | None = None,
) -> SFTExample:
    def render(msgs: list[Any], generation_prompt: bool) -> str:
        try:
            text = tokenizer.apply_chat_template(
                msgs, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
            )
        except Exception as exc:  # a jinja template is user code and may raise anything
            raise DataError(f"{where}: chat template failed: {exc}") from exc
        return str(text)

    full = render(messages, False)
    spans: list[tuple[int, int | None]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = render(messages[:i], True), render(messages[: i + 1], False)
        if not (end.startswith(start) and full.startswith(end)):
            raise DataError(f"{where}: the chat template is not prefix-stable at message {i}")
        spans.append((len(start), len(end)))
    return _masked(where, full, spans, tokenizer)


def _masked(
    where: str,
    text: str,
    spans: list[tuple[int, int | None]],
    tokenizer: PreTrainedTokenizerBase,
) -> SFTExample:
    """Tokenise ``text`` once; a token is trained when its first character is in a span."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.array([a for a, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=np.uint8)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < (len(text) if hi is None else hi))
    return SFTExample(where, np.asarray(enc["input_ids"], dtype=np.int32), mask)


def batches(examples: list[SFTExample], cfg: SFTConfig) -> Iterator[list[SFTExample]]:
    """``batch_size`` examples at a time, reshuffled every epoch with ``seed + epoch``."""
    for epoch in range(cfg.epochs):
        order = list(range(len(examples)))
        random.Random(cfg.seed + epoch).shuffle(order)
        for i in range(0, len(order), cfg.batch_size):
            yield [examples[j] for j in order[i : i + cfg.batch_size]]


def run_sft(cfg: SFTConfig, trainer: Trainer, examples: list[SFTExample]) -> list[StepResult]:
    """Train on ``examples``; writes ``metrics.jsonl`` and the final model (HF layout)."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: list[StepResult] = []
    with (out / "metrics.jsonl").open("w") as sink:
        for batch in batches(examples, cfg):
            start = time.perf_counter()
            result = trainer.sft_step(
                [e.tokens for e in batch], [e.loss_mask for e in batch], cfg.label_smoothing
            )
            row = {"step": result.version, "time/step": time.perf_counter() - start}
            sink.write(json.dumps(row | result.metrics) + "\n")
            results.append(result)
    trainer.save_hf(out / "model")
    return results


def job_model() -> type[BaseModel]:
    """``SFTConfig`` plus a ``trainer`` section: the config tree of ``asyncrl sft``.

    Built on demand, so importing this module stays light.
    """
    from asyncrl.trainers.config import TrainerConfig

    class SFTJob(SFTConfig):
        """An ``asyncrl sft`` job: data and schedule, and the torch trainer's settings."""

        trainer: TrainerConfig = Field(..., description="model, optimizer, micro-batches")

    return SFTJob
