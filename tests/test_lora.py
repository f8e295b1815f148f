"""LoRA on the policy (asyncrl/trainers/lora.py) through TorchTrainer, tiny Qwen2, CPU.

Only the adapters train and sit in the optimizer; the weights leave merged, and a model
loaded from them computes what the trainer's adapted forward computes; a checkpoint
keeps the adapters in peft's layout, loadable by peft, and resumes bit-exactly.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from asyncrl.cli import main
from asyncrl.config import ConfigError, load_config
from asyncrl.engines.base import GenerateRequest, SamplingParams
from asyncrl.engines.torch.engine import TorchEngine
from asyncrl.errors import EngineError
from asyncrl.policies import PolicyConfig
from asyncrl.trainers.torch_trainer import TorchTrainer
from asyncrl.types import Group, Sample, SampleStatus, TrainBatch
from tests.test_torch_engine import final
from tests.test_torch_trainer import config, make_batch
from tests.tiny_model import build_tiny_model

LORA = {"rank": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(path, tie_word_embeddings=False)
    return path


def lora_trainer(path: Path, **lora: object) -> TorchTrainer:
    return TorchTrainer(config(path, lora=LORA | lora, lr=1e-2))


def test_only_the_adapters_train_and_sit_in_the_optimizer(tiny):
    trainer = lora_trainer(tiny)
    model = trainer.policy.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.train_step(make_batch())
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    # B starts at 0, so after one step every B moved; A moves from the second step
    assert changed and all(".lora_" in k for k in changed)
    assert any(".lora_B." in k for k in changed)
    optimized = {id(p) for g in trainer.policy.optimizer.param_groups for p in g["params"]}
    adapters = {id(p) for n, p in model.named_parameters() if ".lora_" in n}
    assert optimized == adapters
    # every linear of both decoder layers (7 each), not the head: 14 x r x (in + out)
    assert len(trainer.policy.adapters.layers()) == 14
    assert "lm_head" not in str(trainer.policy.adapters.layers().keys())


def test_the_exported_weights_are_merged_and_load_into_a_model_that_computes_the_same(
    tiny, tmp_path
):
    trainer = lora_trainer(tiny)
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    start = trainer.export_weights()
    assert start.keys() == base.state_dict().keys()  # HF names, no peft names
    # version 0 is the base model (B = 0)
    assert all(torch.equal(start[k], v) for k, v in base.state_dict().items())
    for step in range(2):
        trainer.train_step(make_batch(step, version=step))
    weights = trainer.export_weights()
    assert not torch.equal(
        weights["model.layers.0.mlp.down_proj.weight"],
        base.state_dict()["model.layers.0.mlp.down_proj.weight"],
    )
    base.load_state_dict(weights)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        trainer.policy.model.eval()
        adapted = trainer.policy.model(ids).logits
    assert torch.allclose(base(ids).logits, adapted, atol=1e-4)
    trainer.save_hf(tmp_path / "out")  # an ordinary HF folder of the merged weights
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(served(ids).logits, adapted, atol=1e-4)


def test_a_lora_checkpoint_resumes_bit_exactly_and_its_adapter_loads_in_peft(tiny, tmp_path):
    from peft import PeftModel

    algo = PolicyConfig()
    first = TorchTrainer(config(tiny, lora=LORA | {"dropout": 0.1}, lr=1e-2), algo)
    for step in range(2):
        first.train_step(make_batch(step, version=step))
    ckpt = tmp_path / "run" / "checkpoints" / "trainer" / "step_000002"
    first.save_checkpoint(ckpt)
    assert (ckpt / "adapter" / "adapter_config.json").is_file()
    assert not (ckpt / "policy" / "adapter_config.json").exists()
    saved = first.export_weights()
    state = first.policy.optimizer.state_dict()["state"].values()
    assert sum(s["exp_avg"].numel() for s in state) == first.policy.adapters.num_trainable()
    rng = torch.get_rng_state(), np.random.rand(), random.random()
    for step in range(2, 4):
        first.train_step(make_batch(step, version=step))

    second = TorchTrainer(config(tiny, lora=LORA | {"dropout": 0.1}, lr=1e-2), algo)
    second.load_checkpoint(ckpt)
    assert torch.equal(torch.get_rng_state(), rng[0])
    assert (np.random.rand(), random.random()) == rng[1:]
    for step in range(2, 4):
        second.train_step(make_batch(step, version=step))
    a, b = first.policy.model.state_dict(), second.policy.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    # exported alone, peft puts the adapters on the base model: the merged weights of then
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--adapter"]) == 0
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), str(tmp_path / "out")
    )
    merged = peft_model.merge_and_unload().state_dict()
    assert all(torch.allclose(merged[k], saved[k], atol=1e-6) for k in saved)


def test_a_checkpoint_of_other_adapters_is_refused_by_name(tiny, tmp_path):
    trainer = lora_trainer(tiny, target_modules=["q_proj", "v_proj"])
    trainer.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(Exception, match="adapters do not match"):
        lora_trainer(tiny).load_checkpoint(tmp_path / "ckpt")  # all-linear
    other_scale = lora_trainer(tiny, target_modules=["q_proj", "v_proj"], alpha=16.0)
    with pytest.raises(Exception, match=r"lora_alpha 8.0 \(this run: 16.0\)"):
        other_scale.load_checkpoint(tmp_path / "ckpt")


def test_lora_settings_that_cannot_work_are_refused(tiny):
    with pytest.raises(ValidationError, match="parallel=fsdp"):
        config(tiny, lora=LORA, parallel="fsdp")
    with pytest.raises(ValidationError, match="at least 1 item"):
        config(tiny, lora=LORA | {"target_modules": []})
    with pytest.raises(ValidationError, match="sim trains no model, so lora, ppo_epochs"):
        TorchTrainer.Config(model_path="m", backend="sim", lora=LORA, ppo_epochs=2)
    with pytest.raises(ValidationError, match="LoRA"):
        TorchTrainer.Config(model_path=str(tiny), backend="megatron", lora=LORA)
    with pytest.raises(ValueError, match="target_modules"):
        lora_trainer(tiny, target_modules=["no_such_proj"])
    base = ["--hf-checkpoint", str(tiny), "--prompt-data", "p.jsonl", "--lora-rank", "4",
            "--lora-publish", "adapters"]  # fmt: skip
    for extra, reason in (
        (["--rollout.engine.model-path", "/elsewhere"], "must be the trainer's base"),
        (["--rollout.engine.type", "sglang", "--rollout.engine.urls", '["http://h:1"]'],
         "only the embedded torch engine"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=reason):
            load_config(overrides=[*base, *extra])


# ------------------------------------------------------------- adapter-only versions


@pytest.fixture
async def engine(tiny) -> AsyncIterator[TorchEngine]:
    eng = TorchEngine.from_pretrained(str(tiny))
    task = asyncio.create_task(eng.run())
    yield eng
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


async def greedy(engine: TorchEngine, ids: list[int]) -> list[int]:
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    out = await final(engine, GenerateRequest(rid="g", input_ids=ids, sampling=params))
    return out.output_ids


async def test_an_adapter_version_is_a_tenth_of_the_bytes_and_the_engine_merges_it_exactly(
    tiny, engine
):
    trainer = lora_trainer(tiny, publish="adapters")
    embed = engine.model.state_dict()["model.embed_tokens.weight"].clone()
    ids = list(range(5, 20))
    for version in (2, 3):  # each version merges onto the base, not onto the one before
        while trainer.version < version:
            trainer.train_step(make_batch(trainer.version, version=trainer.version))
        adapters, merged = trainer.export_weights(), trainer.policy.hf_weights()
        assert nbytes(merged) >= 10 * nbytes(adapters)
        await engine.update_weights_from_tensors(adapters, version=version)
        got = engine.model.state_dict()
        assert all(torch.allclose(got[k], merged[k], atol=1e-6) for k in merged)
        assert torch.equal(got["model.embed_tokens.weight"], embed) and engine.version == version
    # it samples from the merged weights (the packed copies were made again)
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    hf.load_state_dict(merged)
    want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :]
    assert await greedy(engine, ids) == want.tolist()


async def test_a_bf16_engine_merges_each_version_onto_the_untouched_base(tiny):
    """A float32 base file under a bfloat16 engine: each version is the base plus its own
    adapters, never plus the versions before (the base's mapped memory stays as read)."""
    trainer = lora_trainer(tiny, publish="adapters")
    eng = TorchEngine.from_pretrained(str(tiny), dtype="bfloat16")
    task = asyncio.create_task(eng.run())
    try:
        for version in (1, 2, 3):
            trainer.train_step(make_batch(version, version=trainer.version))
            await eng.update_weights_from_tensors(trainer.export_weights(), version=version)
        merged = trainer.policy.hf_weights()
        got = eng.model.state_dict()
        assert all(torch.equal(got[k], merged[k].bfloat16()) for k in merged)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_merge_that_fails_midway_tears_the_engine_until_a_version_completes(
    tiny, engine, monkeypatch
):
    from asyncrl.weights import lora_merge

    version = lora_trainer(tiny, publish="adapters").export_weights()
    calls = []
    real_get = lora_merge.BaseWeights.get

    def failing_get(self, name):
        calls.append(name)
        if len(calls) == 3:
            raise MemoryError("no room for the merge")
        return real_get(self, name)

    monkeypatch.setattr(lora_merge.BaseWeights, "get", failing_get)
    with pytest.raises(MemoryError):
        await engine.update_weights_from_tensors(version, version=1)
    assert engine.torn and engine.version == 0
    params = SamplingParams(temperature=0, max_new_tokens=4)
    out = await final(engine, GenerateRequest(rid="t", input_ids=[5, 6, 7], sampling=params))
    assert out.finish_reason.type == "abort"  # nothing is sampled from a mix
    monkeypatch.setattr(lora_merge.BaseWeights, "get", real_get)
    await engine.update_weights_from_tensors(version, version=1)
    assert not engine.torn and engine.version == 1


async def test_a_malformed_adapter_version_is_refused_before_anything_is_copied(tiny, engine):
    version = lora_trainer(tiny, publish="adapters").export_weights()
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    lost_b = {k: v for k, v in version.items() if k != "model.layers.0.mlp.up_proj.lora_B.weight"}
    with pytest.raises(EngineError, match="missing"):
        await engine.update_weights_from_tensors(lost_b, version=1)
    narrow = dict(version)
    narrow["model.layers.1.mlp.down_proj.lora_A.weight"] = torch.zeros(4, 7)
    with pytest.raises(EngineError, match="shape"):
        await engine.update_weights_from_tensors(narrow, version=1)
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    assert engine.version == 0
    bare = TorchEngine(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32))
    with pytest.raises(EngineError, match="base model's safetensors"):
        await bare.update_weights_from_tensors(version, version=1)


