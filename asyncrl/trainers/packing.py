"""Token-budget micro-batches, sequence packing, and response log-probs back in batch order.

A *sequence* is the token ids of prompt + response; its response starts at ``prompt_len``
(>= 1: token ``t`` is predicted from the logits at ``t - 1``). Shape suffixes: ``B`` batch
rows, ``T`` response tokens (right padded), ``L`` tokens of a model row, ``N`` predicted
(response) tokens, ``V`` vocab. Plans are deterministic, so every rank computes the same.
Packed and padded micro-batches give the same logits on the real tokens; packing wastes
no compute on padding. With ``share_prompts`` a packed row holds a group's prompt once and
its responses after it, each response attending to the prompt and to itself
(``Segment``): a causal model's prompt states do not depend on what follows, so logits and
gradients are the unshared ones, for ``(k - 1) * P`` fewer tokens per group of ``k``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from asyncrl.trainers.packed_attention import ATTENTION, packed_rows
from asyncrl.trainers.token_stats import token_logprobs

Layout = Literal["packed", "padded"]
#: One unit of a packed row: ``n`` (a sequence of n tokens, causal on its own) or
#: ``(P, r_1, ..., r_k)`` (a P-token prompt, then k responses that each see the prompt and,
#: causally, themselves).
Segment = int | tuple[int, ...]
FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3")


def plan_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing bins of sequence indices whose lengths sum to <= ``max_tokens``.

    Sequences are placed longest first (ties by index) into the first bin with room; a
    sequence longer than the budget gets a bin of its own. Bins keep creation order and
    hold their indices sorted, so the plan depends on the lengths only. Example with
    budget 10: lengths ``[6, 4, 7, 3]`` -> ``[[2, 3], [0, 1]]``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        slot = next((b for b, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            bins.append([])
            room.append(max_tokens)
            slot = len(bins) - 1
        bins[slot].append(i)
        room[slot] -= lengths[i]
    return [sorted(b) for b in bins]


def split_across_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Share sequence indices among ``world_size`` ranks, balancing their token counts.

    Longest-processing-time greedy: longest first (ties by index), each to the rank with
    the fewest tokens so far (ties to the lowest rank). A rank may get nothing when there
    are fewer sequences than ranks. Example, 2 ranks, ``[5, 3, 3, 2]`` -> ``[[0, 3], [1, 2]]``.
    """
    heap = [(0, rank) for rank in range(world_size)]
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        load, rank = heapq.heappop(heap)
        shares[rank].append(i)
        heapq.heappush(heap, (load + lengths[i], rank))
    return [sorted(s) for s in shares]


def plan_ranks(lengths: Sequence[int], max_tokens: int, world_size: int) -> list[list[list[int]]]:
    """Each rank's micro-batches (indices into ``lengths``): ``split_across_ranks``, then
    ``plan_microbatches`` within each rank's share. Every rank computes the whole plan."""
    plans = []
    for share in split_across_ranks(lengths, world_size):
        bins = plan_microbatches([lengths[i] for i in share], max_tokens)
        plans.append([[share[j] for j in b] for b in bins])
    return plans


def prompt_units(
    sequences: Sequence[np.ndarray],
    prompt_lens: Sequence[int],
    rows: Sequence[int],
    max_tokens: int | None = None,
) -> list[list[int]]:
    """``rows`` grouped by identical prompt tokens, in order of first appearance.

    With ``max_tokens`` a group is cut, in order, where its prompt once plus its responses
    would pass the budget (a part keeps its own copy of the prompt). Example: prompts
    ``a a b a`` -> ``[[0, 1, 3], [2]]``.
    """
    groups: dict[bytes, list[int]] = {}
    for r in rows:
        seq = np.asarray(sequences[r], dtype=np.int64)
        groups.setdefault(seq[: int(prompt_lens[r])].tobytes(), []).append(r)
    if max_tokens is None:
        return list(groups.values())
    units: list[list[int]] = []
    for group in groups.values():
        units.append([])
        for r in group:
            cost = unit_tokens(sequences, prompt_lens, [*units[-1], r])
            if units[-1] and cost > max_tokens:
                units.append([])
            units[-1].append(r)
    return units


def shares_prompts(layout: Layout, attn_implementation: str) -> bool:
    """Whether a micro-batch of ``layout`` and attention can hold a prompt once: packed
    rows attended by ``ATTENTION``, the one attention that takes units."""
    return layout == "packed" and attn_implementation == ATTENTION


