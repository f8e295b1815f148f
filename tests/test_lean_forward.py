"""The engine's lean forward (asyncrl/engines/torch/lean_forward.py) computes transformers'
logits: a prefill of left-padded rows of different lengths, then decode steps, on a
tiny Qwen2 (q/k/v biases) and a tiny Llama (rope scaling), packed weights or not; and
it declines the models it does not cover."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from asyncrl.engines.torch import cpu_linear as cpu_linear
from asyncrl.engines.torch import lean_forward as lean_forward_module
from asyncrl.engines.torch.kv_batch import new_cache
from asyncrl.engines.torch.lean_forward import lean_forward

#: Wide enough that every fused and plain linear is packed (cpu_linear.MIN_ELEMENTS).
SHAPE = {
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
    "max_position_embeddings": 256, "initializer_range": 0.05,
}  # fmt: skip


def qwen2() -> torch.nn.Module:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True)).eval()


def llama() -> torch.nn.Module:
    torch.manual_seed(1)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    config = LlamaConfig(**SHAPE, rope_scaling=scaling, rope_theta=10000.0)
    return LlamaForCausalLM(config).eval()


def steps(forward, prompts: list[list[int]], decode: list[list[int]]) -> list[torch.Tensor]:
    """Every position's logits of a left-padded prefill, then the last position's of each
    decode step (the engine's calls)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = new_cache()
    out = [forward(ids, mask, positions, cache, 0)]
    last = positions[:, -1]
    for tokens in decode:
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], dim=1)
        last = last + 1
        out.append(forward(torch.tensor(tokens)[:, None], mask, last[:, None], cache, 1))
    return out


def hf(model):
    def forward(ids, mask, positions, cache, keep):
        return model(input_ids=ids, attention_mask=mask, position_ids=positions,
                     use_cache=True, cache=cache, logits_to_keep=keep).logits  # fmt: skip

    return forward


def lean(model, packed: bool):
    run = lean_forward(model, packed=packed)
    assert run is not None
    return run


@pytest.mark.parametrize("build", [qwen2, llama])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("folded", [True, False])
def test_the_lean_forward_gives_transformers_logits(build, packed: bool, folded: bool, monkeypatch):
    # Decode attention both ways: grouped query heads folded into positions (bf16, CUDA)
    # and sdpa's enable_gqa (fp32 on the CPU).
    monkeypatch.setattr(lean_forward_module, "_gqa_is_faster", lambda q: not folded)
    model = build()
    engine_model = copy.deepcopy(model)
    cpu_linear.use_for(engine_model, packed=packed)
    prompts = [[5, 9, 11], list(range(20, 47)), [300 - 1], list(range(100, 108))]
    decode = [[7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18]]
    with torch.inference_mode():
        want = steps(hf(model), prompts, decode)
        run = lean(engine_model, packed)
        got = steps(run, prompts, decode)
    # Fused (one packed matmul) only where packed: otherwise each part on its own weight.
    fused = run.layers[0].qkv._fused is not None
    assert fused == (packed and cpu_linear.packable(torch.float32))
    width = max(map(len, prompts))
    for i, p in enumerate(prompts):  # the prefill's real positions
        assert torch.allclose(got[0][i, width - len(p) :], want[0][i, width - len(p) :], atol=2e-5)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert torch.isfinite(g).all() and torch.allclose(g, w, atol=2e-5)


def test_the_lean_forward_follows_weight_writes_it_is_told_of():
    model = qwen2()
    run = lean_forward(model)
    assert run is not None
    ids, mask = torch.tensor([[3, 4, 5]]), torch.ones(1, 3, dtype=torch.long)
    positions = torch.arange(3)[None]
    with torch.inference_mode():
        before = run(ids, mask, positions, new_cache(), 1)
    q = model.model.layers[0].self_attn.q_proj.weight
    q.detach().numpy()[:] = torch.randn(q.shape).numpy()  # around the version counter
    run.invalidate()
    with torch.inference_mode():
        after = run(ids, mask, positions, new_cache(), 1)
        want = hf(model)(ids, mask, positions, new_cache(), 1)
    assert not torch.allclose(after, before) and torch.allclose(after, want, atol=2e-5)


def test_models_it_does_not_cover_go_through_transformers():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert lean_forward(gpt2) is None
    windowed = Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=8))
    assert lean_forward(windowed) is None
    hooked = qwen2()
    hooked.model.layers[0].mlp.register_forward_hook(lambda *_: None)
    assert lean_forward(hooked) is None
