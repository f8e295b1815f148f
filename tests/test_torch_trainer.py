"""TorchTrainer (asyncrl/trainers/torch_trainer.py) on a tiny local Qwen2, fp32, CPU.

Gradient accumulation and 2-rank DDP/FSDP against one big batch, bit-exact resume, HF
export and reload, and that an RL step moves the policy the way its advantages say.
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from asyncrl.errors import CheckpointUnreadable, NonFiniteTraining
from asyncrl.policies import PolicyConfig
from asyncrl.trainers import torch_trainer
from asyncrl.trainers.base import NonFiniteStep, Trainer
from asyncrl.trainers.learner import (
    Learner,
    OptimSettings,
    SavedState,
    lr_factor,
    step_together,
)
from asyncrl.trainers.rollout_tensors import rollout_tensors
from asyncrl.trainers.torch_trainer import TorchTrainer
from asyncrl.types import Group, Sample, SampleStatus, TrainBatch
from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(path)
    return path


def config(path: Path, **overrides: Any) -> TorchTrainer.Config:
    return TorchTrainer.Config(**({"model_path": str(path), "lr": 1e-3} | overrides))


def make_batch(
    seed: int = 0,
    num_groups: int = 3,
    group_size: int = 4,
    version: int = 0,
    statuses: dict[tuple[int, int], SampleStatus] | None = None,
) -> TrainBatch:
    """Random prompts and responses; rewards vary inside each group (some are dicts)."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        prompt = rng.integers(3, 500, int(rng.integers(2, 7))).astype(np.int32)
        samples = []
        for i in range(group_size):
            s = Sample(uid=f"{g}/{i}", group_id=str(g), index=i, packed_prompt=prompt.tobytes(),
                       temperature=1.0)  # fmt: skip
            n = int(rng.integers(2, 10))
            mask = (rng.random(n) > 0.2).astype(np.uint8)
            s.append_response(
                rng.integers(3, 500, n), rng.normal(-4, 0.5, n), version, loss_mask=mask
            )
            score = float(rng.random())
            s.reward = {"score": score, "format": 1.0} if i % 2 else score
            s.status = (statuses or {}).get((g, i), SampleStatus.COMPLETED)
            samples.append(s)
        groups.append(Group(uid=str(g), prompt_uid=str(g), samples=samples))
    return TrainBatch(batch_id=seed, step=version, groups=groups)


def capture_grads(learner: Learner) -> dict[str, torch.Tensor]:
    """Gradients as the optimizer sees them, recorded at every step (full tensors)."""
    grads: dict[str, torch.Tensor] = {}

    def hook(*_: Any) -> None:
        for name, p in learner.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().clone()

    learner.optimizer.register_step_pre_hook(hook)
    return grads


def params(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.model.named_parameters()}


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=atol), name


# -------------------------------------------------------------------- one step, many ways


def test_the_trainer_satisfies_the_trainer_protocol(tiny):
    trainer = TorchTrainer(config(tiny))
    assert isinstance(trainer, Trainer)
    assert trainer.version == 0


def test_gradient_accumulation_matches_one_micro_batch_holding_everything(tiny):
    algo = PolicyConfig(loss_aggregation="seq-mean-token-mean", entropy_coef=0.01)
    one = TorchTrainer(config(tiny, max_tokens_per_microbatch=10_000), algo)
    many = TorchTrainer(config(tiny, max_tokens_per_microbatch=16), algo)
    grads_one, grads_many = capture_grads(one.policy), capture_grads(many.policy)
    batch = make_batch()
    r_one, r_many = one.train_step(batch), many.train_step(batch)
    assert_close(grads_one, grads_many, atol=1e-5)
    assert abs(r_one.metrics["loss"] - r_many.metrics["loss"]) < 1e-6
    assert abs(r_one.metrics["grad_norm"] - r_many.metrics["grad_norm"]) < 1e-5
    assert abs(r_one.metrics["entropy"] - r_many.metrics["entropy"]) < 1e-5


def test_padded_micro_batches_train_like_packed_ones(tiny):
    packed = TorchTrainer(config(tiny, max_tokens_per_microbatch=40))
    padded = TorchTrainer(config(tiny, max_tokens_per_microbatch=40, packing=False))
    grads_packed, grads_padded = capture_grads(packed.policy), capture_grads(padded.policy)
    packed.train_step(make_batch(1))
    padded.train_step(make_batch(1))
    assert_close(grads_packed, grads_padded, atol=1e-5)


