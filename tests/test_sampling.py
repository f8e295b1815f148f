"""Sampling and the reported log-probs (asyncrl/engines/sampling.py): the token is drawn
from the truncated distribution, its log-prob is SGLang's full-vocabulary
``log_softmax(z / T)``, and prompt log-probs are scored in chunks at the same temperature."""

from __future__ import annotations

import torch

from asyncrl.engines.base import SamplingParams
from asyncrl.engines.sampling import RowState, prompt_logprobs, sample


def row(**params) -> RowState:
    generator = torch.Generator().manual_seed(0)
    return RowState(SamplingParams(**params), generator, None, {}, 0, [])


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
