"""MegatronTrainer (asyncrl/trainers/megatron_trainer.py): real megatron-core 0.16.1 on CPU
(gloo; the test-only shim in megatron_shim.py), against the torch trainer on the same
tiny Qwen2 and batch (TP=2, PP=2 and DP=2 against one rank: tests/test_trainer_ranks.py)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from asyncrl.policies import PolicyConfig
from asyncrl.trainers.base import StepResult, Trainer
from asyncrl.trainers.torch_trainer import TorchTrainer
from tests.megatron_shim import cpu_megatron
from tests.test_torch_trainer import capture_grads, make_batch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

#: KL against a different reference model, an entropy bonus and two clip ranges: every
#: term of the loss and both no-grad passes (old and reference log-probs) are exercised.
ALGO = PolicyConfig(
    use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01, eps_clip=0.1, eps_clip_high=0.2
)


@pytest.fixture
def cpu() -> Iterator[None]:
    """The shim for a test; the one-rank group the trainers make is torn down after."""
    from megatron.core import parallel_state

    with warnings.catch_warnings(), cpu_megatron():
        warnings.simplefilter("ignore")
        yield
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def config(path: Path, backend: str = "megatron", **overrides: Any) -> TorchTrainer.Config:
    values = {"model_path": str(path), "lr": 1e-3, "max_tokens_per_microbatch": 40}
    return TorchTrainer.Config(**(values | {"backend": backend} | overrides))


def megatron(path: Path, algo: PolicyConfig = ALGO, **overrides: Any) -> Any:
    from asyncrl.trainers.megatron_trainer import MegatronTrainer

    return MegatronTrainer(config(path, **overrides), algo)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def same_step(a: StepResult, b: StepResult, keys: tuple[str, ...], atol: float = 1e-5) -> None:
    for key in keys:
        assert abs(a.metrics[key] - b.metrics[key]) < atol, (key, a.metrics[key], b.metrics[key])


# ----------------------------------------------------------------- against the torch trainer

LOSS_TERMS = ("loss", "pg_loss", "kl_loss", "kl", "entropy", "grad_norm", "clip_frac",
              "is_weight", "mismatch_kl", "num_tokens")  # fmt: skip


def test_the_megatron_trainer_satisfies_the_trainer_protocol(cpu, tiny_dir):
    trainer = megatron(tiny_dir)
    assert isinstance(trainer, Trainer) and trainer.version == 0
    assert trainer.layout == {"tp": 1, "pp": 1, "dp": 1}


def megatron_grads(trainer: Any) -> dict[str, torch.Tensor]:
    """The gradients of the last step under HF names (megatron keeps them in ``main_grad``)."""
    from asyncrl.trainers.megatron_bridge import megatron_to_hf

    grads = {k: p.main_grad for k, p in trainer.gpt.named_parameters()}
    return megatron_to_hf(trainer.hf, grads)


# adam_eps=1e-5: Adam's first step moves each weight by lr * g / (|g| + eps), whatever the
# size of g. Some gradients are (nearly) 0: a key bias shifts every score of a query
# alike, which softmax ignores, so its true gradient is 0. There both trainers hold
# round-off (1e-8 .. 5e-8 apart, measured), and at eps=1e-8 the first step turns that
# into up to 4% of a full step (3.9e-5 at lr 1e-3), differently in each trainer. The
# gradients themselves are compared directly, at the default eps.
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_loss_and_first_update_equal_the_torch_trainers(cpu, tiny_dir, ref_dir, packing: bool):
    common = {"ref_model_path": str(ref_dir), "packing": packing, "adam_eps": 1e-5}
    torch_trainer = TorchTrainer(config(tiny_dir, "torch", **common), ALGO)
    mega = megatron(tiny_dir, **common)
    assert max_diff(mega.export_weights(), torch_trainer.export_weights()) == 0.0
    grads = capture_grads(torch_trainer.policy)
    want, got = torch_trainer.train_step(make_batch()), mega.train_step(make_batch())
    same_step(want, got, LOSS_TERMS)
    assert max_diff(megatron_grads(mega), grads) < 1e-6
    assert want.metrics["kl"] > 0.01  # the reference model differs: the KL term is live
    assert got.version == 1 and got.num_samples == want.num_samples
    assert max_diff(mega.export_weights(), torch_trainer.export_weights()) < 1e-5
    # A second step: the old log-probs now come from the updated weights.
    same_step(torch_trainer.train_step(make_batch(1)), mega.train_step(make_batch(1)), LOSS_TERMS)


def test_mini_batches_and_epochs_equal_the_torch_trainers(cpu, tiny_dir):
    """Two mini-batches of whole groups a pass, two passes, the groups shuffled: each
    update of both trainers on the same rows, so the same weights after the step; one
    version, four updates (the LR schedule and Adam count updates)."""
    mini = {"global_batch_size": 4, "ppo_epochs": 2, "adam_eps": 1e-5}
    torch_trainer = TorchTrainer(config(tiny_dir, "torch", **mini), ALGO)
    mega = megatron(tiny_dir, **mini)
    want, got = torch_trainer.train_step(make_batch()), mega.train_step(make_batch())
    assert got.metrics["optim_steps"] == want.metrics["optim_steps"] == 6  # 3 groups x 2
    assert mega.version == 1 and mega.updates == 6
    same_step(want, got, ("loss", "pg_loss", "grad_norm", "num_tokens"))
    assert max_diff(mega.export_weights(), torch_trainer.export_weights()) < 1e-5


def test_micro_batch_splitting_does_not_change_the_step(cpu, tiny_dir):
    one = megatron(tiny_dir, max_tokens_per_microbatch=10_000).train_step(make_batch(2))
    many = megatron(tiny_dir, max_tokens_per_microbatch=16).train_step(make_batch(2))
    same_step(one, many, ("loss", "grad_norm", "entropy"), atol=1e-6)


def test_an_sft_step_equals_the_torch_trainers(cpu, tiny_dir):
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = [rng.integers(3, 500, int(n)) for n in rng.integers(4, 12, 6)]
    masks = [(np.arange(len(t)) >= 2).astype(np.uint8) for t in tokens]
    torch_trainer = TorchTrainer(config(tiny_dir, "torch", adam_eps=1e-5))  # eps: see above
    mega = megatron(tiny_dir, PolicyConfig(), adam_eps=1e-5)
    grads = capture_grads(torch_trainer.policy)
    want = torch_trainer.sft_step(tokens, masks, label_smoothing=0.1)
    got = mega.sft_step(tokens, masks, label_smoothing=0.1)
    same_step(want, got, ("loss", "grad_norm"))
    assert max_diff(megatron_grads(mega), grads) < 1e-6
    assert max_diff(mega.export_weights(), torch_trainer.export_weights()) < 1e-5


def test_activation_recompute_trades_memory_not_gradients(cpu, tiny_dir):
    plain = megatron(tiny_dir).train_step(make_batch(3))
    recomputed = megatron(tiny_dir, gradient_checkpointing=True).train_step(make_batch(3))
    same_step(plain, recomputed, ("loss", "grad_norm"), atol=1e-6)


def test_bf16_trains_close_to_fp32(cpu, tiny_dir):
    fp32 = megatron(tiny_dir).train_step(make_batch(4))
    bf16 = megatron(tiny_dir, dtype="bf16-mixed")
    result = bf16.train_step(make_batch(4))
    assert abs(result.metrics["loss"] - fp32.metrics["loss"]) < 2e-2
    assert abs(result.metrics["grad_norm"] / fp32.metrics["grad_norm"] - 1) < 5e-2
    assert {v.dtype for v in bf16.export_weights().values()} == {torch.bfloat16}


# ------------------------------------------------------------------- weights and checkpoints


def test_save_hf_reloads_with_the_exported_weights(cpu, tiny_dir, tmp_path):
    trainer = megatron(tiny_dir)
    trainer.train_step(make_batch())
    trainer.save_hf(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    exported = trainer.export_weights()
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in exported.items())
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


@pytest.mark.parametrize("updates", [1, 2], ids=["one-update", "two-mini-batches"])
def test_a_checkpoint_resumes_bit_exactly(cpu, tiny_dir, ref_dir, tmp_path, updates: int):
    """With two updates a version, the LR schedule and Adam's step count resume at the
    update count, not the version."""
    mini = {"global_batch_size": 8} if updates == 2 else {}
    settings = {"ref_model_path": str(ref_dir), "lr_schedule": "cosine", "total_steps": 8, **mini}
    trainer = megatron(tiny_dir, **settings)
    trainer.train_step(make_batch(0, num_groups=4, group_size=4))
    trainer.save_checkpoint(tmp_path / "ckpt")
    want = trainer.train_step(make_batch(1))
    resumed = megatron(tiny_dir, **settings)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.version == 1 and resumed.updates == updates
    got = resumed.train_step(make_batch(1))
    assert got.version == want.version == 2
    assert got.metrics["loss"] == want.metrics["loss"] and got.metrics["lr"] == want.metrics["lr"]
    assert max_diff(resumed.export_weights(), trainer.export_weights()) == 0.0


def test_a_resume_trains_with_this_runs_lr_and_betas(cpu, tiny_dir, tmp_path):
    """The optimizer's checkpoint carries its betas, eps and weight decay; a resume with
    other ones (and another ``--lr``) trains with them, Adam's moments kept."""
    trainer = megatron(tiny_dir)
    trainer.train_step(make_batch(0))
    trainer.save_checkpoint(tmp_path / "ckpt")
    new = {"lr": 3e-3, "betas": (0.8, 0.95), "adam_eps": 1e-6, "weight_decay": 0.05}
    resumed = megatron(tiny_dir, **new)
    before = [dict(g) for g in resumed.optimizer.param_groups]
    resumed.load_checkpoint(tmp_path / "ckpt")
    for group, fresh in zip(resumed.optimizer.param_groups, before, strict=True):
        assert group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6
        assert group["weight_decay"] == fresh["weight_decay"]  # each group's as built
    assert {g["weight_decay"] for g in before} == {0.05}  # the checkpoint's: 0.0
    moments = [s["exp_avg"] for s in _adam_states(resumed.optimizer)]
    assert moments and all(m.abs().sum() > 0 for m in moments)  # the saved moments
    assert resumed.train_step(make_batch(1)).metrics["lr"] == pytest.approx(3e-3)