# --------------------------------------------------------------------- the real model


async def test_lora_grpo_on_the_real_model_learns_through_adapter_only_versions(smollm2_dir):
    """SmolLM2-135M-Instruct, LoRA r 8 on q/v with adapter-only versions: GRPO steps on
    groups the engine samples (each version merged by the engine before the next
    groups) raise a reward for short replies, on fresh samples; each version is more
    than 10x smaller than the merged weights."""
    lora = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"], "publish": "adapters"}
    config = TorchTrainer.Config(model_path=str(smollm2_dir), lr=3e-3, lora=lora, dtype="float32")
    trainer = TorchTrainer(config)
    engine = TorchEngine.from_pretrained(str(smollm2_dir))
    task = asyncio.create_task(engine.run())
    chat = [[{"role": "user", "content": q}] for q in ("Name a color.", "Name a fruit.")]
    prompts = [engine.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False) for c in chat]  # fmt: skip
    try:
        before = await mean_reward(engine, prompts, seed=1000)
        for step in range(STEPS):
            groups = await sample_groups(engine, prompts, seed=step * 100)
            trainer.train_step(TrainBatch(batch_id=step, step=step, groups=groups))
            version = trainer.export_weights()
            assert nbytes(trainer.policy.hf_weights()) > 10 * nbytes(version)
            await engine.update_weights_from_tensors(version, version=trainer.version)
        after = await mean_reward(engine, prompts, seed=1000)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert after > before + 0.3, (before, after)


