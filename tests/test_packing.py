"""Micro-batch planning and sequence packing (asyncrl/trainers/packing.py).

Hand-worked plans, then the model-level claims: a packed row gives each sequence the
log-probs it gets alone, and packed and padded micro-batches give the same loss and the
same gradients (tiny Qwen2 and Llama models, fp32, sdpa and eager attention); a row that
holds a shared prompt once gives the same log-probs and gradients as packing it per sample.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    LlamaConfig,
    LlamaForCausalLM,
)

from asyncrl.errors import InputError
from asyncrl.policies import LossScale, sft_loss
from asyncrl.trainers import packed_attention
from asyncrl.trainers.packing import (
    block_causal_mask,
    build_microbatch,
    forward_selected,
    plan_microbatches,
    plan_ranks,
    prompt_units,
    smoothed_logprobs,
    split_across_ranks,
    to_rows,
    unit_tokens,
)
from asyncrl.trainers.rl_step import rank_microbatches
from asyncrl.trainers.rollout_tensors import RolloutTensors
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


# --------------------------------------------------------------------------- shared prompts


def shared_prompt_sequences() -> tuple[list[np.ndarray], list[int]]:
    """Five samples: three share prompt ``a`` (4 tokens), one has prompt ``b``, one ``a``
    again after it; responses of 3, 5, 2, 4, 1 tokens."""
    a, b = np.array([11, 12, 13, 14]), np.array([21, 22])
    rng = np.random.default_rng(3)
    prompts = [a, a, b, a, a]
    responses = [rng.integers(0, 500, n) for n in (3, 5, 2, 4, 1)]
    return [np.concatenate([p, r]) for p, r in zip(prompts, responses, strict=True)], [
        len(p) for p in prompts
    ]


def test_prompt_units_group_rows_by_prompt_tokens_and_cut_at_the_budget():
    seqs, starts = shared_prompt_sequences()
    assert prompt_units(seqs, starts, [0, 1, 2, 3, 4]) == [[0, 1, 3, 4], [2]]
    # a's unit is 4 + 3 + 5 + 4 + 1 = 17 tokens, its samples alone 7 + 9 + 8 + 5 = 29
    assert unit_tokens(seqs, starts, [0, 1, 3, 4]) == 17
    # budget 12: 4 + 3 + 5 = 12 fits, + 4 would not; the cut part has its own prompt
    assert prompt_units(seqs, starts, [0, 1, 2, 3, 4], 12) == [[0, 1], [3, 4], [2]]
    # the same prompt tokens with another prompt length are another prompt
    assert prompt_units([np.arange(5), np.arange(5)], [2, 3], [0, 1]) == [[0], [1]]


def test_a_shared_prompt_is_packed_once_and_each_response_follows_it():
    seqs, starts = shared_prompt_sequences()
    mb = build_microbatch(
        seqs, starts, [0, 2, 1], 5, attn_implementation=packed_attention.ATTENTION,
        share_prompts=True,
    )  # fmt: skip
    assert mb.rows == [0, 1, 2]  # grouped by prompt, in order of first appearance
    assert mb.segments == ((4, 3, 5), 4)
    r0, r1 = seqs[0][4:], seqs[1][4:]
    assert mb.input_ids[0].tolist() == [11, 12, 13, 14, *r0, *r1, *seqs[2]]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8, 0, 1, 2, 3]
    # row 0's tokens at 4..6 are predicted from 3 (the prompt's end), 4, 5; row 1's at
    # 7..11 from 3, 7, 8, 9, 10; row 2's response from 13 (its prompt end), 14
    assert mb.keep.tolist() == [3, 4, 5, 3, 7, 8, 9, 10, 13, 14]
    assert mb.targets.tolist() == [*r0, *r1, *seqs[2][2:]]
    # the flag changes nothing where the attention cannot take the units
    plain = build_microbatch(seqs, starts, [0, 2, 1], 5, share_prompts=True)
    assert plain.rows == [0, 2, 1] and plain.input_ids.shape[1] == 7 + 4 + 9


def test_each_response_attends_to_the_prompt_and_itself_only():
    """A unit ``(P, r_1, r_2)`` attends as the sequences ``prompt + r_j`` packed alone."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3 + 4 + 2, 8, generator=g) for _ in range(3))
    out, _ = packed_attention.packed_attention(
        torch.nn.Module(), q, k, v, None, packed_segments=((3, 4, 2),)
    )
    for cols in (list(range(7)), [0, 1, 2, 7, 8]):  # prompt + response 1, prompt + response 2
        idx = torch.tensor(cols)
        alone = F.scaled_dot_product_attention(
            q[:, :, idx], k[:, :, idx], v[:, :, idx], is_causal=True
        )
        torch.testing.assert_close(out[0, idx], alone[0].transpose(0, 1))


