"""Next-token logits to a sampled token and its behaviour log-prob, per request.

For one row with raw logits ``z`` (float32)::

    z' = z + logit_bias                        (bias by token id)
    z' = penalise(z', counts)                  repetition (divide positive / multiply
                                               negative logits of seen tokens by r),
                                               frequency (- f * count), presence (- p * [count > 0])
    z' = z' / T                                (temperature; T = 0 means greedy)
    logprob(x) = log_softmax(z')[x]            the reported log-prob: full vocabulary
    keep the top_k, then the smallest top-p nucleus, then tokens with p >= min_p * p_max
    x ~ softmax(z' restricted to what is kept)

The reported log-prob is SGLang's, the one the trainer recomputes (``docs/numerics.md``):
the truncation only decides which tokens may be drawn; greedy rows take ``argmax z'`` and
report ``log_softmax(z)``. A token is drawn by inverting the kept distribution's CDF at
one uniform number from the request's own generator (``_draw``), so a seeded request
draws the same numbers whatever else shares its batch (its logits may still differ in the
last bits with the batch's shape: padding width, matmul sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from asyncrl.engines.base import SamplingParams


@dataclass(slots=True)
class RowState:
    """What sampling needs to know about one running sequence."""

    params: SamplingParams
    generator: torch.Generator | None
    seen: torch.Tensor | None  # token ids of prompt + output, for repetition penalty
    counts: dict[int, int]  # output token -> count, for frequency/presence penalties
    num_generated: int
    blocked: list[int]  # token ids masked while num_generated < min_new_tokens


def process_logits(logits: torch.Tensor, row: RowState) -> torch.Tensor:
    """The scaled logits ``z'`` of one row, before truncation (see the module docstring)."""
    p = row.params
    z = logits.float().clone()
    if p.logit_bias:
        for token, bias in p.logit_bias.items():
            z[int(token)] += bias
    z = _penalise(z, row)
    if row.num_generated < p.min_new_tokens and row.blocked:
        z[row.blocked] = float("-inf")
    if p.greedy:
        return z
    return z / p.temperature