STEPS, GROUP, MAX_NEW = 4, 8, 24


def short_reply(n_tokens: int) -> float:
    """1 for a reply of at most 4 tokens, falling linearly to 0 at ``MAX_NEW``."""
    return min(1.0, (MAX_NEW - n_tokens) / (MAX_NEW - 4))


async def sample_groups(engine: TorchEngine, prompts: list[list[int]], seed: int) -> list[Group]:
    """``GROUP`` replies to each prompt, generated together (one running batch)."""

    async def one(g: int, i: int) -> Sample:
        params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW,
                                sampling_seed=seed + g * GROUP + i)  # fmt: skip
        request = GenerateRequest(rid=f"{seed}-{g}-{i}", input_ids=prompts[g], sampling=params)
        out = await final(engine, request)
        s = Sample(uid=f"{seed}/{g}/{i}", group_id=f"{seed}/{g}", index=i,
                   packed_prompt=np.asarray(prompts[g], np.int32).tobytes(),
                   temperature=params.temperature)  # fmt: skip
        s.append_response(np.asarray(out.output_ids), np.asarray(out.logprobs), out.versions[0])
        s.reward, s.status = short_reply(len(out.output_ids)), SampleStatus.COMPLETED
        return s

    samples = await asyncio.gather(*(one(g, i) for g in range(len(prompts)) for i in range(GROUP)))
    return [
        Group(uid=f"{seed}/{g}", prompt_uid=str(g), samples=samples[g * GROUP : (g + 1) * GROUP])
        for g in range(len(prompts))
    ]