def test_gradient_checkpointing_trades_memory_not_gradients(tiny):
    plain = TorchTrainer(config(tiny))
    recomputed = TorchTrainer(config(tiny, gradient_checkpointing=True))
    assert any(
        getattr(m, "gradient_checkpointing", False) for m in recomputed.policy.model.modules()
    )
    grads_plain, grads_recomputed = capture_grads(plain.policy), capture_grads(recomputed.policy)
    plain.train_step(make_batch())
    recomputed.train_step(make_batch())
    assert_close(grads_plain, grads_recomputed, atol=1e-6)


def test_lr_warms_up_linearly_then_follows_the_cosine():
    s = OptimSettings(lr=1.0, schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    # warmup (k + 1) / 2; then 0.1 + 0.9 * (1 + cos(pi * (k - 2) / 4)) / 2
    expected = [0.5, 1.0, 1.0, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 0.55]
    assert [lr_factor(k, s) for k in range(5)] == pytest.approx(expected)
    assert lr_factor(6, s) == lr_factor(60, s) == pytest.approx(0.1)
    assert lr_factor(100, OptimSettings(lr=1.0)) == 1.0


def test_the_reported_lr_is_the_one_the_step_used(tiny):
    trainer = TorchTrainer(config(tiny, lr=1e-3, warmup_steps=4))
    lrs = [trainer.train_step(make_batch(k)).metrics["lr"] for k in range(2)]
    assert lrs == pytest.approx([2.5e-4, 5e-4])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_steps(trainer: TorchTrainer, ckpt: Path | None = None) -> float:
    """Step on a big batch, (checkpoint,) then on a 3-sample batch whose plan gives rank 0
    two micro-batches and rank 1 one, so rank 1 runs the empty stand-in."""
    trainer.train_step(make_batch(2, num_groups=4))
    if ckpt is not None:
        trainer.save_checkpoint(ckpt)
    return trainer.train_step(make_batch(3, num_groups=1, group_size=3)).metrics["loss"]


def _dp_worker(rank: int, port: int, path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results = {}
        ckpt = Path(out).with_name("fsdp_ckpt")
        for mode in ("ddp", "fsdp"):
            trainer = TorchTrainer(config(Path(path), parallel=mode, **_DP_KW), _DP_ALGO)
            grads = capture_grads(trainer.policy)
            critic_grads = capture_grads(trainer.critic)
            loss = _two_steps(trainer, ckpt if mode == "fsdp" else None)
            weights = trainer.export_weights()  # a collective under FSDP
            results[mode] = {
                "grads": grads,
                "critic": critic_grads,
                "weights": weights,
                "loss": loss,
            }
        resumed = TorchTrainer(config(Path(path), parallel="fsdp", **_DP_KW), _DP_ALGO)
        resumed.load_checkpoint(ckpt)
        resumed.train_step(make_batch(3, num_groups=1, group_size=3))
        resumed_weights = resumed.export_weights()
        if rank == 0:
            torch.save({"results": results, "resumed": resumed_weights}, out)
    finally:
        dist.destroy_process_group()
    # Done: skip the interpreter's teardown, where gloo's run-loop threads (alive after
    # destroy_process_group) aborted the process now and then (asyncrl/trainers/ranks.py).
    os._exit(0)


_DP_KW: dict[str, Any] = {"max_tokens_per_microbatch": 24, "lr": 1e-6}
# ppo with a KL loss: the critic and the reference model are wrapped and sharded too
_DP_ALGO = PolicyConfig(advantage_estimator="ppo", use_kl_loss=True, kl_loss_coef=0.1)


@pytest.mark.slow
def test_two_rank_ddp_and_fsdp_equal_single_process_training(tiny, tmp_path):
    out = tmp_path / "dp.pt"
    mp.spawn(_dp_worker, args=(_free_port(), str(tiny), str(out)), nprocs=2, join=True)
    single = TorchTrainer(config(tiny, **_DP_KW), _DP_ALGO)
    grads, critic = capture_grads(single.policy), capture_grads(single.critic)
    loss = _two_steps(single)
    weights = single.export_weights()
    saved = torch.load(out, weights_only=False)
    for mode, got in saved["results"].items():
        assert abs(got["loss"] - loss) < 1e-6, mode
        assert_close(got["grads"], grads, atol=1e-5)
        assert_close(got["weights"], weights, atol=1e-5)
        assert_close(got["critic"], critic, atol=1e-5)
    # an FSDP checkpoint resumes bit-exactly too
    fsdp = saved["results"]["fsdp"]["weights"]
    assert all(torch.equal(saved["resumed"][k], fsdp[k]) for k in fsdp)


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor builds C++ on the CPU")
def test_compiled_blocks_train_as_the_eager_ones(tiny):
    """``trainer.compile``: the MLPs and norms compiled (packed rows of varying length,
    bf16 autocast) give the eager step's loss and weights, under the same names (without
    ``emulate_precision_casts`` the loss differed by 1.5%)."""
    eager = TorchTrainer(config(tiny, dtype="bf16-mixed"))
    compiled = TorchTrainer(config(tiny, dtype="bf16-mixed", compile=True))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for step in range(2):  # two batches: other lengths run the same dynamic graphs
        a = eager.train_step(make_batch(step, version=step)).metrics
        b = compiled.train_step(make_batch(step, version=step)).metrics
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    a, b = eager.export_weights(), compiled.export_weights()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-6), name
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= graphs + 2  # MLP, norm
    with pytest.raises(ValidationError, match="sim trains no model, so compile"):
        TorchTrainer.Config(model_path="m", backend="sim", compile=True)
    with pytest.raises(ValueError, match="no \\*MLP or \\*RMSNorm"):
        torch_trainer.compile_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


# ------------------------------------------------------------------------- checkpoints


def test_a_checkpoint_resumes_bit_exactly(tiny, tmp_path):
    algo = PolicyConfig(advantage_estimator="ppo", use_kl_loss=True, kl_loss_coef=0.1)
    cfg = config(tiny, lr_schedule="cosine", warmup_steps=1, total_steps=6, weight_decay=0.1)
    first = TorchTrainer(cfg, algo)
    for step in range(2):
        first.train_step(make_batch(step, version=step))
    torch.rand(5), np.random.rand(5), random.random()  # as dropout or sampling would
    first.save_checkpoint(tmp_path / "ckpt")
    rngs = torch.get_rng_state(), np.random.rand(), random.random()
    for step in range(2, 4):
        first.train_step(make_batch(step, version=step))

    second = TorchTrainer(cfg, algo)
    second.load_checkpoint(tmp_path / "ckpt")
    assert second.version == 2
    assert torch.equal(torch.get_rng_state(), rngs[0])  # the RNGs come back as saved
    assert (np.random.rand(), random.random()) == rngs[1:]
    for step in range(2, 4):
        second.train_step(make_batch(step, version=step))
    assert second.version == first.version == 4
    for learner_a, learner_b in ((first.policy, second.policy), (first.critic, second.critic)):
        a, b = learner_a.model.state_dict(), learner_b.model.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert first.policy.scheduler.get_last_lr() == second.policy.scheduler.get_last_lr()


def test_a_resume_trains_at_this_runs_lr_and_betas_with_the_saved_moments(tiny, tmp_path):
    """The optimizer state carries the checkpoint's lr and betas; a resume with other ones
    (``--lr``) trains at them, the schedule's position and AdamW's moments kept."""
    sched = {"lr_schedule": "cosine", "warmup_steps": 1, "total_steps": 6}
    first = TorchTrainer(config(tiny, **sched))
    for step in range(2):
        first.train_step(make_batch(step, version=step))
    first.save_checkpoint(tmp_path / "ckpt")
    second = TorchTrainer(config(tiny, lr=5e-4, betas=(0.8, 0.95), **sched))
    second.load_checkpoint(tmp_path / "ckpt")
    group = second.policy.optimizer.param_groups[0]
    settings = OptimSettings(lr=5e-4, schedule="cosine", warmup_steps=1, total_steps=6)
    assert group["lr"] == pytest.approx(5e-4 * lr_factor(2, settings))
    assert group["betas"] == (0.8, 0.95) and group["initial_lr"] == 5e-4
    assert second.policy.scheduler.get_last_lr() == [group["lr"]]
    saved = first.policy.optimizer.state_dict()["state"]
    loaded = second.policy.optimizer.state_dict()["state"]
    assert all(torch.equal(saved[k]["exp_avg"], loaded[k]["exp_avg"]) for k in saved)
    lr = group["lr"]  # the live group: the step below moves it on
    assert second.train_step(make_batch(2, version=2)).metrics["lr"] == pytest.approx(lr)


# --------------------------------------------------------------------- weights out, in HF


@pytest.mark.parametrize("tied", [True, False])
def test_save_hf_reloads_with_equal_logits(tmp_path, tied):
    src = tmp_path / "src"
    model, _ = build_tiny_model(src, tie_word_embeddings=tied)
    trainer = TorchTrainer(config(src))
    trainer.train_step(make_batch())
    exported = trainer.export_weights()
    trainer.save_hf(tmp_path / "out")

    reference = tmp_path / "hf"
    trainer.policy.model.save_pretrained(reference)  # what transformers itself writes
    assert set(exported) == set(load_file(str(reference / "model.safetensors")))
    assert ("lm_head.weight" in exported) is not tied
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in exported.values())

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        expected = trainer.policy.model(ids).logits
        assert torch.allclose(reloaded(ids).logits, expected, atol=1e-6)
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert not torch.equal(exported["model.norm.weight"], model.model.norm.weight)


