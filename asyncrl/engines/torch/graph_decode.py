"""Decode steps with static shapes over a ``KVPool``, replayed as CUDA graphs on a GPU.

A step for ``n`` running rows pads them to a batch bucket ``b`` (SGLang's and vLLM's:
1, 2, 4, 8, 16, 24, 32, 48, 64, ...) and attends over a span bucket ``s`` (a power of
two, at least 256, covering the longest row), so every step of a ``(b, s)`` pair has the
same shapes and addresses: inputs are copied into fixed buffers, keys and values are
written at each row's position in the pool, and the logits land in a fixed output. On
CUDA each pair is captured once and replayed (a 1.7B model's step is hundreds of kernel
launches, which is what bounds it eagerly); elsewhere the same code runs eagerly, which
is how the CPU tests check it against the engine's dynamic path. The math is the lean
forward's (``lean_forward.py``), layer for layer.

Padding rows decode token 0 at position 0 into rows past the live ones; their output is
never read, and a row that joins later overwrites what they wrote.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from asyncrl.engines.torch.kv_pool import KVPool
from asyncrl.engines.torch.lean_forward import LeanForward, _rms
from asyncrl.observe.logs import get_logger
from asyncrl.sdpa_kernels import varying_shapes

log = get_logger("asyncrl.engine")

#: Batch sizes steps are padded to (and captured for), as SGLang's and vLLM's.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 512)
#: The shortest attention span a step is padded to.
MIN_SPAN = 256


def bucket_for(n: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """The smallest bucket that holds ``n`` rows; ``ValueError`` past the largest."""
    i = bisect.bisect_left(buckets, n)
    if n < 1 or i == len(buckets):
        raise ValueError(f"{n} rows: the batch buckets hold 1 to {buckets[-1]}")
    return buckets[i]


def span_for(positions: int, max_len: int) -> int:
    """The attention span for rows of up to ``positions`` positions: the smallest power of
    two from ``MIN_SPAN`` that holds them, at most the pool's ``max_len``."""
    span = MIN_SPAN
    while span < positions:
        span *= 2
    return min(span, max_len)


class StaticDecoder:
    """One decode step at a time for the pool's live rows (module docstring)."""

    def __init__(
        self,
        lean: LeanForward,
        pool: KVPool,
        model: torch.nn.Module,
        *,
        graphs: bool | None = None,
        buckets: tuple[int, ...] = BATCH_BUCKETS,
    ) -> None:
        device = pool.keys[0].device
        self.lean, self.pool, self.model = lean, pool, model
        # Every count up to the pool's rows has a bucket: the pool's row count is the last.
        self.buckets = (*(b for b in buckets if b < pool.rows), pool.rows)
        self.device = device
        self.graphs_on = device.type == "cuda" if graphs is None else graphs
        self.ids = torch.zeros(pool.rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(pool.rows, dtype=torch.long, device=device)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.graphs: dict[tuple[int, int], Any] = {}
        self._mempool: Any = None

    def invalidate(self) -> None:
        """Drop the captured graphs (and their memory pool, which a fresh capture must not
        reuse once no graph holds it): the tensors they read moved. A weight update writes
        the parameters in place and needs none of this."""
        self.graphs.clear()
        self.outputs.clear()
        self._mempool = None

    def step(self, last: torch.Tensor) -> torch.Tensor:
        """Logits ``[live, V]`` of the live rows' next tokens, given their newest tokens
        ``last`` (which the pool does not hold yet: this step writes their keys)."""
        n = self.pool.live
        if n == 0 or len(last) != n:
            raise ValueError(f"{len(last)} tokens for {n} live rows")
        b = bucket_for(n, self.buckets)
        lengths = self.pool.lengths[:b]
        span = span_for(max(lengths) + 1, self.pool.max_len)
        if max(lengths[:n]) >= self.pool.max_len:
            raise ValueError("a row has no room for another position in the KV pool")
        self.ids[:n] = last.to(self.ids.device)
        self.ids[n:b] = 0
        self.positions[:b] = torch.tensor(lengths, dtype=torch.long)
        if self.graphs_on:
            with torch.cuda.device(self.device):
                out = self._replay(b, span)
        else:
            out = self._forward(b, span)
        self.pool.advance()
        return out[:n]

    def _forward(self, b: int, span: int) -> torch.Tensor:
        with varying_shapes(self.device):  # the eager path's kernels: the same numbers
            return self._layers(b, span)

    def _layers(self, b: int, span: int) -> torch.Tensor:
        lean, pos = self.lean, self.positions[:b, None]
        x = lean.embed(self.ids[:b, None])
        rope = lean.rotary(x, pos)
        columns = torch.arange(span, device=pos.device)
        attend = (columns[None, :] <= pos)[:, None, None, :]  # [b, 1, 1, span]
        view = _PoolView(self.pool, b, span, pos[:, 0])
        for i, layer in enumerate(lean.layers):
            x = layer(x, rope, attend, view, i)
        return lean.lm_head(_rms(x, lean.norm.weight, lean.norm.variance_epsilon))[:, 0]

    def _replay(self, b: int, span: int) -> torch.Tensor:
        key = (b, span)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(b, span)
            except Exception:  # decode goes on eagerly, not failing every step
                log.exception("CUDA graph capture failed: decoding eagerly from now on")
                torch.cuda.set_stream(torch.cuda.default_stream(self.device))
                self.graphs_on = False
                self.invalidate()
                return self._forward(b, span)
        self.graphs[key].replay()
        return self.outputs[key]

    def _capture(self, b: int, span: int) -> Any:
        """Capture the ``(b, span)`` step after a warm-up on a side stream (the warm-up
        writes the same keys the replay writes: the inputs are the same)."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(b, span)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self._mempool = self._mempool or torch.cuda.graph_pool_handle()
        # thread_local: the weight receiver's threads may use the device meanwhile.
        capture = torch.cuda.Stream(device=self.device)
        with torch.cuda.graph(
            graph, pool=self._mempool, stream=capture, capture_error_mode="thread_local"
        ):
            self.outputs[(b, span)] = self._forward(b, span)
        return graph


class _PoolView:
    """The ``cache.update`` a lean layer calls: write the step's keys and values at each
    row's position, attend over the rows' first ``span`` positions."""

    def __init__(self, pool: KVPool, b: int, span: int, positions: torch.Tensor) -> None:
        self.pool, self.b, self.span, self.positions = pool, b, span, positions
        self.rows = torch.arange(b, device=positions.device)

    def update(
        self, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        keys[self.rows, :, self.positions] = k[:, :, 0]
        values[self.rows, :, self.positions] = v[:, :, 0]
        return keys[: self.b, :, : self.span], values[: self.b, :, : self.span]


class PoolBatch:
    """The scheduler's running batch held in a ``KVPool`` (``KVBatch``'s surface): rows
    are the pool's live rows, decoded by a ``StaticDecoder``."""

    def __init__(self, decoder: StaticDecoder) -> None:
        self.decoder, self.pool = decoder, decoder.pool
        self.clear()

    def clear(self) -> None:
        """Drop every row (the pool and its captured graphs stay)."""
        self.seqs: list[Any] = []
        self.last = torch.zeros(0, dtype=torch.long)
        self.pool.lengths = [0] * self.pool.rows
        self.pool.live = 0

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        """Positions in use plus each row's pending token."""
        return sum(self.pool.lengths[: self.pool.live]) + len(self.seqs)

    @property
    def positions(self) -> torch.Tensor:
        """Each row's next position (its length: the pool holds positions from 0)."""
        return torch.tensor(self.pool.lengths[: self.pool.live], dtype=torch.long)

    def add(self, seqs: list[Any], cache: Any, mask: torch.Tensor, tokens: list[int]) -> None:
        """Append prefilled rows: their real positions of ``cache`` and first tokens."""
        for i, length in enumerate(mask.sum(-1).tolist()):
            add_prefilled(self.pool, cache, i, int(length))
        self.seqs += seqs
        self.last = torch.cat([self.last, torch.tensor(tokens, dtype=torch.long)])

    def select(self, keep: list[int], device: torch.device) -> None:
        """Keep rows ``keep``; each row dropped takes the last row in its place."""
        last = self.last.tolist()
        for row in sorted(set(range(len(self.seqs))) - set(keep), reverse=True):
            moved = self.pool.remove(row)
            if moved is not None:
                self.seqs[row], last[row] = self.seqs[moved], last[moved]
            self.seqs.pop()
            last.pop()
        self.last = torch.tensor(last, dtype=torch.long)

    def decode(self, forward: Any) -> torch.Tensor:
        """One static step of every row (``forward`` is not used: the decoder's is)."""
        return self.decoder.step(self.last).float()