def _adam_states(optimizer) -> list[dict]:
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [s for c in chained for s in c.optimizer.state.values() if "exp_avg" in s]


def test_a_checkpoint_before_the_first_step_resumes_fresh(cpu, tiny_dir, tmp_path):
    trainer = megatron(tiny_dir)
    trainer.save_checkpoint(tmp_path / "ckpt")  # Adam has no state yet
    want = trainer.train_step(make_batch())
    first = trainer.export_weights()
    resumed = megatron(tiny_dir)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.train_step(make_batch()).metrics["loss"] == want.metrics["loss"]
    assert max_diff(resumed.export_weights(), first) == 0.0
    # Back to version 0 in a trainer that has stepped: a fresh Adam, the same first step.
    trainer.train_step(make_batch(1))
    trainer.load_checkpoint(tmp_path / "ckpt")
    assert trainer.version == 0
    trainer.train_step(make_batch())
    assert max_diff(trainer.export_weights(), first) == 0.0


def test_a_checkpoint_of_another_tp_pp_split_is_refused_by_name(cpu, tiny_dir, tmp_path):
    trainer = megatron(tiny_dir)
    trainer.train_step(make_batch())
    trainer.save_checkpoint(tmp_path / "ckpt")
    state = json.loads((tmp_path / "ckpt" / "trainer.json").read_text())
    state["layout"] = {"tp": 2, "pp": 1, "dp": 1}
    (tmp_path / "ckpt" / "trainer.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"saved with TP 2 x PP 1, this trainer is TP 1 x PP 1"):
        trainer.load_checkpoint(tmp_path / "ckpt")


def test_an_unreadable_checkpoint_is_refused_by_path(cpu, tiny_dir, tmp_path):
    trainer = megatron(tiny_dir)
    trainer.train_step(make_batch())
    trainer.save_checkpoint(tmp_path / "ckpt")
    for shard in (tmp_path / "ckpt" / "megatron").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match="unreadable"):
        megatron(tiny_dir).load_checkpoint(tmp_path / "ckpt")


