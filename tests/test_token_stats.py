"""Log-probs and entropy at a sample's temperature (asyncrl/trainers/token_stats.py):
values and gradients equal autograd through ``log_softmax(z / T)`` whatever the chunking,
in fp32 and bf16 logits, and the micro-batch carries each sequence's temperature."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.trainers.packing import build_microbatch
from asyncrl.trainers.token_stats import token_stats


def reference(z: torch.Tensor, y: torch.Tensor, s: torch.Tensor):
    logp = torch.log_softmax(z.float() * s[:, None], -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, y[:, None]).squeeze(-1), entropy


@pytest.mark.parametrize("chunk_rows", [1, 7, 1000])
def test_values_and_gradients_equal_autograd_through_log_softmax(chunk_rows):
    torch.manual_seed(0)
    n, v = 37, 101
    z = (torch.randn(n, v) * 3).requires_grad_()
    y, s = torch.randint(0, v, (n,)), torch.rand(n) + 0.5
    a, b = torch.randn(n), torch.randn(n)
    logp, entropy = token_stats(z, y, s, chunk_elements=chunk_rows * v)
    ref_logp, ref_entropy = reference(z, y, s)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad((a * logp + b * entropy).sum(), z)
    (ref_grad,) = torch.autograd.grad((a * ref_logp + b * ref_entropy).sum(), z)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)


def test_an_unused_entropy_gives_the_log_prob_gradient_alone():
    torch.manual_seed(1)
    z = torch.randn(5, 11, requires_grad=True)
    y, s = torch.randint(0, 11, (5,)), torch.full((5,), 1 / 0.6)
    (grad,) = torch.autograd.grad(token_stats(z, y, s)[0].sum(), z)
    (ref_grad,) = torch.autograd.grad(reference(z, y, s)[0].sum(), z)
    torch.testing.assert_close(grad, ref_grad)


def test_bf16_logits_are_scored_in_fp32_and_get_a_bf16_gradient():
    torch.manual_seed(2)
    z = (torch.randn(9, 64) * 4).bfloat16().requires_grad_()
    y = torch.randint(0, 64, (9,))
    logp, _ = token_stats(z, y)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, reference(z.detach(), y, torch.ones(9))[0])
    logp.sum().backward()
    assert z.grad is not None and z.grad.dtype == torch.bfloat16


def test_temperature_one_is_the_plain_log_softmax():
    z, y = torch.randn(4, 8), torch.tensor([0, 3, 7, 1])
    torch.testing.assert_close(token_stats(z, y)[0], torch.log_softmax(z, -1)[range(4), y])


def test_a_micro_batch_carries_each_sequences_inverse_temperature():
    seqs = [np.arange(1, 6), np.arange(1, 4), np.arange(1, 8)]
    mb = build_microbatch(seqs, [2, 1, 3], [2, 0], 6, temperatures=[0.5, 1.0, 0.8])
    # row 2 (5 tokens from position 3 -> 4 predictions), then row 0 (3 predictions)
    assert mb.inv_temperature.tolist() == pytest.approx([1.25] * 4 + [2.0] * 3)
    plain = build_microbatch(seqs, [2, 1, 3], [1], 6)
    assert plain.inv_temperature.tolist() == [1.0, 1.0]
