"""The running batch of ``TorchEngine``: its rows and their left-padded KV cache.

The cache is one ``DynamicCache`` with ``[batch, kv_heads, L, head_dim]`` tensors per
layer, left-padded: row ``i`` holds its tokens at the right end, ``mask[i]`` marks real
positions, ``positions[i]`` is its next position id and ``last[i]`` its newest token,
which the cache never holds (it is the next input). ``add`` merges prefilled rows by
padding the narrower side on the left; ``select`` keeps some rows and trims the leading
columns that became padding in every row.

Users: ``TorchEngine`` (``torch_engine.py``), from its step thread only.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch

Row = TypeVar("Row")


class KVBatch(Generic[Row]):
    """The running rows (the engine's sequences) and the tensors that belong to them."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Drop every row and the cache."""
        self.seqs: list[Row] = []
        self.cache: Any = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.positions = torch.zeros(0, dtype=torch.long)
        self.last = torch.zeros(0, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        """KV positions in use plus each row's pending token."""
        return int(self.mask.sum()) + len(self.seqs)

    def add(self, seqs: list[Row], cache: Any, mask: torch.Tensor, tokens: list[int]) -> None:
        """Append prefilled rows: their cache and mask (left-padded) and first tokens."""
        new_pos = mask.sum(-1)
        if not self.seqs:
            self.cache, self.mask, self.positions = cache, mask, new_pos
            self.last, self.seqs = torch.tensor(tokens), list(seqs)
            return
        width = max(self.mask.shape[1], mask.shape[1])
        self.cache = _concat_caches(self.cache, cache, width)
        self.mask = torch.cat([_lpad(self.mask, width), _lpad(mask, width)])
        self.positions = torch.cat([self.positions, new_pos])
        self.last = torch.cat([self.last, torch.tensor(tokens)])
        self.seqs += seqs

    def select(self, keep: list[int], device: torch.device) -> None:
        """Keep rows ``keep`` (in that order) and drop the rest's KV."""
        if not keep:
            self.clear()
            return
        index = torch.tensor(keep)
        self.cache.batch_select_indices(index.to(device))
        self.seqs = [self.seqs[i] for i in keep]
        self.mask, self.positions = self.mask[index], self.positions[index]
        self.last = self.last[index]
        self._trim_left()

    def _trim_left(self) -> None:
        """Drop leading columns that are padding in every row (after rows left the batch)."""
        live = self.mask.any(dim=0).nonzero()
        start = int(live[0]) if live.numel() else self.mask.shape[1]
        if start == 0:
            return
        self.mask = self.mask[:, start:]
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]


def _lpad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad the last dimension of ``t`` with zeros to ``width``."""
    pad = width - t.shape[-1]
    return t if pad == 0 else torch.nn.functional.pad(t, (pad, 0))


def _concat_caches(a: Any, b: Any, width: int) -> Any:
    """Batch-concatenate two left-padded caches, both padded to ``width``."""
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
