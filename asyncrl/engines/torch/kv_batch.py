"""The running batch of ``TorchEngine``: its rows and their left-padded KV cache.

The cache holds ``[batch, kv_heads, L, head_dim]`` keys and values per layer, left-padded:
row ``i`` holds its tokens at the right end, ``mask[i]`` marks real positions,
``positions[i]`` is its next position id and ``last[i]`` its newest token, which the
cache never holds (it is the next input). Each layer is a ``SlabLayer``, a preallocated
slab with room on the right, so a decode step writes one column in place where Hugging
Face's ``DynamicLayer`` copies the whole cache. Rows that finish are replaced by the last
rows, and rows that join are written into the slab's free rows, so a batch that turns
over every step (an eval of thousands of requests) copies only the rows that move, not
the whole cache. Used from the engine's step thread only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch
from transformers.cache_utils import Cache, DynamicLayer

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
        """Append prefilled rows: their cache and mask (left-padded) and first tokens; the
        narrower side is padded on the left to the wider."""
        new_pos = mask.sum(-1)
        if not self.seqs:
            self.cache, self.mask, self.positions = cache, mask, new_pos
            self.last, self.seqs = torch.tensor(tokens), list(seqs)
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.append_rows(new, width)
        self.mask = torch.cat([_lpad(self.mask, width), _lpad(mask, width)])
        self.positions = torch.cat([self.positions, new_pos])
        self.last = torch.cat([self.last, torch.tensor(tokens)])
        self.seqs += seqs

    def decode(self, forward: Any) -> torch.Tensor:
        """One step of every row: the float logits ``[rows, V]`` of their next tokens
        (``forward``: the runner's), their newest tokens' KV appended."""
        mask = torch.cat([self.mask, torch.ones(len(self), 1, dtype=torch.long)], dim=1)
        logits = forward(self.last[:, None], mask, self.positions[:, None], self.cache, keep=1)
        self.mask, self.positions = mask, self.positions + 1
        return logits[:, -1, :].float()

    def select(self, keep: list[int], device: torch.device) -> None:
        """Keep rows ``keep`` (a set: its order is not kept), drop the rest's KV, and trim
        the leading columns that became padding in every row. Each dropped row takes the
        last kept row in its place (``seqs`` gives the new order): only the moved rows'
        KV is copied."""
        if not keep:
            self.clear()
            return
        order = swap_removed(len(self.seqs), keep)
        moved = [(i, j) for i, j in enumerate(order) if i != j]
        if moved:
            dst, src = (torch.tensor(x, device=device) for x in zip(*moved, strict=True))
        for layer in self.cache.layers:
            layer.keep_rows(len(order), *((src, dst) if moved else ()))
        index = torch.tensor(order)
        self.seqs = [self.seqs[i] for i in order]
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
            layer.trim_left(start)


def swap_removed(rows: int, keep: list[int]) -> list[int]:
    """The old row of each new row when the rows not in ``keep`` leave and each leaving
    row below the new count takes the last kept row: ``swap_removed(5, [0, 2, 4]) ==
    [0, 4, 2]``."""
    order = list(range(rows))
    for row in sorted(set(order) - set(keep), reverse=True):
        order[row] = order[-1]  # every row past it has left already: the last is kept
        order.pop()
    return order


def _lpad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad the last dimension of ``t`` with zeros to ``width``."""
    pad = width - t.shape[-1]
    return t if pad == 0 else torch.nn.functional.pad(t, (pad, 0))


def new_cache() -> Any:
    """An empty cache whose layers are ``SlabLayer``s, for a prefill to fill."""
    return Cache(layer_class_to_replicate=SlabLayer)


def cache_of_rows(parts: Sequence[Any]) -> tuple[Any, torch.Tensor]:
    """A left-padded cache holding ``parts`` as its rows (each a ``Prefilled``: per layer
    ``[kv_heads, length, head_dim]`` keys and values) and its mask."""
    width = max(p.length for p in parts)
    mask = torch.zeros(len(parts), width, dtype=torch.long)
    for i, p in enumerate(parts):
        mask[i, width - p.length :] = 1
    cache = new_cache()
    cache.layers = [
        SlabLayer.of_rows([p.keys[n] for p in parts], [p.values[n] for p in parts], width)
        for n in range(len(parts[0].keys))
    ]
    return cache, mask


class SlabLayer(DynamicLayer):
    """One layer's keys and values in slabs ``[rows, heads, capacity, d]``; rows ``:b``
    and columns ``lo:n`` are the cache (``keys``/``values`` are views of them).

    ``update`` writes new columns at ``n``; when the slab is full it moves the live
    columns into a slab with room (``_room``; amortised O(1) per column) and no free
    rows. ``trim_left`` moves ``lo``; ``keep_rows`` moves rows within the slab;
    ``append_rows`` writes joining rows into free rows, or into a new slab when there
    are too few or they reach further left than the slab's columns.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.lo = self.n = 0
        self.b = key_states.shape[0]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        self._reserve(key_states, value_states, t)
        assert self._k is not None and self._v is not None
        self._k[: self.b, :, self.n : self.n + t] = key_states
        self._v[: self.b, :, self.n : self.n + t] = value_states
        self.n += t
        self._expose()
        return self.keys, self.values

    def _reserve(self, k: torch.Tensor, v: torch.Tensor, t: int) -> None:
        """Room for ``t`` more columns: the live ones move into fresh slabs when needed."""
        if self._k is not None and self.n + t <= self._k.shape[2]:
            return
        live = self.n - self.lo
        capacity = _room(live + t)
        self._k = self._moved(self._k, k, capacity, live)
        self._v = self._moved(self._v, v, capacity, live)
        self.lo, self.n = 0, live

    def _moved(
        self, slab: torch.Tensor | None, like: torch.Tensor, capacity: int, live: int
    ) -> torch.Tensor:
        b, heads, _, d = like.shape
        fresh = like.new_empty(b, heads, capacity, d)
        if live:
            assert slab is not None
            fresh[:, :, :live] = slab[:b, :, self.lo : self.n]
        return fresh

    def _expose(self) -> None:
        assert self._k is not None and self._v is not None
        self.keys = self._k[: self.b, :, self.lo : self.n]
        self.values = self._v[: self.b, :, self.lo : self.n]

    def get_seq_length(self) -> int:
        return self.n - self.lo if self.is_initialized else 0

    def trim_left(self, start: int) -> None:
        """Drop the ``start`` leading columns."""
        self.lo = min(self.lo + start, self.n)
        self._expose()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        if tokens_to_remove and self.is_initialized:
            self.n = max(self.lo, self.n + tokens_to_remove)
            self._expose()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("the engine never repeats rows of its running batch")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("the engine runs no beam search")

    def offload(self) -> None:
        raise NotImplementedError("the engine's cache stays on its device")

    def prefetch(self) -> None:
        raise NotImplementedError("the engine's cache stays on its device")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (in that order): their live columns go into fresh slabs
        with room (Hugging Face's interface; the engine uses ``keep_rows``)."""
        if not self.is_initialized or self._k is None:
            return
        live = self.n - self.lo
        capacity = _room(live)
        for name in ("_k", "_v"):
            kept = getattr(self, name)[:, :, self.lo : self.n].index_select(0, indices)
            slab = kept.new_empty(kept.shape[0], kept.shape[1], capacity, kept.shape[3])
            slab[:, :, :live] = kept
            setattr(self, name, slab)
        self.lo, self.n, self.b = 0, live, len(indices)
        self._expose()

    def keep_rows(
        self, rows: int, src: torch.Tensor | None = None, dst: torch.Tensor | None = None
    ) -> None:
        """The first ``rows`` rows stay, after rows ``src`` are copied into rows ``dst``
        (live columns only; ``dst`` below ``rows``, ``src`` not); the rest become free.
        A slab left more than half free moves into one of ``rows`` rows, so free rows
        never hold more than the live ones (``PEAK_COPIES``)."""
        if not self.is_initialized or self._k is None:
            return
        assert self._v is not None
        if src is not None and dst is not None:
            span = slice(self.lo, self.n)
            self._k[dst, :, span] = self._k[src, :, span]
            self._v[dst, :, span] = self._v[src, :, span]
        self.b = rows
        if 2 * rows < self._k.shape[0]:
            live = self.n - self.lo
            self._k = self._moved(self._k, self._k[:rows], _room(live), live)
            self._v = self._moved(self._v, self._v[:rows], _room(live), live)
            self.lo, self.n = 0, live
        self._expose()

    def append_rows(self, other: Any, width: int) -> None:
        """Rows of ``other`` (a prefill's left-padded layer) after this layer's, both
        left-padded with zeros to ``width`` columns: in place where the slab has the free
        rows and ``width`` columns left of ``n``, else in a new slab (``stacked``)."""
        assert self._k is not None and self._v is not None
        k_new, rows = other.keys, self.b + other.keys.shape[0]
        lo = self.n - width
        if rows > self._k.shape[0] or lo < 0:
            merged = SlabLayer.stacked(self, other, width)
            self._k, self._v, self.lo, self.n, self.b = merged._k, merged._v, 0, width, rows
            self._expose()
            return
        cols = k_new.shape[2]
        for slab, part in ((self._k, k_new), (self._v, other.values)):
            slab[: self.b, :, lo : self.lo] = 0  # zeros, not stale or unset (``stacked``)
            block = slab[self.b : rows]
            block[:, :, lo : self.n - cols] = 0
            block[:, :, self.n - cols : self.n] = part
        self.lo, self.b = lo, rows
        self._expose()

    @classmethod
    def stacked(cls, a: Any, b: Any, width: int) -> SlabLayer:
        """Rows of ``a`` then ``b``, each left-padded with zeros to ``width`` columns
        (zeros, not garbage: masked scores are ``q.k - inf``, and garbage can be NaN)."""
        layer = cls()
        ka, kb = a.keys, b.keys
        layer.lazy_initialization(ka, a.values)
        rows, heads, d = ka.shape[0] + kb.shape[0], ka.shape[1], ka.shape[3]
        layer._k = ka.new_empty(rows, heads, _room(width), d)
        layer._v = ka.new_empty(rows, heads, _room(width), d)
        for lo_row, src in ((0, a), (ka.shape[0], b)):
            n_rows, cols = src.keys.shape[0], src.keys.shape[2]
            for slab, part in ((layer._k, src.keys), (layer._v, src.values)):
                block = slab[lo_row : lo_row + n_rows]
                block[:, :, : width - cols] = 0  # columns past width are written before read
                block[:, :, width - cols : width] = part
        layer.n, layer.b = width, rows
        layer._expose()
        return layer

    @classmethod
    def of_rows(cls, keys: list[torch.Tensor], values: list[torch.Tensor], width: int) -> SlabLayer:
        """Row ``i`` holds ``keys[i]``/``values[i]`` (``[heads, length_i, d]``) at the right
        end of ``width`` columns, zeros on its left (as ``stacked``)."""
        layer = cls()
        layer.lazy_initialization(keys[0][None], values[0][None])
        heads, d = keys[0].shape[0], keys[0].shape[2]
        layer._k = keys[0].new_zeros(len(keys), heads, _room(width), d)
        layer._v = values[0].new_zeros(len(keys), heads, _room(width), d)
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            layer._k[i, :, width - k.shape[1] : width] = k
            layer._v[i, :, width - v.shape[1] : width] = v
        layer.n, layer.b = width, len(keys)
        layer._expose()
        return layer


#: Copies of a padded KV position's keys and values alive at a peak: a slab holds up to
#: half again as many columns (``_room``), and a merge (``stacked``) fills the new slab
#: while the old one lives. (Free rows, at most as many as the live ones, can make the
#: old slab up to twice its live rows at a merge: a rare peak this does not count.)
PEAK_COPIES = 3.0


def kv_bytes_per_position(config: Any, dtype: torch.dtype) -> int:
    """Bytes one position takes in the cache of every layer:
    ``2 (keys, values) x layers x kv_heads x head_dim x itemsize``."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def kv_position_budget(bytes_per_position: int, memory: int, fraction: float) -> int:
    """Padded positions (rows x columns) whose peak (``PEAK_COPIES``) fits in
    ``fraction`` of ``memory`` bytes."""
    return max(1, int(memory * fraction / (bytes_per_position * PEAK_COPIES)))


def available_memory(device: torch.device) -> int:
    """Bytes free for a new cache now: the accelerator's free memory, or the host's
    ``MemAvailable`` (what can be had without swapping)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _room(columns: int) -> int:
    """A slab's capacity for ``columns`` live ones: half again, at least 64 more, rounded
    up to 64 (amortised O(1) per appended column; at most 1.5x the cache plus the copy
    being made while a slab moves)."""
    return -(-(columns + max(columns // 2, 64)) // 64) * 64