def test_bad_settings_are_refused_by_name(cpu, tiny_dir):
    from asyncrl.trainers.megatron_trainer import MegatronTrainer

    with pytest.raises(ValueError, match="needs a critic"):
        MegatronTrainer(config(tiny_dir), PolicyConfig(advantage_estimator="ppo"))
    with pytest.raises(ValueError, match="does not use parallel"):
        config(tiny_dir, parallel="fsdp")
    with pytest.raises(ValueError, match="float16's dynamic loss scale skips steps"):
        config(tiny_dir, dtype="float16")
    with pytest.raises(ValueError, match=r"trainer\.num_ranks=1 is not a multiple of TP 2"):
        megatron(tiny_dir, megatron={"tensor_parallel": 2})


def test_without_a_gpu_or_the_shim_the_trainer_says_what_it_needs(tiny_dir):
    with pytest.raises(ValueError, match="megatron-core calls CUDA"):
        megatron(tiny_dir)


# TP=2, PP=2 and DP=2 (2 processes) against one rank: tests/test_trainer_ranks.py.


# ------------------------------------------------------- asyncrl train --train-backend megatron

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
async def test_the_arith_example_trains_on_the_megatron_backend(tmp_path, monkeypatch):
    """The arith example, shortened and synchronous (eta 0), its trainer as 2 ranks of a
    2-stage pipeline: the trainer actor (rank 0) and its follower get the CPU shim through
    ``tests/megatron_site``; every other process runs as is. (One rank in the actor is the
    same code path with a one-rank group.)"""
    from asyncrl.config import load_config
    from asyncrl.job import run_job
    from tests.test_train import accounted, last_buffer_metrics

    monkeypatch.chdir(ROOT)  # the config's paths are relative to the repository root
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests" / "megatron_site"))
    monkeypatch.setenv("ASYNCRL_TEST_MEGATRON_CPU", "1")
    test = json.dumps([{"name": "test", "path": "examples/arith/data/test.jsonl@[0:16]",
                        "n_samples": 1, "pass_k": [1]}])  # fmt: skip
    flags = [
        "--train-backend", "megatron", "--output-dir", str(tmp_path / "run"),
        "--train.num-steps", "4", "--save-interval", "2", "--rollout-batch-size", "2",
        "--max-tokens-per-gpu", "128",  # a few micro-batches through the pipeline a step
        "--buffer.max-staleness", "0", "--eval-interval", "4", "--eval.sets", test,
        "--trainer-num-ranks", "2", "--pipeline-model-parallel-size", "2",
        # below 1 and truncated: the trainer must score at the sample's temperature
        "--rollout.sampling", '{"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 64}',
    ]  # fmt: skip
    result = await run_job(load_config("examples/arith/config.yaml", overrides=flags))
    assert result.ok and result.steps == 4, result.error
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("actor") == "trainer"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # Synchronous: every token was sampled by the engine at the trainer's version, so each
    # published version reached it; and megatron's log-probs of those tokens are the HF
    # engine's (the KL between them is round-off, not a version apart).
    assert all(r["staleness/max"] == 0 and r["mismatch_kl"] < 1e-4 for r in rows), rows
    assert accounted(last_buffer_metrics(run))
    for step in ("step_000002", "step_000004"):
        ckpt = run / "checkpoints" / "trainer" / step
        assert (ckpt / "megatron" / "metadata.json").is_file()
        assert json.loads((ckpt / "trainer.json").read_text())["config"]["backend"] == "megatron"
    evals = [json.loads(x) for x in (run / "metrics" / "eval.jsonl").read_text().splitlines()]
    # The eval actor takes the newest version when it is ready (0 or 1 at first), and the
    # final one: the megatron trainer's published weights load into its engine.
    versions = [r["version"] for r in evals]
    assert versions[-1] == 4 and versions == sorted(set(versions)), versions
    assert all(r["failed"] == 0 and r["samples"] == 16 for r in evals)


_WRITER = """
import multiprocessing as mp, os, sys, time
from megatron.core.dist_checkpointing.strategies import filesystem_async
from asyncrl.trainers.megatron_writer import own_results_queue
own_results_queue()
queue = filesystem_async._get_write_results_queue()
queue.put("through")
assert queue.get() == "through"
print(*(p.pid for p in mp.active_children()), flush=True)
if sys.argv[1] == "exit":
    os._exit(0)  # as a follower rank ends
time.sleep(60)
"""


@pytest.mark.parametrize("end", ["exit", "sigkill"])
def test_megatrons_checkpoint_writer_leaves_no_process_behind(end: str):
    # megatron's writer starts a manager process at the first save and never stops it:
    # each follower rank and each killed trainer left one behind (280 MB each).
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", _WRITER, end], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    (manager,) = map(int, proc.stdout.readline().split())
    if end == "sigkill":
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{manager}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{manager}").exists(), f"the manager {manager} outlived its parent"