def _penalise(z: torch.Tensor, row: RowState) -> torch.Tensor:
    p = row.params
    if p.repetition_penalty != 1.0 and row.seen is not None and row.seen.numel():
        ids = torch.unique(row.seen)
        vals = z[ids]
        z[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and row.counts:
        ids = torch.tensor(list(row.counts), dtype=torch.long)
        counts = torch.tensor(list(row.counts.values()), dtype=z.dtype)
        z[ids] -= p.frequency_penalty * counts + p.presence_penalty
    return z


def _filter(z: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.top_k > 0 and p.top_k < z.numel():
        kth = torch.topk(z, p.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_z, order = torch.sort(z, descending=True)
        probs = torch.softmax(sorted_z, -1)
        # Drop a token once the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        z = z.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0:
        probs = torch.softmax(z, -1)
        z = z.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return z


class Sampled(NamedTuple):
    """One sampled token, its log-prob, and the top alternatives when asked for."""

    token: int
    logprob: float
    top: list[tuple[float, int]] | None  # (logprob, token_id), most likely first


def sample(logits: torch.Tensor, row: RowState, num_top: int = 0) -> Sampled:
    """Sample one token from a row of raw logits, with the ``num_top`` most likely tokens."""
    z = process_logits(logits, row)
    logp = reported_logprobs(logits, row, z)
    if row.params.greedy:
        token = int(torch.argmax(z))
        if not torch.isfinite(z[token]):
            raise RuntimeError("no token has a finite probability")
    else:
        kept = torch.softmax(_filter(z, row.params), -1)
        token = int(_draw(kept[None], [row.generator])[0][0])
        if token < 0:
            raise RuntimeError("no token has a finite probability")
    return Sampled(token, float(logp[token]), top_logprobs(logp, num_top) if num_top else None)


def reported_logprobs(
    logits: torch.Tensor, row: RowState, z: torch.Tensor | None = None
) -> torch.Tensor:
    """The log-probs a row reports, ``log_softmax(z')`` of its processed logits (``z``
    when already computed); greedy: ``log_softmax(z)`` of the raw ones."""
    if row.params.greedy:
        return torch.log_softmax(logits.float(), -1)
    return torch.log_softmax(process_logits(logits, row) if z is None else z, -1)


def chosen_logprobs(logp: torch.Tensor, ids: list[int]) -> list[tuple[float, int]]:
    """``(logprob, id)`` of each of ``ids`` in a log-prob row, in their order."""
    values = logp[torch.tensor(ids, dtype=torch.long, device=logp.device)].tolist()
    return list(zip(values, ids, strict=True))


def sample_rows(
    logits: torch.Tensor, rows: list[RowState], num_tops: list[int]
) -> list[Sampled | RuntimeError]:
    """``sample`` for every row of ``logits`` ``[len(rows), vocab]``; a row that cannot be
    sampled (no finite probability left) gets its ``RuntimeError`` instead.

    Rows that need no per-row work (no bias, penalty or truncation: a training rollout's)
    share ``_sample_plain`` on the logits' device (from a GPU only the uniforms go up and
    the tokens and their log-probs come back); the others go through ``sample`` one by
    one, on the CPU. The path depends on the row's own parameters only, and both draw
    with the same inverse CDF."""
    out: list[Sampled | RuntimeError | None] = [None] * len(rows)
    plain = [i for i, row in enumerate(rows) if _is_plain(row.params)]
    if plain:
        for i, result in zip(plain, _sample_plain(logits, rows, num_tops, plain), strict=True):
            out[i] = result
    rest = [i for i in range(len(rows)) if out[i] is None]
    if rest:  # per-row state (seen tokens, counts) lives on the CPU
        host = logits.cpu()  # no copy on a CPU; from a GPU one transfer, not one a row
        for i in rest:
            try:
                out[i] = sample(host[i], rows[i], num_tops[i])
            except RuntimeError as exc:
                out[i] = exc
    return out  # type: ignore[return-value]


def _is_plain(p: SamplingParams) -> bool:
    """Rows whose ``z'`` is ``z / T`` with EOS and stop tokens masked at most (below
    ``min_new_tokens``), and nothing truncated."""
    return (
        not p.greedy
        and not p.logit_bias
        and p.repetition_penalty == 1.0
        and not p.frequency_penalty
        and not p.presence_penalty
        and p.top_k <= 0
        and p.top_p >= 1.0
        and p.min_p <= 0
    )


def _sample_plain(
    logits: torch.Tensor, rows: list[RowState], num_tops: list[int], index: list[int]
) -> list[Sampled | RuntimeError]:
    """The shared path, in four passes over ``[rows, vocab]`` and no log-softmax of it:
    ``m = max z`` (over the tokens a row may draw), ``e = exp((z - m) / T)``, ``e``'s
    block sums (``_draw``), and the picked token's
    ``log p = (z_x - m) / T - log sum e``. That is ``log_softmax(z / T)[x]`` with the
    normaliser summed in float64; a row that asks for top log-probs takes its own
    ``log_softmax`` so that its sampled entry equals its reported log-prob."""
    z = logits if index == list(range(logits.shape[0])) else logits[index]
    z = z.float()  # no copy for float32 logits: z is read, never written
    temperature = torch.tensor([rows[i].params.temperature for i in index], device=z.device)
    blocked = {j: rows[i].blocked for j, i in enumerate(index) if _blocking(rows[i])}
    e, peak = _exp_scaled(z, temperature, blocked)
    drawn, total = _draw(e, [rows[i].generator for i in index])
    chosen = z.gather(-1, drawn.clamp(min=0)[:, None]).squeeze(-1)
    picked = ((chosen - peak) / temperature - total.log()).tolist()
    tokens = drawn.tolist()  # one transfer from a GPU, not one per row
    out: list[Sampled | RuntimeError] = []
    for j, i in enumerate(index):
        if tokens[j] < 0:
            out.append(RuntimeError("no token has a finite probability"))
        elif num_tops[i]:
            logp = _row_logprobs(z[j], rows[i].params.temperature, blocked.get(j, []))
            top = top_logprobs(logp, num_tops[i])
            out.append(Sampled(tokens[j], float(logp[tokens[j]]), top))
        else:
            out.append(Sampled(tokens[j], picked[j], None))
    return out


def _exp_scaled(
    z: torch.Tensor, temperature: torch.Tensor, blocked: dict[int, list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``e = exp((z - m) / T)`` per row, 0 at a row's blocked tokens, and ``m``: the
    row's max over the tokens it may draw (a blocked EOS far above the rest would
    otherwise leave every other ``e`` at 0)."""
    peak = z.amax(-1)
    for j, tokens in blocked.items():
        peak[j] = z[j].index_fill(0, torch.tensor(tokens, device=z.device), float("-inf")).max()
    e = torch.sub(z, peak[:, None]).mul_(temperature.reciprocal()[:, None]).exp_()
    for j, tokens in blocked.items():
        e[j, tokens] = 0.0
    return e, peak


def _row_logprobs(z: torch.Tensor, temperature: float, blocked: list[int]) -> torch.Tensor:
    """``log_softmax(z / T)`` of one row with its blocked tokens at ``-inf``."""
    if blocked:
        z = z.index_fill(0, torch.tensor(blocked, device=z.device), float("-inf"))
    return torch.log_softmax(z / temperature, -1)


def _blocking(row: RowState) -> bool:
    """Whether EOS and stop tokens are masked for this row now (``min_new_tokens``)."""
    return row.num_generated < row.params.min_new_tokens and bool(row.blocked)


#: Tokens per block of the two-level CDF (``_draw``).
_BLOCK = 1024


def _draw(
    probs: torch.Tensor, generators: list[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of (unnormalised) ``probs`` by inverting its CDF at a uniform
    ``u`` from the row's generator, ``x = min{i : sum_{j<=i} p_j > u * sum_j p_j}`` (-1
    for a row with no positive finite mass), and each row's total mass in float64.

    In float64: a float32 CDF past 0.5 cannot resolve a step under about 3e-8, so rare
    tokens would be drawn at the wrong rate (or never) while their log-probs say otherwise.
    In two levels, so that no float64 pass covers the whole ``[rows, vocab]``: the CDF of
    blocks of ``_BLOCK`` tokens (float32 block sums, relative error about 1e-7, summed
    across blocks in float64) picks a block, and that block's own CDF the token. The draw
    lands on a token of positive probability, also where the two levels' sums differ.
    """
    rows, vocab = probs.shape
    pad = -vocab % _BLOCK
    blocks = F.pad(probs, (0, pad)).view(rows, -1, _BLOCK) if pad else probs.view(rows, -1, _BLOCK)
    cum = blocks.sum(-1).double().cumsum(-1)  # [rows, blocks]
    total = cum[:, -1]
    uniform = [torch.rand(1, generator=g, dtype=torch.float64) for g in generators]
    u = torch.cat(uniform).to(probs.device) * total  # drawn on the CPU, whatever the device
    block = torch.searchsorted(cum, u[:, None], right=True).clamp(max=cum.shape[1] - 1)
    before = torch.where(block > 0, cum.gather(-1, (block - 1).clamp(min=0)), 0.0)
    index = torch.arange(rows, device=probs.device)[:, None]
    within = blocks[index, block].squeeze(1).double().cumsum(-1)  # [rows, _BLOCK]
    last = (within < within[:, -1:]).sum(-1, keepdim=True)  # its last token of positive mass
    token = torch.searchsorted(within, (u[:, None] - before), right=True).clamp(max=last)
    tokens = (block * _BLOCK + token).squeeze(-1)
    bad = ~torch.isfinite(total) | (total <= 0)
    return torch.where(bad, -1, tokens.clamp(max=vocab - 1)), total


def top_logprobs(logp: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """The ``k`` largest entries of a log-prob row as ``(logprob, token_id)`` pairs.

    Full-vocabulary log-probs (before truncation), as the sampled token's.
    """
    values, ids = torch.topk(logp, min(k, logp.shape[-1]))
    return list(zip(values.tolist(), ids.tolist(), strict=True))


def prompt_chosen_logprobs(
    logits: torch.Tensor,
    prompt: list[int],
    start_len: int,
    ids: list[int],
    *,
    temperature: float = 1.0,
    chunk_rows: int = 256,
) -> list[list[tuple[float, int]] | None]:
    """``chosen_logprobs`` of ``ids`` at every prompt position from ``start_len`` (None at
    the first prompt token), from the distributions ``prompt_logprobs`` scores."""
    first = max(start_len, 1)
    rows: list[list[tuple[float, int]] | None] = [None] if start_len == 0 else []
    for lo in range(first - 1, len(prompt) - 1, chunk_rows):
        hi = min(lo + chunk_rows, len(prompt) - 1)
        logp = torch.log_softmax(logits[lo:hi].float() / temperature, -1)
        rows += [chosen_logprobs(r, ids) for r in logp]
    return rows


def prompt_logprobs(
    logits: torch.Tensor,
    prompt: list[int],
    start_len: int,
    num_top: int,
    *,
    temperature: float = 1.0,
    chunk_rows: int = 256,
) -> tuple[list[float | None], list[list[tuple[float, int]] | None] | None]:
    """Teacher-forced log-probs ``log_softmax(z / temperature)`` of ``prompt`` from
    position ``start_len`` (the first prompt token has none: None), and the ``num_top``
    most likely tokens at each of those positions (None when ``num_top`` is 0).

    ``logits`` are the prefill's ``[len(prompt), vocab]`` rows of this prompt, in any
    dtype; they are scored ``chunk_rows`` positions at a time, so a long prompt never
    holds a whole ``[len(prompt), vocab]`` fp32 copy.
    """
    first = max(start_len, 1)  # position t's log-prob comes from the logits at t - 1
    values: list[float] = []
    tops: list[list[tuple[float, int]]] = []
    for lo in range(first - 1, len(prompt) - 1, chunk_rows):
        hi = min(lo + chunk_rows, len(prompt) - 1)
        logp = torch.log_softmax(logits[lo:hi].float() / temperature, -1)
        targets = torch.tensor(prompt[lo + 1 : hi + 1], dtype=torch.long, device=logp.device)
        values += logp.gather(-1, targets[:, None]).squeeze(-1).tolist()
        if num_top > 0:
            v, ids = torch.topk(logp, min(num_top, logp.shape[-1]), dim=-1)
            tops += [
                list(zip(a, b, strict=True)) for a, b in zip(v.tolist(), ids.tolist(), strict=True)
            ]
    head: list[None] = [None] if start_len == 0 else []
    out: list[float | None] = [*head, *values]
    if num_top <= 0:
        return out, None
    return out, [*head, *tops]