def test_a_snapshot_written_after_more_steps_holds_its_moment_and_resumes_as_a_save(
    tiny, tmp_path, monkeypatch
):
    algo = PolicyConfig(advantage_estimator="ppo", use_kl_loss=True, kl_loss_coef=0.1)
    cfg = config(tiny, lr_schedule="cosine", warmup_steps=1, total_steps=6)
    trainer = TorchTrainer(cfg, algo)
    for step in range(2):
        trainer.train_step(make_batch(step, version=step))
    write = trainer.snapshot_checkpoint()
    assert write is not None
    trainer.save_checkpoint(tmp_path / "now")
    for step in range(2, 4):  # the live state moves on before the copy is written
        trainer.train_step(make_batch(step, version=step))
    write(tmp_path / "later")

    def files(path: Path) -> list[Path]:
        return sorted(p.relative_to(path) for p in path.rglob("*"))

    assert files(tmp_path / "now") == files(tmp_path / "later")
    for name in ("policy", "critic"):
        now = load_file(tmp_path / "now" / name / "model.safetensors")
        later = load_file(tmp_path / "later" / name / "model.safetensors")
        assert now.keys() == later.keys() and all(torch.equal(now[k], later[k]) for k in now)
    resumed = [TorchTrainer(cfg, algo) for _ in range(2)]
    for t, path in zip(resumed, ("now", "later"), strict=True):
        t.load_checkpoint(tmp_path / path)
        assert t.version == 2
        t.train_step(make_batch(2, version=2))  # optimizer moments and schedule: as saved
    a, b = (t.policy.model.state_dict() for t in resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # No copy where the machine lacks twice its size free, or of LoRA's live adapters.
    lora = TorchTrainer(config(tiny, lora={"rank": 4, "alpha": 8.0}))
    assert lora.snapshot_checkpoint() is None
    need = trainer.policy.state_bytes() + trainer.critic.state_bytes()
    monkeypatch.setattr(torch_trainer, "available_memory", lambda: 2 * need - 1)
    assert trainer.snapshot_checkpoint() is None
    monkeypatch.setattr(torch_trainer, "available_memory", lambda: 2 * need)
    assert trainer.snapshot_checkpoint() is not None


@pytest.mark.parametrize("copy", [False, True])
def test_a_save_holds_one_learners_state_at_a_time_unless_it_copies(
    tiny, tmp_path, monkeypatch, copy
):
    """In the step's time each learner's state is taken as it is written (under FSDP rank
    0 gathers one at a time); a snapshot copies both at once, before any write."""
    algo = PolicyConfig(advantage_estimator="ppo", use_kl_loss=True, kl_loss_coef=0.1)
    trainer = TorchTrainer(config(tiny), algo)
    trainer.train_step(make_batch())
    events: list[str] = []
    take, write = Learner.saved_state, SavedState.write

    def taken(self: Learner, copy: bool = False) -> SavedState | None:
        events.append(f"{'policy' if self is trainer.policy else 'critic'} taken")
        return take(self, copy)

    monkeypatch.setattr(Learner, "saved_state", taken)

    def written(self: SavedState, path: Path, *args: Any, **kwargs: Any) -> None:
        write(self, path, *args, **kwargs)
        events.append(f"{path.name} written")

    monkeypatch.setattr(SavedState, "write", written)
    if copy:
        snapshot = trainer.snapshot_checkpoint()
        assert snapshot is not None
        snapshot(tmp_path / "ckpt")
    else:
        trainer.save_checkpoint(tmp_path / "ckpt")
    both = ["policy taken", "critic taken", "policy written", "critic written"]
    each = ["policy taken", "policy written", "critic taken", "critic written"]
    assert events == (both if copy else each)
    assert (tmp_path / "ckpt" / "critic" / "model.safetensors").is_file()


def test_exported_weights_are_copies_that_later_steps_do_not_touch(tiny):
    trainer = TorchTrainer(config(tiny))
    exported = trainer.export_weights()
    before = {k: v.clone() for k, v in exported.items()}
    trainer.train_step(make_batch())
    assert all(torch.equal(exported[k], before[k]) for k in exported)
    assert not torch.equal(
        trainer.export_weights()["model.norm.weight"], before["model.norm.weight"]
    )


def test_uncopied_weights_are_the_live_parameters_under_the_same_names(tiny):
    """``copy=False`` (the ipc transport copies at once): no copy is made, so a GPU
    trainer hands CUDA IPC its own tensors; the names and values are export_weights'."""
    trainer = TorchTrainer(config(tiny))
    copies, live = trainer.export_weights(), trainer.export_weights(copy=False)
    assert live.keys() == copies.keys()
    assert all(torch.equal(live[k], copies[k]) for k in live)
    pointers = {p.data_ptr() for p in trainer.policy.model.parameters()}
    assert {t.data_ptr() for t in live.values()} <= pointers | {
        b.data_ptr() for b in trainer.policy.model.buffers()
    }
    assert not {t.data_ptr() for t in copies.values()} & pointers


# ------------------------------------------------------------------------- the RL step


def _response_logprob(trainer: TorchTrainer, sample: Sample) -> float:
    ids = torch.as_tensor(np.concatenate([sample.prompt_tokens, sample.response_tokens]))[None]
    p = len(sample.prompt_tokens)
    with torch.no_grad():
        logits = trainer.policy.model(ids).logits[0, p - 1 : -1]
    targets = torch.from_numpy(sample.response_tokens.astype(np.int64))
    return float(torch.log_softmax(logits, -1).gather(-1, targets[:, None]).sum())


def test_a_step_raises_the_log_prob_of_positive_advantage_responses(tiny):
    trainer = TorchTrainer(config(tiny, lr=3e-3))
    batch = make_batch(4, num_groups=1, group_size=2)
    good, bad = batch.groups[0].samples
    good.reward, bad.reward = 1.0, 0.0
    good.set_loss_mask(1)
    bad.set_loss_mask(1)
    before = _response_logprob(trainer, good), _response_logprob(trainer, bad)
    result = trainer.train_step(batch)
    assert _response_logprob(trainer, good) > before[0]
    assert _response_logprob(trainer, bad) < before[1]
    expected = set(
        "loss pg_loss clip_frac entropy grad_norm lr num_tokens tokens tokens_per_s "
        "staleness/mean staleness/max reward/mean time/step".split()
    )
    assert expected <= result.metrics.keys()
    assert all(math.isfinite(v) for v in result.metrics.values())
    assert result.version == 1 and result.num_samples == 2
    assert result.num_tokens == good.response_length + bad.response_length


def test_each_term_of_dict_rewards_is_reported_beside_the_trained_reward(tiny):
    metrics = TorchTrainer(config(tiny)).train_step(make_batch()).metrics
    assert metrics["reward/format"] == 1.0  # the odd samples' {"score": x, "format": 1.0}
    assert "reward/score" not in metrics and 0 < metrics["reward/mean"] < 1


def test_response_length_and_the_truncated_share_are_reported(tiny):
    truncated = {(0, 1): SampleStatus.TRUNCATED, (2, 3): SampleStatus.TRUNCATED}
    batch = make_batch(statuses=truncated)
    metrics = TorchTrainer(config(tiny)).train_step(batch).metrics
    assert metrics["response/truncated"] == pytest.approx(2 / 12)
    rows = rollout_tensors(batch)
    assert metrics["response_len/mean"] == pytest.approx(float(rows.mask.sum(dim=1).mean()))


def test_staleness_counts_versions_behind_over_loss_tokens(tiny):
    trainer = TorchTrainer(config(tiny))
    trainer.train_step(make_batch(0, version=0))
    trainer.train_step(make_batch(1, version=0))
    result = trainer.train_step(make_batch(2, version=1))  # trainer at version 2
    assert result.metrics["staleness/mean"] == result.metrics["staleness/max"] == 1.0


def test_groups_with_unusable_samples_are_dropped_and_counted(tiny):
    trainer = TorchTrainer(config(tiny))
    batch = make_batch(statuses={(1, 2): SampleStatus.FAILED})
    result = trainer.train_step(batch)
    assert result.metrics["batch/dropped_groups"] == 1.0
    kept = [s for g in (0, 2) for s in batch.groups[g].samples if s.loss_mask.any()]
    assert result.num_samples == len(kept)
    assert result.num_tokens == sum(int(s.loss_mask.sum()) for s in kept)
    every = {(g, 0): SampleStatus.ABORTED for g in range(3)}
    with pytest.raises(ValueError, match="no trainable group"):
        trainer.train_step(make_batch(statuses=every))


def count_forwards(model: torch.nn.Module) -> list[int]:
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("correction", ["decoupled", "tis"])
def test_the_old_log_probs_come_from_the_training_forward_without_a_second_pass(tiny, correction):
    # A version-stale batch (behaviour ~ -4 against the model's ~ -6): the correction's
    # weights and the clipped ratio both read the old log-probs.
    algo = PolicyConfig(off_policy_correction=correction, eps_clip=0.1)
    fused = TorchTrainer(config(tiny, max_tokens_per_microbatch=24), algo)
    scored = TorchTrainer(config(tiny, max_tokens_per_microbatch=24), algo)
    scored.score_old_logprobs = True  # the separate no-grad forward, as with a reference
    calls = [count_forwards(t.policy.model) for t in (fused, scored)]
    grads = [capture_grads(t.policy) for t in (fused, scored)]
    for step in range(2):  # the second step trains on weights the first one moved
        batch = make_batch(seed=step, version=step)
        a, b = fused.train_step(batch), scored.train_step(batch)
        for key in ("loss", "pg_loss", "grad_norm", "mismatch_kl", "is_weight", "ratio"):
            assert a.metrics[key] == pytest.approx(b.metrics[key], rel=1e-5, abs=1e-6), key
        assert_close(grads[0], grads[1], atol=1e-6)
    assert_close(params(fused), params(scored), atol=1e-6)
    batches = [rollout_tensors(make_batch(seed=k, version=k), "score") for k in range(2)]
    micro_batches = sum(len(fused._microbatches(rows)) for rows in batches)
    assert micro_batches > 2 and calls[0][0] == micro_batches  # one forward each
    assert calls[1][0] == 2 * micro_batches


def test_ppo_with_a_reference_model_reports_value_and_kl_metrics(tiny):
    algo = PolicyConfig(advantage_estimator="ppo", kl_coef=0.05)
    trainer = TorchTrainer(config(tiny), algo)
    result = trainer.train_step(make_batch())
    for key in ("value_loss", "values", "critic/grad_norm", "kl"):
        assert math.isfinite(result.metrics[key]), key
    assert result.metrics["values"] == 0.0  # a fresh value head predicts 0


def test_use_rollout_logprobs_takes_the_engine_log_probs_as_the_old_policy(tiny):
    algo = PolicyConfig(use_rollout_logprobs=True)
    result = TorchTrainer(config(tiny), algo).train_step(make_batch())
    # behaviour log-probs are ~ -4 and the tiny model's ~ -6: the ratio is far from 1
    assert abs(result.metrics["ratio"] - 1.0) > 0.01


def test_sft_steps_lower_the_loss_on_the_masked_tokens(tiny):
    trainer = TorchTrainer(config(tiny, lr=1e-2))
    tokens = [np.arange(3, 20), np.arange(40, 52)]
    masks = [np.r_[np.zeros(6), np.ones(11)], np.r_[np.zeros(4), np.ones(8)]]
    losses = [trainer.sft_step(tokens, masks).metrics["loss"] for _ in range(3)]
    assert losses[2] < losses[0]
    assert trainer.version == 3


@torch.no_grad()
def _target_probs(trainer: TorchTrainer, tokens: np.ndarray) -> torch.Tensor:
    logits = trainer.policy.wrapped(torch.as_tensor(tokens)[None]).logits[0, :-1]
    return torch.softmax(logits.float(), -1).gather(-1, torch.as_tensor(tokens[1:, None]))


def test_label_smoothing_keeps_mass_off_the_target(tiny):
    """Fitting one sequence: plain NLL drives p(target) to 1, smoothing holds it near 1 - eps."""
    tokens, masks = [np.arange(3, 20)], [np.ones(17)]
    plain, smooth = TorchTrainer(config(tiny, lr=1e-2)), TorchTrainer(config(tiny, lr=1e-2))
    for _ in range(60):
        plain.sft_step(tokens, masks)
        smooth.sft_step(tokens, masks, label_smoothing=0.3)
    assert _target_probs(plain, tokens[0]).min() > 0.95
    p = _target_probs(smooth, tokens[0])
    assert 0.55 < p.min() and p.max() < 0.85  # optimum: 1 - 0.3 + 0.3 / V ~= 0.70


def test_configs_that_cannot_work_are_refused(tiny):
    with pytest.raises(ValueError, match="total_steps"):
        config(tiny, lr_schedule="cosine", warmup_steps=5, total_steps=5)
    with pytest.raises(ValueError, match="only ppo uses a critic"):
        TorchTrainer(config(tiny, critic=True))


# ------------------------------------------------------------------ precision and attention


def test_bf16_mixed_keeps_fp32_weights_and_optimizer_state_and_trains_close_to_fp32(tiny):
    fp32 = TorchTrainer(config(tiny)).train_step(make_batch(5))
    mixed = TorchTrainer(config(tiny, dtype="bf16-mixed"))
    result = mixed.train_step(make_batch(5))
    assert abs(result.metrics["loss"] - fp32.metrics["loss"]) < 2e-2
    assert abs(result.metrics["grad_norm"] / fp32.metrics["grad_norm"] - 1) < 5e-2
    assert {p.dtype for p in mixed.policy.model.parameters()} == {torch.float32}
    state = mixed.policy.optimizer.state
    assert {s["exp_avg"].dtype for s in state.values()} == {torch.float32}
    pure = TorchTrainer(config(tiny, dtype="bfloat16"))
    assert {p.dtype for p in pure.policy.model.parameters()} == {torch.bfloat16}


def test_packed_rows_attend_per_sequence_by_default_with_sdpas_results(tiny):
    from asyncrl.trainers.packed_attention import ATTENTION

    packed = TorchTrainer(config(tiny))
    masked = TorchTrainer(config(tiny, attn_implementation="sdpa"))
    assert packed.attn == ATTENTION and masked.attn == "sdpa"
    rows = rollout_tensors(make_batch(6), "score")
    mb = packed._microbatches(rows)[0]
    assert mb.attention_mask is None and mb.segments is not None and len(mb.segments) > 1
    grads = [capture_grads(t.policy) for t in (packed, masked)]
    a, b = packed.train_step(make_batch(6)), masked.train_step(make_batch(6))
    for key in ("loss", "grad_norm", "entropy"):
        assert a.metrics[key] == pytest.approx(b.metrics[key], rel=1e-5, abs=1e-6), key
    assert_close(grads[0], grads[1], atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bf16-mixed"])
def test_a_groups_prompt_packed_once_trains_as_packed_per_sample(tiny, dtype):
    """``share_prompts`` (the default) packs each group's prompt once: fewer tokens, the
    same step (fp32 to 1e-5; bf16 matmuls of other shapes round differently)."""
    shared = TorchTrainer(config(tiny, dtype=dtype))
    whole = TorchTrainer(config(tiny, dtype=dtype, share_prompts=False))
    rows = rollout_tensors(make_batch(6), "score")
    a_mbs, b_mbs = shared._microbatches(rows), whole._microbatches(rows)
    assert all(isinstance(s, tuple) for mb in a_mbs for s in mb.segments or ())
    assert sum(mb.input_ids.shape[1] for mb in a_mbs) < sum(mb.input_ids.shape[1] for mb in b_mbs)
    grads = [capture_grads(t.policy) for t in (shared, whole)]
    tol = {"rel": 1e-5, "abs": 1e-6} if dtype == "float32" else {"rel": 2e-2, "abs": 1e-3}
    a, b = shared.train_step(make_batch(6)), whole.train_step(make_batch(6))
    for key in ("loss", "grad_norm", "entropy"):
        assert a.metrics[key] == pytest.approx(b.metrics[key], **tol), key
    assert_close(grads[0], grads[1], atol=1e-6 if dtype == "float32" else 5e-3)


@pytest.mark.parametrize("rotated", [False, True])
def test_packed_attention_of_bf16_on_the_cpu_attends_in_fp32_under_autocast(rotated):
    """bf16 inputs are attended in fp32 (faster there, and exact to fp32), cast back to
    the values' dtype. ``rotated``: as under autocast, the rotary embedding has promoted
    the queries and keys to fp32."""
    import torch.nn.functional as F

    from asyncrl.trainers.packed_attention import packed_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 12, 8, generator=g).bfloat16() for h in (4, 2, 2))
    module = torch.nn.Module()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        qk = (q.float(), k.float()) if rotated else (q, k)
        out, _ = packed_attention(module, *qk, v, None, packed_segments=(5, 7))
    assert out.dtype == torch.bfloat16 and out.shape == (1, 12, 4, 8)
    kk, vv = (x.float().repeat_interleave(2, dim=1) for x in (k, v))
    want = torch.cat([
        F.scaled_dot_product_attention(a, b, c, is_causal=True)
        for a, b, c in zip(*(x.split([5, 7], dim=2) for x in (q.float(), kk, vv)), strict=True)
    ], dim=2)  # fmt: skip
    assert torch.equal(out, want.bfloat16().transpose(1, 2))


