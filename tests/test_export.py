"""Checkpoints a user can load: every trainer checkpoint's ``policy/`` is a complete HF
folder (weights, config, generation config, tokenizer and chat template, readable by
others) with the optimizer beside it, and ``asyncrl export`` copies the step asked for."""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.cli import main
from asyncrl.trainers.torch_trainer import TorchTrainer
from tests.test_torch_trainer import make_batch


@pytest.fixture(scope="module")
def run_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with checkpoints of steps 1 and 2 of a real trainer."""
    run = tmp_path_factory.mktemp("run")
    trainer = TorchTrainer(TorchTrainer.Config(model_path=str(tiny_dir), lr=1e-2))
    for step in (1, 2):
        trainer.train_step(make_batch(seed=step))
        trainer.save_checkpoint(run / "checkpoints" / "trainer" / f"step_{step:06d}")
    return run


def greedy(model_dir: Path, prompt: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_a_checkpoint_holds_a_complete_hf_policy_and_its_optimizer_beside_it(run_dir):
    ckpt = run_dir / "checkpoints" / "trainer" / "step_000002"
    policy = ckpt / "policy"
    names = {p.name for p in policy.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors"} <= names
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    assert not names & {"optimizer.pt", "scheduler.pt"}
    assert (ckpt / "optimizer" / "policy" / "optimizer.pt").is_file()
    for f in policy.iterdir():
        assert f.stat().st_mode & stat.S_IROTH, f"{f.name} is not readable by others"
    tokenizer = AutoTokenizer.from_pretrained(policy)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_export_copies_the_newest_policy_which_reproduces_the_trainers_generations(
    run_dir, tmp_path, capsys, tiny_dir
):
    out = tmp_path / "export"
    assert main(["export", str(run_dir), str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert not (out / "optimizer.pt").exists()
    prompt = [5, 9, 11, 40]
    trained = run_dir / "checkpoints" / "trainer" / "step_000002" / "policy"
    assert greedy(out, prompt) == greedy(trained, prompt)
    # The trained weights, not the initial ones.
    start = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    ours = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert any(not torch.equal(start[k], ours[k]) for k in start)
    older = tmp_path / "step1"
    assert main(["export", str(run_dir), str(older), "--step", "1"]) == 0
    w1 = AutoModelForCausalLM.from_pretrained(older).state_dict()
    assert any(not np.array_equal(w1[k].numpy(), ours[k].numpy()) for k in w1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{run}", "{tmp}/a", "--step", "7"], "no checkpoint of step 7; steps saved: [1, 2]"),
        (["{tmp}/missing", "{tmp}/b"], "no such run directory"),
        (["{tmp}", "{tmp}/c"], "no trainer checkpoint"),
        (["{run}", "{run}"], "is not an empty folder"),
        (["{run}", "{tmp}/d", "--adapter"], "no adapter folder (trained without --lora-rank?)"),
    ],
)
def test_export_refuses_what_it_cannot_do_and_says_why(run_dir, tmp_path, capsys, args, message):
    argv = [a.format(run=run_dir, tmp=tmp_path) for a in args]
    assert main(["export", *argv]) == 2
    assert message in capsys.readouterr().err
