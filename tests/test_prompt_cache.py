"""The prompt cache: exact-match LRU within a position budget that counts each entry's
logits, cleared when the weights' epoch moves."""

from __future__ import annotations

import pytest
import torch

from asyncrl.engines.torch.prompt_cache import Prefilled, PromptCache


def entry(length: int, vocab: int = 8, layers: int = 2) -> Prefilled:
    """KV of ``[2 heads, length, 4]`` per layer (64 bytes a position in all, fp32) and
    ``vocab`` logits."""
    kv = tuple(torch.zeros(2, length, 4) for _ in range(layers))
    return Prefilled(kv, kv, torch.zeros(vocab))


def test_an_entry_costs_its_positions_and_its_logits_in_positions() -> None:
    assert entry(10).cost == 10 + 1  # 32 bytes of logits, 128 bytes a position: one more
    assert entry(10, vocab=33).cost == 10 + 2  # 132 bytes: two positions, rounded up
    assert entry(0).cost == 0


def test_least_recently_used_go_first_past_the_budget() -> None:
    cache = PromptCache(max_positions=24)
    for key in (1, 2):
        cache.put((key,), entry(10), epoch=0)  # 11 positions each
    assert cache.get((1,), epoch=0) is not None  # 1 is now the most recent
    cache.put((3,), entry(10), epoch=0)
    assert [k for k in ((1,), (2,), (3,)) if cache.get(k, epoch=0)] == [(1,), (3,)]
    assert cache.positions == 22
    cache.put((4,), entry(30), epoch=0)  # over the whole budget: not kept, nothing evicted
    assert len(cache) == 2 and cache.get((4,), epoch=0) is None


def test_a_new_weights_epoch_empties_the_cache() -> None:
    cache = PromptCache(max_positions=100)
    cache.put((1, 2), entry(2), epoch=0)
    assert cache.get((1, 2), epoch=0) is not None
    assert cache.get((1, 2), epoch=1) is None and cache.positions == 0
    cache.put((1, 2), entry(2), epoch=1)
    cache.at(2)
    assert len(cache) == 0


def test_an_off_cache_keeps_nothing_and_a_negative_budget_is_refused() -> None:
    cache = PromptCache(max_positions=0)
    assert not cache.fits(1)
    cache.put((1,), entry(1), epoch=0)
    assert len(cache) == 0
    with pytest.raises(ValueError, match="max_positions"):
        PromptCache(-1)