def shared_rows(seqs: list[np.ndarray], starts: list[int]) -> RolloutTensors:
    n = len(seqs)
    return RolloutTensors(
        sequences=seqs,
        prompt_lens=starts,
        mask=torch.ones(n, 5),
        behaviour=torch.zeros(n, 5),
        versions=torch.zeros(n, 5, dtype=torch.int64),
        scores_GN=torch.zeros(n, 1),
        temperatures=[1.0] * n,
    )


def test_rank_micro_batches_keep_a_prompts_rows_together_and_count_the_prompt_once():
    seqs, starts = shared_prompt_sequences()
    rows = shared_rows(seqs, starts)
    kwargs = {"max_tokens": 17, "world": 1, "rank": 0, "equal_counts": True}
    attn = packed_attention.register()
    shared = rank_microbatches(rows, None, share_prompts=True, attn_implementation=attn, **kwargs)
    assert [mb.rows for mb in shared] == [[0, 1, 3, 4], [2]]
    assert [mb.input_ids.shape[1] for mb in shared] == [17, 4]
    whole = rank_microbatches(rows, None, share_prompts=False, attn_implementation=attn, **kwargs)
    assert sum(mb.input_ids.shape[1] for mb in whole) == 7 + 9 + 4 + 8 + 5


def test_prompts_are_shared_only_where_the_attention_takes_units():
    """With another attention the rows are planned as they are built, whole: a plan that
    counted the prompt once would pass the budget."""
    seqs, starts = shared_prompt_sequences()
    rows = shared_rows(seqs, starts)
    for layout, attn in (
        ("packed", "sdpa"),
        ("packed", "eager"),
        ("padded", packed_attention.ATTENTION),
    ):
        kwargs = {"max_tokens": 17, "world": 1, "rank": 0, "equal_counts": True,
                  "layout": layout, "attn_implementation": attn}  # fmt: skip
        shared = rank_microbatches(rows, None, share_prompts=True, **kwargs)
        whole = rank_microbatches(rows, None, share_prompts=False, **kwargs)
        assert [mb.rows for mb in shared] == [mb.rows for mb in whole], (layout, attn)
        if layout == "packed":
            assert max(mb.input_ids.shape[1] for mb in shared) <= 17


def test_one_big_group_is_spread_over_every_rank():
    seqs, starts = shared_prompt_sequences()
    rows, group = shared_rows(seqs, starts), [0, 1, 3, 4]  # the rows of prompt a
    kwargs = {"max_tokens": 1024, "world": 2, "equal_counts": True,
              "attn_implementation": packed_attention.register()}  # fmt: skip
    ranks = [rank_microbatches(rows, group, share_prompts=True, rank=r, **kwargs) for r in (0, 1)]
    held = [sorted(r for mb in mbs for r in mb.rows if r < 5) for mbs in ranks]
    assert held[0] and held[1] and sorted(held[0] + held[1]) == group


