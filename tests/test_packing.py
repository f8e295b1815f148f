"""Micro-batch planning and sequence packing (asyncrl/trainers/packing.py).

Hand-worked plans, then the model-level claims: a packed row gives each sequence the
log-probs it gets alone, and packed and padded micro-batches give the same loss and the
same gradients (tiny Qwen2 and Llama models, fp32, sdpa and eager attention).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from asyncrl.policies import LossScale, sft_loss
from asyncrl.trainers.packing import (
    block_causal_mask,
    build_microbatch,
    forward_selected,
    plan_microbatches,
    plan_ranks,
    smoothed_logprobs,
    split_across_ranks,
    to_rows,
)
from asyncrl.trainers.token_stats import token_logprobs
from tests.tiny_model import build_tiny_model

# Four sequences (prompt + response) and where each response starts.
LENGTHS = (7, 12, 5, 9)
PROMPT_LENS = [3, 4, 1, 8]
WIDTH = 8  # longest response: 12 - 4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    qwen = tmp_path_factory.mktemp("qwen2")
    _, tokenizer = build_tiny_model(qwen)
    llama = tmp_path_factory.mktemp("llama")
    torch.manual_seed(1)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(llama)
    return {"qwen2": qwen, "llama": llama}


def sequences() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 500, n) for n in LENGTHS]


def load(path: Path, attn: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)


def alone_logprobs(model: torch.nn.Module, seq: np.ndarray, prompt_len: int) -> torch.Tensor:
    """Log-probs of ``seq[prompt_len:]`` from a forward over ``seq`` by itself."""
    logits = model(torch.as_tensor(seq)[None]).logits[0, prompt_len - 1 : len(seq) - 1]
    targets = torch.as_tensor(seq[prompt_len:])
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


# ------------------------------------------------------------------------------ planning


def test_first_fit_decreasing_fills_the_first_bin_with_room():
    # budget 10, longest first: 7 -> bin0 (3 left); 6 -> bin1 (4 left); 4 -> bin1 (0 left);
    # 3 -> bin0 (0 left). Bins keep creation order and sorted indices.
    assert plan_microbatches([6, 4, 7, 3], 10) == [[2, 3], [0, 1]]


def test_a_sequence_over_the_budget_gets_a_micro_batch_of_its_own():
    # budget 5: 8 -> bin0 (over, nothing else fits); 3 -> bin1 (2 left); 2 -> bin1; 1 -> bin2.
    assert plan_microbatches([8, 2, 3, 1], 5) == [[0], [1, 2], [3]]


def test_equal_lengths_are_placed_in_index_order():
    assert plan_microbatches([2, 2, 2], 4) == [[0, 1], [2]]
    assert plan_microbatches([], 4) == []


def test_ranks_share_sequences_by_longest_processing_time():
    # 5 -> r0 (5); 3 -> r1 (3); 3 -> r1 (6, r1 was lighter); 2 -> r0 (7).
    assert split_across_ranks([5, 3, 3, 2], 2) == [[0, 3], [1, 2]]
    assert split_across_ranks([4], 3) == [[0], [], []]


def test_plan_ranks_micro_batches_each_ranks_share():
    # shares [[0, 3], [1, 2]] as above; budget 6: r0 bins {5}, {2}; r1 bins {3, 3}.
    assert plan_ranks([5, 3, 3, 2], 6, 2) == [[[0], [3]], [[1, 2]]]


# ------------------------------------------------------------------------------- layouts


def test_block_causal_mask_lets_a_token_see_only_its_own_prefix():
    allowed = block_causal_mask([2, 1], "sdpa")
    assert allowed.shape == (1, 1, 3, 3)
    assert allowed[0, 0].tolist() == [
        [True, False, False],
        [True, True, False],
        [False, False, True],
    ]
    additive = block_causal_mask([2, 1], "eager", torch.float32)[0, 0]
    assert additive[1, 0] == 0 and additive[0, 1] == torch.finfo(torch.float32).min


def test_packed_positions_restart_at_zero_and_flash_attention_gets_no_mask():
    mb = build_microbatch(
        [np.arange(3), np.arange(10, 12)],
        [1, 1],
        [0, 1],
        2,
        attn_implementation="flash_attention_2",
    )
    assert mb.attention_mask is None
    assert mb.input_ids.tolist() == [[0, 1, 2, 10, 11]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    # predictions of tokens 1, 2 (at positions 0, 1) and 11 (at position 3)
    assert mb.keep.tolist() == [0, 1, 3] and mb.targets.tolist() == [1, 2, 11]


def test_to_rows_puts_each_response_in_its_rows_order_right_padded():
    seqs = [np.array([5, 6, 7]), np.array([1, 2]), np.array([8, 9, 10, 11])]
    mb = build_microbatch(seqs, [2, 1, 1], [2, 0], 3)
    assert mb.targets.tolist() == [9, 10, 11, 7]
    rows = to_rows(mb.targets.float(), mb)
    assert rows.tolist() == [[9, 10, 11], [7, 0, 0]]


def test_a_prompt_shorter_than_one_token_is_refused():
    with pytest.raises(ValueError, match="prompt_len 0"):
        build_microbatch([np.arange(4)], [0], [0], 4)


# ------------------------------------------------------------------------ against models


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_row_gives_each_sequence_its_log_probs_alone(model_dirs, arch, attn):
    model = load(model_dirs[arch], attn)
    seqs = sequences()
    mb = build_microbatch(seqs, PROMPT_LENS, [0, 1, 2, 3], WIDTH, attn_implementation=attn)
    with torch.no_grad():
        packed = to_rows(token_logprobs(forward_selected(model, mb), mb.targets), mb)
        for i, (seq, p) in enumerate(zip(seqs, PROMPT_LENS, strict=True)):
            alone = alone_logprobs(model, seq, p)
            assert torch.allclose(packed[i, : len(alone)], alone, atol=1e-5)
            assert not packed[i, len(alone) :].any()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_and_padded_micro_batches_give_the_same_loss_and_gradients(model_dirs, arch):
    model = load(model_dirs[arch], "sdpa")
    seqs = sequences()
    mask = torch.zeros(4, WIDTH)
    for i, (n, p) in enumerate(zip(LENGTHS, PROMPT_LENS, strict=True)):
        mask[i, : n - p] = 1.0
    scale = LossScale.of(mask)

    def loss_and_grads(layout: str) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        total = 0.0
        for rows in ([1, 3], [0, 2]):  # two micro-batches, losses sum to the step loss
            mb = build_microbatch(seqs, PROMPT_LENS, rows, WIDTH, layout=layout)
            logprobs = to_rows(token_logprobs(forward_selected(model, mb), mb.targets), mb)
            loss = sft_loss(logprobs, mask[rows], scale=scale)
            loss.backward()
            total += float(loss.detach())
        return total, [p.grad.clone() for p in model.parameters()]

    packed_loss, packed_grads = loss_and_grads("packed")
    padded_loss, padded_grads = loss_and_grads("padded")
    assert abs(packed_loss - padded_loss) < 1e-5
    for a, b in zip(packed_grads, padded_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
def test_smoothed_logprobs_is_minus_torchs_label_smoothed_cross_entropy(eps):
    torch.manual_seed(0)
    logits, targets = torch.randn(7, 11) * 3, torch.randint(0, 11, (7,))
    expected = torch.nn.functional.cross_entropy(
        logits, targets, label_smoothing=eps, reduction="none"
    )
    torch.testing.assert_close(smoothed_logprobs(logits, targets, eps), -expected)
