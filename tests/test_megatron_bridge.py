"""HF Qwen2/Llama <-> megatron-core GPTModel (asyncrl/trainers/megatron_bridge.py), with
real megatron-core on CPU (gloo, world size 1, the test-only shim in megatron_shim.py)."""

from __future__ import annotations

import socket
import warnings
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from asyncrl.trainers import megatron_bridge as bridge
from tests.megatron_shim import cpu_megatron


def qwen2() -> tuple[Qwen2Config, Qwen2ForCausalLM]:
    """Tied embeddings, q/k/v biases, GQA (4 heads in 2 KV groups), rope theta 1e6."""
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True, rope_theta=1e6,
                      max_position_embeddings=64)  # fmt: skip
    return cfg, Qwen2ForCausalLM(cfg).eval()


def llama() -> tuple[LlamaConfig, LlamaForCausalLM]:
    """An untied lm_head, no biases, 8 heads in 4 KV groups."""
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
                      max_position_embeddings=64)  # fmt: skip
    return cfg, LlamaForCausalLM(cfg).eval()


MODELS = {"qwen2": qwen2, "llama": llama}


@pytest.fixture(scope="module")
def megatron_world() -> Iterator[None]:
    """One gloo process, TP = PP = 1, megatron's RNG seeded; all undone afterwards."""
    import torch.distributed as dist

    with warnings.catch_warnings(), cpu_megatron():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        try:
            parallel_state.initialize_model_parallel(1, 1)
            model_parallel_cuda_manual_seed(0)
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def hf_weights(model: torch.nn.Module, cfg: object) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight")  # the embedding itself
    return state


@pytest.mark.parametrize("name", MODELS)
def test_hf_to_megatron_to_hf_is_exact(name: str):
    torch.manual_seed(1)
    cfg, model = MODELS[name]()
    state = hf_weights(model, cfg)
    back = bridge.megatron_to_hf(cfg, bridge.hf_to_megatron(cfg, state))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_qkv_is_packed_per_kv_group():
    # 4 query heads in 2 groups, head dim 1: rows q0 q1 k0 v0 q2 q3 k1 v1.
    q, k, v = torch.arange(4.0), torch.tensor([10.0, 11.0]), torch.tensor([20.0, 21.0])
    packed = bridge.pack_qkv(q, k, v, groups=2)
    assert packed.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [t.tolist() for t in bridge.unpack_qkv(packed, groups=2, d=1)] == [
        q.tolist(), k.tolist(), v.tolist()
    ]  # fmt: skip


@pytest.mark.parametrize("name", MODELS)
def test_the_converted_gpt_model_gives_the_hf_models_logits(megatron_world, name: str):
    torch.manual_seed(2)
    cfg, model = MODELS[name]()
    with warnings.catch_warnings(), cpu_megatron():
        warnings.simplefilter("ignore")
        gpt = bridge.gpt_model(cfg, bridge.transformer_config(cfg, use_cpu_initialization=True),
                               te=False)  # fmt: skip
        # strict: no megatron tensor left unset, no HF tensor unused
        gpt.load_state_dict(bridge.hf_to_megatron(cfg, hf_weights(model, cfg)), strict=True)
        ids = torch.randint(0, cfg.vocab_size, (2, 24))
        positions = torch.arange(24).expand(2, -1)
        with torch.no_grad():
            got = gpt.eval()(ids, positions, attention_mask=None)
            want = model(ids).logits
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < 1e-5
        # and back: the model's own weights convert to the HF ones
        exported = bridge.megatron_to_hf(cfg, gpt.state_dict())
        state = hf_weights(model, cfg)
        assert all(torch.equal(exported[k], state[k]) for k in state)


def test_a_model_the_bridge_cannot_convert_is_refused_by_name():
    cfg = Qwen2Config(hidden_act="gelu")
    with pytest.raises(bridge.UnsupportedModel, match="hidden_act 'gelu'"):
        bridge.transformer_config(cfg)
    cfg = Qwen2Config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(bridge.UnsupportedModel, match="rope_type 'yarn'"):
        bridge.hf_to_megatron(cfg, {})