def test_a_unit_attends_in_autocasts_dtype_when_the_rotary_left_q_and_k_in_fp32():
    """Under autocast q and k come out of the rotary embedding in fp32 beside low-precision
    values; sdpa with a causal bias is not cast by autocast, so the unit casts them."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 9, 8, generator=g).half()
    with torch.autocast("cpu", dtype=torch.float16):
        out, _ = packed_attention.packed_attention(
            torch.nn.Module(), q, k, v, None, packed_segments=((3, 4, 2),)
        )
    assert out.dtype == torch.float16 and out.shape == (1, 9, 2, 8)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_shared_prompt_gives_every_response_its_log_probs_and_gradients_alone(model_dirs, arch):
    model = load(model_dirs[arch], packed_attention.register())
    seqs, starts = shared_prompt_sequences()
    mask = torch.zeros(5, 5)
    for i, (seq, p) in enumerate(zip(seqs, starts, strict=True)):
        mask[i, : len(seq) - p] = 1.0
    scale = LossScale.of(mask)

    def run(share: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        mb = build_microbatch(
            seqs, starts, range(5), 5, attn_implementation=packed_attention.ATTENTION,
            share_prompts=share,
        )  # fmt: skip
        assert mb.input_ids.shape[1] == (17 + 4 if share else 7 + 9 + 4 + 8 + 5)
        logprobs = to_rows(token_logprobs(forward_selected(model, mb), mb.targets), mb)
        logprobs = logprobs[np.argsort(mb.rows)]  # back to the batch's order
        sft_loss(logprobs, mask, scale=scale).backward()
        return logprobs.detach(), [p.grad.clone() for p in model.parameters()]

    shared, shared_grads = run(True)
    whole, whole_grads = run(False)
    with torch.no_grad():
        for i, (seq, p) in enumerate(zip(seqs, starts, strict=True)):
            alone = alone_logprobs(model, seq, p)
            assert torch.allclose(shared[i, : len(alone)], alone, atol=1e-5)
    assert torch.allclose(shared, whole, atol=1e-5)
    for a, b in zip(shared_grads, whole_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_packed_forward_builds_no_mask_and_a_padded_one_still_does(model_dirs, arch, monkeypatch):
    import transformers.masking_utils as masking

    model = load(model_dirs[arch], packed_attention.register())
    built: list[tuple[int, ...]] = []
    sdpa_mask = masking.sdpa_mask

    def spy(*args, **kwargs):
        mask = sdpa_mask(*args, **kwargs)
        built.append(None if mask is None else tuple(mask.shape))
        return mask

    monkeypatch.setattr(masking, "sdpa_mask", spy)
    critic = AutoModelForTokenClassification.from_pretrained(
        model_dirs[arch], num_labels=1, attn_implementation=packed_attention.register()
    )  # the ppo critic's class: its packed forward goes through the same masks
    seqs, starts = shared_prompt_sequences()
    with torch.no_grad():
        for share in (True, False):
            mb = build_microbatch(
                seqs, starts, range(5), 5, attn_implementation=packed_attention.ATTENTION,
                share_prompts=share,
            )  # fmt: skip
            forward_selected(model, mb)
            forward_selected(critic, mb, lm=False)
        assert built == []
        padded = torch.ones(2, 6, dtype=torch.long)
        model(padded, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]))
    assert built == [(2, 1, 6, 6)]  # a padded batch keeps sdpa's mask


def test_a_sequence_past_a_sliding_window_is_refused_not_attended_whole():
    q = torch.zeros(1, 2, 14, 4)
    module = torch.nn.Linear(1, 1).eval()
    out, _ = packed_attention.packed_attention(
        module, q, q, q, None, packed_segments=(5, (3, 4, 2)), sliding_window=7
    )  # the longest sequence, prompt 3 + response 4, fits
    assert out.shape == (1, 14, 2, 4)
    with pytest.raises(InputError, match=r"8 tokens .* sliding window \(7\).*packing false"):
        packed_attention.packed_attention(
            module, q, q, q, None, packed_segments=(6, (2, 6)), sliding_window=7
        )


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