def unit_tokens(
    sequences: Sequence[np.ndarray], prompt_lens: Sequence[int], unit: list[int]
) -> int:
    """Tokens of a unit packed with its prompt once: ``P + sum_i (len_i - P)``."""
    p = int(prompt_lens[unit[0]])
    return p + sum(len(sequences[r]) - p for r in unit)


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Model inputs of one micro-batch and where its ``N`` response predictions go.

    ``rows`` are the batch rows it holds, in order. ``keep`` indexes the logits that predict
    a response token: positions in the row (packed) or flat indices into ``b * L``
    (padded); ``targets`` are those tokens, ``slot`` their flat index in ``[b, T]``, and
    ``inv_temperature`` ``1 / T`` of the sample each was drawn in (``token_stats.py``).
    """

    rows: list[int]
    layout: Layout
    segments: tuple[Segment, ...] | None  # packed for ATTENTION: its units (``Segment``)
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    keep: torch.Tensor
    targets: torch.Tensor
    slot: torch.Tensor
    width: int
    inv_temperature: torch.Tensor

    @property
    def num_rows(self) -> int:
        """``b``: sequences in this micro-batch."""
        return len(self.rows)


def build_microbatch(
    sequences: Sequence[np.ndarray],
    prompt_lens: Sequence[int],
    rows: Sequence[int],
    width: int,
    *,
    layout: Layout = "packed",
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    temperatures: Sequence[float] | None = None,
    share_prompts: bool = False,
) -> MicroBatch:
    """The micro-batch of ``rows`` (indices into ``sequences``); ``width`` is ``T``.

    ``packed``: every sequence in one row of ``L = sum(len)`` tokens, ``position_ids``
    restarting at 0 per sequence, and a block-diagonal causal mask (``block_causal_mask``),
    except for flash-attention, whose varlen kernel cuts the row at every
    ``position_ids == 0``, and ``packed_attention.ATTENTION``, which gets the lengths
    (``segments``). ``padded``: one row per sequence, right padded to the longest, with a
    ``[b, L]`` 0/1 mask.

    ``attn_implementation`` is the model's (``config._attn_implementation``): it picks the
    packed mask's form; ``dtype`` is the additive mask's dtype (the model's);
    ``temperatures[r]`` is sequence ``r``'s sampling temperature (None: all 1).
    ``share_prompts`` (packed, ``ATTENTION`` only) packs each prompt once for the rows
    that share it (``prompt_units``); ``rows`` then come out grouped by prompt.
    """
    share = share_prompts and shares_prompts(layout, attn_implementation)
    units = prompt_units(sequences, prompt_lens, rows) if share else [[r] for r in rows]
    rows = [r for u in units for r in u]
    seqs = [np.asarray(sequences[r], dtype=np.int64) for r in rows]
    starts = [int(prompt_lens[r]) for r in rows]
    for r, seq, p in zip(rows, seqs, starts, strict=True):
        if not 1 <= p <= len(seq) or len(seq) - p > width:
            raise ValueError(f"row {r}: prompt_len {p}, length {len(seq)}, width {width}")
    lens = [len(s) for s in seqs]
    segments: tuple[Segment, ...] | None = None
    if share:
        ids, pos, keep, segments = _shared(seqs, starts, [len(u) for u in units])
        mask = None
    elif layout == "packed":
        ids, pos, mask, keep = _packed(seqs, lens, starts, attn_implementation, dtype, device)
        segments = tuple(lens) if attn_implementation == ATTENTION else None
    elif layout == "padded":
        ids, pos, mask, keep = _padded(seqs, lens, starts)
    else:
        raise ValueError(f"unknown layout {layout!r}; expected packed or padded")
    targets = np.concatenate([s[p:] for s, p in zip(seqs, starts, strict=True)])
    slot = np.concatenate(
        [i * width + np.arange(n - p) for i, (p, n) in enumerate(zip(starts, lens, strict=True))]
    )
    temps = [1.0 if temperatures is None else float(temperatures[r]) for r in rows]
    inv_t = np.repeat(1.0 / np.asarray(temps), [n - p for p, n in zip(starts, lens, strict=True)])

    def tensor(x: np.ndarray | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(x).to(device)

    return MicroBatch(
        rows=list(rows),
        layout=layout,
        segments=segments,
        input_ids=tensor(ids),
        position_ids=tensor(pos),
        attention_mask=None if mask is None else tensor(mask),
        keep=tensor(keep.astype(np.int64)),
        targets=tensor(targets),
        slot=tensor(slot.astype(np.int64)),
        width=width,
        inv_temperature=tensor(inv_t.astype(np.float32)),
    )


def _packed(
    seqs: list[np.ndarray],
    lens: list[int],
    starts: list[int],
    attn: str,
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[np.ndarray, np.ndarray, torch.Tensor | None, np.ndarray]:
    ids = np.concatenate(seqs)[None]
    pos = np.concatenate([np.arange(n) for n in lens])[None]
    no_mask = attn in FLASH_ATTENTION or attn == ATTENTION
    mask = None if no_mask else block_causal_mask(lens, attn, dtype, device)
    offsets = np.cumsum([0, *lens[:-1]])
    keep = [np.arange(o + p - 1, o + n - 1) for o, p, n in zip(offsets, starts, lens, strict=True)]
    return ids, pos, mask, np.concatenate(keep)


def _shared(
    seqs: list[np.ndarray], starts: list[int], unit_sizes: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[Segment, ...]]:
    """One packed row of units of ``unit_sizes`` consecutive sequences sharing a prompt.

    A unit of one is packed as ``_packed`` does. A unit of k holds the prompt (P tokens,
    positions ``0..P-1``) and then each response (positions ``P..``); every response's
    first token is predicted from the prompt's last position, so ``keep`` repeats it.
    """
    ids: list[np.ndarray] = []
    pos: list[np.ndarray] = []
    keep: list[np.ndarray] = []
    segments: list[Segment] = []
    offset, i = 0, 0
    for k in unit_sizes:
        unit, p = seqs[i : i + k], starts[i]
        i += k
        if k == 1:
            n = len(unit[0])
            ids.append(unit[0])
            pos.append(np.arange(n))
            keep.append(np.arange(offset + p - 1, offset + n - 1))
            segments.append(n)
            offset += n
            continue
        responses = [s[p:] for s in unit]
        ids += [unit[0][:p], *responses]
        pos += [np.arange(p), *(p + np.arange(len(r)) for r in responses)]
        at = offset + p
        for r in responses:
            if len(r):
                keep += [np.array([offset + p - 1]), np.arange(at, at + len(r) - 1)]
            at += len(r)
        segments.append((p, *(len(r) for r in responses if len(r))))
        offset = at
    return (
        np.concatenate(ids)[None],
        np.concatenate(pos)[None],
        np.concatenate(keep),
        tuple(segments),
    )


def _padded(
    seqs: list[np.ndarray], lens: list[int], starts: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    width = max(lens)
    ids = np.zeros((len(seqs), width), dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    pos = np.broadcast_to(np.arange(width), ids.shape).copy()
    keep = [
        i * width + np.arange(p - 1, n - 1)
        for i, (p, n) in enumerate(zip(starts, lens, strict=True))
    ]
    return ids, pos, mask, np.concatenate(keep)


def block_causal_mask(
    lens: Sequence[int],
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Block-diagonal causal mask ``[1, 1, L, L]`` for sequences of ``lens`` in one row.

    Query ``i`` may see key ``j`` iff both lie in the same sequence and ``j <= i``. sdpa
    takes it as booleans (True = attend; a quarter of an fp32 mask's memory); eager adds
    it to the scores, so there it is ``0`` where allowed and the dtype's minimum elsewhere.
    """
    counts = torch.as_tensor(list(lens), device=device)
    seg = torch.repeat_interleave(torch.arange(len(lens), device=device), counts)
    idx = torch.arange(seg.numel(), device=device)
    allowed = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    allowed = allowed[None, None]
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation != "eager":
        raise ValueError(
            f"packing supports sdpa, eager and {' / '.join(FLASH_ATTENTION)} attention, not "
            f"{attn_implementation!r}: set packing to false (padded micro-batches)"
        )
    blocked = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=device)
    return blocked.masked_fill(allowed, 0.0)