def test_a_non_finite_step_is_skipped_and_non_finite_weights_are_never_saved(tiny, tmp_path):
    """A reward of 1e308 makes the advantages, the loss and the gradient non-finite: the
    step raises ``NonFiniteStep`` with the weights, optimizer and version untouched."""
    trainer = TorchTrainer(config(tiny))
    trainer.train_step(make_batch(0))
    before, state = params(trainer), trainer.policy.optimizer.state_dict()
    huge = make_batch(1, version=1)
    for group in huge.groups:
        for i, sample in enumerate(group.samples):
            sample.reward = 1e308 if i % 2 else -1e308
    with pytest.raises(NonFiniteStep, match="gradient norm is nan"):
        trainer.train_step(huge)
    assert trainer.version == 1
    assert_close(params(trainer), before, atol=0)
    assert trainer.policy.optimizer.state_dict()["state"].keys() == state["state"].keys()
    trainer.train_step(make_batch(2, version=1))  # the next good batch trains
    assert trainer.version == 2

    trainer.save_checkpoint(tmp_path / "good")
    with torch.no_grad():
        next(trainer.policy.model.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteTraining, match="holds NaN or infinite values"):
        trainer.save_checkpoint(tmp_path / "bad")
    assert not (tmp_path / "bad" / "policy" / "model.safetensors").exists()
    # A checkpoint damaged on disk the same way is refused at load, naming the tensor.
    weights = tmp_path / "good" / "policy" / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(iter(tensors))
    tensors[name][..., 0] = float("inf")
    save_file(tensors, str(weights))
    with pytest.raises(CheckpointUnreadable, match=f"weight {re.escape(name)} holds NaN"):
        TorchTrainer(config(tiny)).load_checkpoint(tmp_path / "good")