async def mean_reward(engine: TorchEngine, prompts: list[list[int]], seed: int) -> float:
    groups = [g for rnd in range(2) for g in await sample_groups(engine, prompts, seed + rnd * 50)]
    return float(np.mean([s.reward for g in groups for s in g.samples]))


def test_the_reference_is_the_policy_with_its_adapters_off(tiny, tmp_path):
    """With LoRA and a KL loss no reference copy is loaded: the adapters are disabled for
    the reference's forward. The KL equals a run whose reference is a loaded copy of the
    base, also once the adapters have moved (step 2)."""
    import shutil

    shutil.copytree(tiny, tmp_path / "copy")
    algo = PolicyConfig(use_kl_loss=True, kl_loss_coef=0.1)
    base = TorchTrainer(config(tiny, lora=LORA, lr=1e-2), algo)
    loaded = TorchTrainer(config(tiny, lora=LORA, lr=1e-2, ref_model_path=str(tmp_path / "copy")),
                          algo)  # fmt: skip
    assert base.ref is None and base.ref_is_base and loaded.ref is not None
    kls = []
    for step in range(2):
        a, b = base.train_step(make_batch(seed=step)), loaded.train_step(make_batch(seed=step))
        assert a.metrics["kl_loss"] == pytest.approx(b.metrics["kl_loss"], abs=1e-7), step
        kls.append(a.metrics["kl_loss"])
    assert kls[0] == pytest.approx(0.0, abs=1e-7) and kls[1] > 1e-6  # B = 0, then it moved


@pytest.mark.parametrize("transport", ["dist", "ipc"])
async def test_adapter_versions_reach_the_engine_by_broadcast_and_shared_memory(
    tiny, tmp_path, transport
):
    """Adapter-only versions by the dist (gloo) and ipc (shared memory) transports: the
    engine merges each onto its base as it does a pulled one."""
    import json

    from asyncrl.job import run_job
    from tests.test_train import job_flags, write_prompts

    (tmp_path / "model").symlink_to(tiny, target_is_directory=True)
    write_prompts(tmp_path / "prompts.jsonl")
    flags = [*job_flags(tmp_path, 3), "--lora-rank", "4", "--lora-alpha", "8",
             "--lora-publish", "adapters", "--update-weight-transport", transport]  # fmt: skip
    result = await run_job(load_config(overrides=flags))
    assert result.ok and result.steps == 3, result.error
    rows = (tmp_path / "run" / "metrics" / "rollout-0.jsonl").read_text().splitlines()
    last = json.loads(rows[-1])
    if transport == "ipc":  # every version from the trainer's memory
        assert last["rollout/weights_shared"] >= 1 and last["rollout/weights_pulled"] == 0, last
    else:  # by broadcast once the group has formed (a version before it is pulled)
        assert last["rollout/weights_broadcast"] >= 1, last


def test_a_disk_adapter_version_is_a_peft_folder_that_peft_loads(tiny, tmp_path):
    """On disk an adapter version is peft's layout (so peft, vLLM and SGLang load it), and
    reads back as the same version."""
    from peft import PeftModel

    from asyncrl.weights.sync import _load_dir, write_version_dir

    trainer = lora_trainer(tiny, publish="adapters")
    trainer.train_step(make_batch())  # B moves off 0
    version = trainer.export_weights()
    write_version_dir(tmp_path / "v1", version)
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]  # fmt: skip
    back = _load_dir(tmp_path / "v1")
    assert back.keys() == version.keys() and all(torch.equal(back[k], version[k]) for k in back)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), tmp_path / "v1")
    merged = AutoModelForCausalLM.from_pretrained(tiny)
    merged.load_state_dict(trainer.policy.hf_weights())
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(adapted.eval()(ids).logits, merged.eval()(ids).logits, atol=1e-5)