def forward_selected(model: torch.nn.Module, mb: MicroBatch, *, lm: bool = True) -> torch.Tensor:
    """The model's output at the ``N`` kept positions, ``[N, V]`` (``[N, 1]`` for a critic).

    ``lm=True`` (a causal LM) passes ``logits_to_keep`` so that a packed row projects only
    the response positions onto the vocabulary; other heads are indexed after the forward.
    """
    kwargs = {
        "input_ids": mb.input_ids,
        "position_ids": mb.position_ids,
        "attention_mask": mb.attention_mask,
        "use_cache": False,
    }
    if mb.segments is not None:
        kwargs["packed_segments"] = mb.segments
    with packed_rows() if mb.segments is not None else nullcontext():
        if lm and mb.layout == "packed":
            return model(**kwargs, logits_to_keep=mb.keep).logits[0]
        if not lm:
            kwargs.pop("use_cache")
        logits = model(**kwargs).logits
    return logits.flatten(0, 1)[mb.keep]


def smoothed_logprobs(logits_NV: torch.Tensor, targets_N: torch.Tensor, eps: float) -> torch.Tensor:
    """Minus the label-smoothed cross-entropy, ``[N, V], [N] -> [N]``, in fp32.

    ``(1 - eps) * log p_y + eps * mean_v log p_v`` with ``log p = log softmax(z)``; at
    ``eps = 0`` this is ``token_stats.token_logprobs`` at temperature 1. The optimum puts
    ``1 - eps + eps / V`` on the target and ``eps / V`` on every other token.
    """
    picked = token_logprobs(logits_NV, targets_N)
    if eps == 0.0:
        return picked
    logits = logits_NV.float()
    mean_logp = logits.mean(dim=-1) - torch.logsumexp(logits, dim=-1)
    return (1.0 - eps) * picked + eps * mean_logp


def to_rows(values_N: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Scatter per-prediction values into the right-padded ``[b, T]`` layout (0 elsewhere).

    Differentiable in ``values_N``; row ``i`` is ``mb.rows[i]``.
    """
    flat = values_N.new_zeros(mb.num_rows * mb.width)
    return flat.index_copy(0, mb.slot, values_N).view(mb.num_rows, mb.width)
