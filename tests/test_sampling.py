"""Sampling and the reported log-probs (asyncrl/engines/torch/sampling.py): the token is drawn
from the truncated distribution, its log-prob is SGLang's full-vocabulary
``log_softmax(z / T)``, and prompt log-probs are scored in chunks at the same temperature."""

from __future__ import annotations

import math

import torch

from asyncrl.engines.base import SamplingParams
from asyncrl.engines.torch.sampling import RowState, prompt_logprobs, sample, sample_rows


def row(seed: int = 0, **params) -> RowState:
    generator = torch.Generator().manual_seed(seed)
    return RowState(SamplingParams(**params), generator, None, {}, 0, [])


def test_rows_sampled_together_draw_from_softmax_at_each_rows_temperature():
    torch.manual_seed(2)
    z = torch.randn(2, 6) * 2
    rows = [row(seed=1, temperature=0.5), row(seed=2, temperature=1.3)]
    full = torch.log_softmax(z / torch.tensor([[0.5], [1.3]]), -1)
    counts = torch.zeros(2, 6)
    for _ in range(4000):
        for i, (token, logprob, _) in enumerate(sample_rows(z, rows, [0, 0])):
            assert abs(logprob - float(full[i, token])) < 1e-5
            counts[i, token] += 1
    assert torch.allclose(counts / 4000, full.exp(), atol=0.03)


def test_a_seeded_row_draws_the_same_tokens_alone_or_beside_other_rows():
    torch.manual_seed(3)
    logits = [torch.randn(3, 40) for _ in range(30)]
    alone, together = row(seed=7, temperature=0.9), row(seed=7, temperature=0.9)
    others = [row(seed=8, temperature=0.7), row(seed=9, temperature=1.0, top_p=0.8)]
    for z in logits:
        (a,) = sample_rows(z[1:2], [alone], [0])
        b = sample_rows(z, [others[0], together, others[1]], [0, 0, 0])[1]
        assert a == b


def test_a_row_with_no_finite_probability_fails_alone_on_either_path():
    z = torch.randn(4, 10)
    z[1] = float("-inf")
    z[3] = float("nan")
    rows = [row(), row(), row(top_k=5), row(top_k=5)]
    results = sample_rows(z, rows, [0, 0, 2, 0])
    assert isinstance(results[1], RuntimeError) and isinstance(results[3], RuntimeError)
    assert results[0].token in range(10) and results[2].token in range(10)
    assert results[2].top is not None and len(results[2].top) == 2


def test_min_new_tokens_masks_eos_on_the_shared_path():
    """EOS far above the rest (exp(-200) is 0 in float32): the others are still drawn,
    at their log-probs under the masked distribution, with or without top log-probs."""
    z = torch.zeros(1, 5)
    z[0, 2] = 200.0  # EOS would be drawn every time
    state = RowState(SamplingParams(min_new_tokens=3), torch.Generator().manual_seed(0),
                     None, {}, 0, [2])  # fmt: skip
    for num_top in (0, 2) * 25:
        (result,) = sample_rows(z, [state], [num_top])
        assert result.token != 2 and abs(result.logprob - math.log(1 / 4)) < 1e-6
        assert num_top == 0 or result.top[0][1] != 2


def test_a_top_p_draw_stays_in_the_nucleus_and_reports_the_full_vocabulary_log_prob():
    torch.manual_seed(0)
    z = torch.randn(50) * 2
    state = row(temperature=0.6, top_p=0.9)
    full = torch.log_softmax(z / 0.6, -1)
    order = torch.argsort(full, descending=True)
    mass_before = torch.cumsum(full[order].exp(), 0) - full[order].exp()
    nucleus = set(order[mass_before < 0.9].tolist())
    counts = torch.zeros(50)
    for _ in range(3000):
        token, logprob, _ = sample(z, state)
        assert token in nucleus
        assert abs(logprob - float(full[token])) < 1e-5
        counts[token] += 1
    # Drawn in proportion to the renormalised nucleus: softmax(z / T) / kept mass.
    kept = torch.tensor(sorted(nucleus))
    expected = full[kept].exp() / full[kept].exp().sum()
    assert torch.allclose(counts[kept] / counts.sum(), expected, atol=0.03)


def test_top_logprobs_come_from_the_same_distribution_as_the_sampled_token():
    z = torch.randn(30)
    token, logprob, top = sample(z, row(temperature=0.7, top_k=3), num_top=30)
    assert top is not None and len(top) == 30 and all(v > float("-inf") for v, _ in top)
    assert dict((t, v) for v, t in top)[token] == logprob


def test_greedy_reports_the_unscaled_distribution():
    z = torch.randn(20)
    token, logprob, _ = sample(z, row(temperature=0))
    assert token == int(z.argmax()) and abs(logprob - float(torch.log_softmax(z, -1).max())) < 1e-6
    assert SamplingParams(temperature=0).logprob_temperature == 1.0
    assert SamplingParams(temperature=0.6).logprob_temperature == 0.6


def test_prompt_log_probs_in_chunks_equal_one_pass_at_the_temperature():
    torch.manual_seed(1)
    prompt = torch.randint(0, 40, (23,)).tolist()
    logits = torch.randn(23, 40).bfloat16()
    logp = torch.log_softmax(logits.float() / 0.5, -1)
    expected = [float(logp[t - 1, prompt[t]]) for t in range(1, 23)]
    for start in (0, 1, 5):
        values, top = prompt_logprobs(logits, prompt, start, 2, temperature=0.5, chunk_rows=4)
        head = [None] if start == 0 else []
        assert values[: len(head)] == head
        assert torch.allclose(
            torch.tensor(values[len(head) :]), torch.tensor(expected[max(start, 1) - 1 :])
        )
        assert (
            top is not None
            and len(top) == len(values)
            and top[len(head)][0][0] >= values[len(head)]
        )


def test_the_two_level_draw_picks_the_token_a_whole_vocabulary_cdf_would():
    """``_draw`` inverts a CDF of blocks, then one block's: for the same uniforms it
    draws what one float64 CDF over the vocabulary draws, and never a token of zero
    probability (two at block ends here, beside mass), over a padded last block."""
    from asyncrl.engines.torch.sampling import _BLOCK, _draw

    torch.manual_seed(5)
    vocab = 3 * _BLOCK + 100
    probs = torch.softmax(torch.randn(64, vocab) * 3, -1)
    probs[:, [_BLOCK - 1, 2 * _BLOCK - 1]] = 0.0
    probs[:8, :] = 0.0
    probs[:8, [_BLOCK - 2, _BLOCK]] = 0.5  # all mass beside a zero at a block's end
    for r in range(30):
        seeds = [64 * r + i for i in range(64)]
        got, _ = _draw(probs, [torch.Generator().manual_seed(s) for s in seeds])
        cdf = probs.double().cumsum(-1)
        u = torch.cat([torch.rand(1, generator=torch.Generator().manual_seed(s),
                                  dtype=torch.float64) for s in seeds]) * cdf[:, -1]  # fmt: skip
        want = torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1)
        assert torch.equal(got, want)
        assert (probs.gather(-1, got[:, None]) > 0).all()
