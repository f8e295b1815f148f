"""Prefilled prompts kept for the requests that repeat them.

A GRPO group's n samples (or pass@k's k) share one prompt, but they reach the engine one
by one as running rows finish, so sharing a prefill only within one admission misses most
of them. ``PromptCache`` keeps, per prompt (exact token ids; partial prefixes are not
matched), each layer's keys and values over its positions and the logits of its next
token, least recently used first out past ``max_positions`` positions.

KV is a function of the weights: the scheduler clears the cache at the first step boundary
after the runner's ``weights_epoch`` moves (every weight update calls
``ModelRunner.invalidate``), so no prompt is served KV of weights older than its own
prefill would see.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Prefilled:
    """One prompt's prefill: per layer ``[kv_heads, length, head_dim]`` keys and values,
    and ``last`` ``[V]``, the logits of the token after it (in the model's dtype)."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    last: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[1]) if self.keys else 0

    @property
    def cost(self) -> int:
        """Positions it holds, its logits counted as the positions their bytes would take:
        ``length + ceil(bytes(last) / (bytes(KV) / length))``."""
        kv = sum(t.nbytes for t in (*self.keys, *self.values))
        if not kv:
            return 0
        return self.length + -(-self.last.nbytes * self.length // kv)


def prefilled(cache: Any, row: int, length: int, last: torch.Tensor) -> Prefilled:
    """Row ``row`` of a prefill's left-padded ``cache`` (its ``length`` real positions at
    the right end) and its next-token logits, copied out of the batch's slabs."""
    keys = tuple(layer.keys[row, :, -length:].clone() for layer in cache.layers)
    values = tuple(layer.values[row, :, -length:].clone() for layer in cache.layers)
    return Prefilled(keys, values, last.clone())


class PromptCache:
    """Exact-match LRU of ``Prefilled`` prompts, at most ``max_positions`` positions in all
    (``Prefilled.cost``; 0: off). Used from the engine's step thread only."""

    def __init__(self, max_positions: int) -> None:
        if max_positions < 0:
            raise ValueError(f"max_positions must be >= 0, got {max_positions}")
        self.max_positions = max_positions
        self.epoch = 0  # the runner's weights_epoch the entries were computed at
        self.positions = 0
        self._entries: OrderedDict[tuple[int, ...], Prefilled] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def fits(self, length: int) -> bool:
        """Whether a prompt of ``length`` positions could be kept (before its logits)."""
        return 0 < length < self.max_positions

    def get(self, prompt: tuple[int, ...], epoch: int) -> Prefilled | None:
        """The entry of ``prompt`` at weights ``epoch`` (an older epoch clears all)."""
        self.at(epoch)
        entry = self._entries.get(prompt)
        if entry is not None:
            self._entries.move_to_end(prompt)
        return entry

    def put(self, prompt: tuple[int, ...], entry: Prefilled, epoch: int) -> None:
        """Keep ``entry`` (its tensors must not alias a batch's slabs), evicting the least
        recently used past the budget; an entry over the whole budget is not kept."""
        self.at(epoch)
        cost = entry.cost
        if cost > self.max_positions or prompt in self._entries:
            return
        self._entries[prompt] = entry
        self.positions += cost
        while self.positions > self.max_positions:
            _, old = self._entries.popitem(last=False)
            self.positions -= old.cost

    def clear(self) -> None:
        self._entries.clear()
        self.positions = 0

    def at(self, epoch: int) -> None:
        """Entries are of weights ``epoch`` from now: those of another are dropped."""
        if epoch != self.epoch:
            self.clear()
            self.epoch = epoch
