"""HF Qwen2/Llama <-> megatron-core GPTModel (asyncrl/trainers/megatron_bridge.py), with
real megatron-core on CPU (gloo, world size 1, the test-only shim in megatron_shim.py)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from asyncrl.trainers import megatron_bridge as bridge
from tests.megatron_shim import cpu_megatron, free_port, megatron_ranks

# megatron-core says at import that TransformerEngine and Apex are missing (expected here).
pytestmark = pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex).*:UserWarning")


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
    with megatron_ranks(0, 1, free_port()):
        yield


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


def test_tp_shards_gather_back_to_the_full_tensors():
    torch.manual_seed(3)
    cfg, model = qwen2()
    full = bridge.hf_to_megatron(cfg, hf_weights(model, cfg))
    for name, tensor in full.items():
        shards = [bridge.tp_shard(name, tensor, r, 2) for r in range(2)]
        assert torch.equal(bridge.tp_gather(name, shards), tensor), name
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]  # [gate; up], 128 rows each
    assert torch.equal(bridge.tp_shard("x.linear_fc1.weight", fc1, 1, 2)[:64], fc1[64:128])
    with pytest.raises(bridge.UnsupportedModel, match="num_key_value_heads 2 is not divisible"):
        bridge.check_tp(cfg, 4)


Worker = Callable[[int, int, str, str], None]


def spawn_per_model(workers: dict[str, Worker], out: Path) -> None:
    """Run each worker as 2 ranks for every model, each (worker, model) in its own process
    groups (on its own port) and folder ``out/<worker>/<name>``, all in one pair of
    processes: each imports torch and megatron once, not once per worker and model."""
    import torch.multiprocessing as mp

    runs = [(kind, name) for kind in workers for name in MODELS]
    ports: dict[tuple[str, str], int] = {}
    while len(set(ports.values())) < len(runs):  # two groups must not share a port
        ports = {run: free_port() for run in runs}
    for kind, name in runs:
        (out / kind / name).mkdir(parents=True)
    plan = [(workers[kind], ports[kind, name], name, str(out / kind / name))
            for kind, name in runs]  # fmt: skip
    mp.spawn(_each_run, args=(plan,), nprocs=2, join=True)


def _each_run(rank: int, plan: list[tuple[Worker, int, str, str]]) -> None:
    for worker, port, name, out in plan:
        worker(rank, port, name, out)


def _tp_worker(rank: int, port: int, name: str, out: str) -> None:
    """One of 2 TP ranks: load this rank's shards of the HF model, compare its vocab slice
    of the logits with HF's, then gather the HF-named weights."""
    import json

    with megatron_ranks(rank, 2, port, tp=2):
        torch.manual_seed(2)
        cfg, model = MODELS[name]()
        state = hf_weights(model, cfg)
        full = bridge.hf_to_megatron(cfg, state)
        tp = bridge.transformer_config(
            cfg, tensor_model_parallel_size=2, use_cpu_initialization=True
        )
        gpt = bridge.gpt_model(cfg, tp, te=False)
        shards = {k: bridge.tp_shard(k, v, rank, 2) for k, v in full.items()}
        gpt.load_state_dict(shards, strict=True)
        ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            got = gpt.eval()(ids, torch.arange(24).expand(2, -1), attention_mask=None)
            want = model(ids).logits.chunk(2, dim=-1)[rank]  # this rank's vocab slice
        back = bridge.gather_hf_weights(gpt, cfg)
        result = {"diff": (got - want).abs().max().item(), "shape": list(got.shape),
                  "same": all(torch.equal(back[k], state[k]) for k in state)}  # fmt: skip
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every model's 2 TP ranks and 2 pipeline stages (one spawn for all): the folders
    ``tp2/<name>`` and ``pp2/<name>``."""
    out = tmp_path_factory.mktemp("parallel")
    spawn_per_model({"tp2": _tp_worker, "pp2": _pp_worker}, out)
    return out


@pytest.fixture
def tp2_runs(parallel_runs: Path) -> Path:
    return parallel_runs / "tp2"


@pytest.fixture
def pp2_runs(parallel_runs: Path) -> Path:
    return parallel_runs / "pp2"


# The first one to run spawns both (about 30 s here, more on a slow CI machine).
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", MODELS)
def test_tp2_shards_give_the_hf_logits_and_gather_back_exactly(tp2_runs: Path, name: str):
    import json

    cfg, _ = MODELS[name]()
    for rank in range(2):
        result = json.loads((tp2_runs / name / f"rank{rank}.json").read_text())
        assert result["shape"] == [2, 24, cfg.vocab_size // 2]
        assert result["diff"] < 1e-5 and result["same"], result


def test_pp_stages_merge_back_to_the_full_state():
    torch.manual_seed(4)
    cfg, model = qwen2()
    full = bridge.hf_to_megatron(cfg, hf_weights(model, cfg))
    stages = [bridge.pp_stage(cfg, full, p, 2) for p in range(2)]
    assert "embedding.word_embeddings.weight" in stages[0] and "output_layer.weight" in stages[1]
    assert {k.split(".")[2] for k in stages[1] if k.startswith("decoder.layers.")} == {"0"}
    merged = bridge.pp_merge(cfg, stages)
    assert merged.keys() == full.keys() and all(torch.equal(merged[k], full[k]) for k in full)
    with pytest.raises(bridge.UnsupportedModel, match="2 layers do not split evenly"):
        bridge.pp_stage(cfg, full, 0, 4)


def _pp_worker(rank: int, port: int, name: str, out: str) -> None:
    """One of 2 pipeline stages: load this stage's layers, run the forward-only schedule;
    the last stage saves its logits, each stage the whole model's gathered weights."""
    with megatron_ranks(rank, 2, port, pp=2):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        torch.manual_seed(2)
        cfg, model = MODELS[name]()
        full = bridge.hf_to_megatron(cfg, hf_weights(model, cfg))
        pp = bridge.transformer_config(
            cfg, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
            use_cpu_initialization=True,
        )  # fmt: skip
        gpt = bridge.gpt_model(cfg, pp, pre_process=rank == 0, post_process=rank == 1, te=False)
        gpt.load_state_dict(bridge.pp_stage(cfg, full, rank, 2), strict=True)
        ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
        positions = torch.arange(24).expand(2, -1)
        kept: list[torch.Tensor] = []

        def step(data, m):  # type: ignore[no-untyped-def]
            ids_, pos_ = next(data)
            output = m(ids_, pos_, attention_mask=None)

            def keep(logits):  # type: ignore[no-untyped-def]
                kept.append(logits.detach())
                return logits.sum() * 0, {}

            return output, keep

        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter([(ids, positions)]), model=[gpt.eval()],
                num_microbatches=1, seq_length=24, micro_batch_size=2, forward_only=True,
            )  # fmt: skip
        if rank == 1:
            torch.save({"got": kept[0], "want": model(ids).logits.detach()}, Path(out, "logits.pt"))
        torch.save(bridge.gather_hf_weights(gpt, cfg), Path(out, f"weights{rank}.pt"))


# The first one to run spawns both (about 30 s here, more on a slow CI machine).
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", MODELS)
def test_pp2_stages_give_the_hf_logits_and_merge_back_exactly(pp2_runs: Path, name: str):
    tmp_path = pp2_runs / name
    logits = torch.load(tmp_path / "logits.pt", weights_only=True)
    assert logits["got"].shape == logits["want"].shape
    assert (logits["got"] - logits["want"]).abs().max().item() < 1e-5
    torch.manual_seed(2)
    cfg, model = MODELS[name]()
    state = hf_weights(model, cfg)
    for rank in range(2):  # every stage ends with the whole model's weights
        back = torch.load(tmp_path / f"weights{rank}.pt", weights_only=True)
        assert back.keys() == state.keys()
        assert all(torch.equal(back[k], state[k]) for k in state)