def test_a_non_finite_mini_batch_skips_its_update_and_the_others_stand(tiny):
    """Three mini-batches of one group each; the middle group's rewards of +-1e308 make
    its update non-finite: that update moves nothing, the other two train and count."""
    trainer = TorchTrainer(config(tiny, global_batch_size=4, shuffle_minibatches=False))
    before = params(trainer)
    batch = make_batch(0)
    for i, sample in enumerate(batch.groups[1].samples):
        sample.reward = 1e308 if i % 2 else -1e308
    result = trainer.train_step(batch)
    assert trainer.version == 1
    assert result.metrics["optim_steps"] == 3 and result.metrics["nonfinite_updates"] == 1
    assert np.isfinite(result.metrics["grad_norm"]) and np.isfinite(result.metrics["loss"])
    after = params(trainer)
    assert all(torch.isfinite(p).all() for p in after.values())
    assert any(not torch.equal(after[k], before[k]) for k in before)


def test_learners_step_together_or_not_at_all(tiny):
    """A NaN in the critic's gradient leaves the policy unstepped too, and clears both
    learners' gradients, so the next batch's do not pile onto these."""
    trainer = TorchTrainer(config(tiny), PolicyConfig(advantage_estimator="ppo"))
    assert trainer.critic is not None
    policy, critic = trainer.policy, trainer.critic
    before = params(trainer)
    for learner, value in ((policy, 1.0), (critic, float("nan"))):
        for p in learner.parameters():
            p.grad = torch.full_like(p, value)
    with pytest.raises(NonFiniteStep, match="gradient norm is nan"):
        step_together([policy, critic], grad_clip=1.0)
    assert all(p.grad is None for learner in (policy, critic) for p in learner.parameters())
    assert_close(params(trainer), before, atol=0)
    assert policy.optimizer.state_dict()["state"] == {}  # AdamW never stepped
