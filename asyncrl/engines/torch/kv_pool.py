"""A static KV pool for decoding under CUDA graphs: per layer one preallocated
``[rows, kv_heads, max_len, head_dim]`` tensor of keys and one of values.

Running sequence ``i`` owns row ``i`` (rows stay compact: a finished row is replaced by
the last one), its tokens at positions ``0 .. length[i] - 1`` from the left. A decode
step for a batch padded to ``b`` rows attends to the views ``keys[:b, :, :span]``: their
addresses never change, so a step captured once replays for any rows of that bucket.
Sized as SGLang sizes its pool: ``rows x max_len`` positions from ``mem_fraction`` of
the free memory (``kv_batch.kv_position_budget``).
"""

from __future__ import annotations

from typing import Any

import torch


def pool_max_len(
    bytes_per_position: int, memory: int, fraction: float, rows: int, context: int
) -> int:
    """The longest sequence a pool of ``rows`` rows can hold in ``fraction`` of ``memory``
    bytes (no copies: the pool never moves), at most ``context``; 0 when not one
    position per row fits."""
    return min(context, int(memory * fraction) // (bytes_per_position * rows))


class KVPool:
    """Keys and values of up to ``rows`` sequences of up to ``max_len`` positions."""

    def __init__(
        self,
        *,
        layers: int,
        rows: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.shape, self.layers = (rows, kv_heads, max_len, head_dim), layers
        self.dtype, self.device = dtype, torch.device(device)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.restore()
        self.rows, self.max_len = rows, max_len
        self.lengths = [0] * rows  # positions held per row (0 past the live rows)
        self.live = 0

    @classmethod
    def for_model(
        cls, config: Any, *, rows: int, max_len: int, dtype: torch.dtype, device: Any
    ) -> KVPool:
        """A pool shaped for ``config`` (an HF decoder config)."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            layers=config.num_hidden_layers,
            rows=rows,
            kv_heads=kv_heads,
            max_len=max_len,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
        )

    def restore(self) -> None:
        """Allocate the tensors (again, after ``release``: at new addresses)."""
        if self.keys:
            return
        # Zeros, not garbage: a masked score is q.k - inf, and garbage can make it NaN.
        self.keys = [self._zeros() for _ in range(self.layers)]
        self.values = [self._zeros() for _ in range(self.layers)]

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Free the tensors (an idle engine's ``release_memory``); ``restore`` makes them."""
        if self.live:
            raise RuntimeError("the KV pool holds live rows")
        self.keys, self.values = [], []

    def add(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> int:
        """Append a prefilled sequence (per layer ``[kv_heads, length, head_dim]``, its
        positions from 0) as the next row; returns the row."""
        if self.live == self.rows:
            raise RuntimeError(f"the KV pool's {self.rows} rows are all in use")
        if length > self.max_len:
            raise ValueError(f"{length} positions do not fit the pool's {self.max_len}")
        row = self.live
        for pool, new in zip(self.keys + self.values, keys + values, strict=True):
            pool[row, :, :length] = new
        self.lengths[row], self.live = length, self.live + 1
        return row

    def remove(self, row: int) -> int | None:
        """Free ``row``; the last live row moves into it (returned, or None if ``row`` was
        the last), so rows stay ``0 .. live - 1``."""
        last = self.live - 1
        moved = None
        if row != last:
            span = self.lengths[last]
            for pool in self.keys + self.values:
                pool[row, :, :span] = pool[last, :, :span]
            self.lengths[row], moved = span, last
        self.lengths[last], self.live = 0, last
        return moved

    def advance(self) -> None:
        """Every live row has taken one decode step: one more position each."""
        for row in range(self.live):
            self.lengths[row] += 1

    def full(self, row: int) -> bool:
        """Whether ``row`` has no room for another position."""
        return self.lengths[row] >= self.max_len

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