def add_prefilled(pool: KVPool, cache: Any, row: int, length: int) -> int:
    """Copy row ``row`` of a prefill's left-padded ``cache`` (its ``length`` real
    positions at the right end) into the next pool row; returns that row."""
    keys = [layer.keys[row, :, -length:] for layer in cache.layers]
    values = [layer.values[row, :, -length:] for layer in cache.layers]
    return pool.add(keys, values, length)


def static_batch(
    runner: Any,
    config: Any,
    *,
    rows: int,
    max_total_tokens: int | None,
    mem_fraction: float,
    graphs: bool,
) -> PoolBatch | None:
    """A ``PoolBatch`` for ``runner``'s model: ``rows`` rows as long as ``mem_fraction`` of
    the free memory (and ``max_total_tokens``, if given) allows, at most the context; None
    (logged) when the model runs outside the lean forward, its rotary embedding changes
    with the length (dynamic scaling reads it on the host), or the rows would be short."""
    from asyncrl.engines.torch.kv_batch import available_memory, kv_bytes_per_position
    from asyncrl.engines.torch.kv_pool import pool_max_len

    if runner.lean is None:
        log.info("static decode off: the model runs through transformers")
        return None
    if "dynamic" in str(getattr(runner.lean.rotary, "rope_type", "")):
        log.info("static decode off: dynamic rotary scaling")
        return None
    dtype = next(runner.model.parameters()).dtype
    per_position = kv_bytes_per_position(config, dtype)
    memory = available_memory(runner.device)
    max_len = pool_max_len(per_position, memory, mem_fraction, rows, runner.context_length)
    if max_total_tokens is not None:
        max_len = min(max_len, max_total_tokens // rows)
    if max_len < min(64, runner.context_length):
        log.warning(
            "static decode off: the KV pool would hold too few positions per row",
            rows=rows,
            max_len=max_len,
        )
        return None
    if max_len < runner.context_length:
        log.warning(
            "the KV pool caps a request at fewer positions than the model's context: "
            "raise mem_fraction or lower max_running for longer ones",
            max_len=max_len,
            context=runner.context_length,
            rows=rows,
        )
    pool = KVPool.for_model(config, rows=rows, max_len=max_len, dtype=dtype, device=runner.device)
    gb = round(pool.bytes / 2**30, 2)
    log.info("static decode", rows=rows, max_len=max_len, graphs=graphs, pool_gb=gb)
    return PoolBatch(StaticDecoder(runner.lean, pool, runner.model, graphs=graphs))
