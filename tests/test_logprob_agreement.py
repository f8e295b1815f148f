"""What the trainer computes for a sampled token is what the engine sampled it from.

The embedded engine samples at temperature 0.6 with top-p 0.9 and reports SGLang's
full-vocabulary ``log_softmax(z / T)``; the torch trainer, given the samples, recomputes
the same log-probs (per token within 1e-4) and its step's ``mismatch_kl`` is below 1e-4.
On the toy model and on the real SmolLM2-135M-Instruct with its chat template.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from asyncrl.engines.base import GenerateRequest, SamplingParams
from asyncrl.engines.torch.engine import TorchEngine
from asyncrl.policies import PolicyConfig
from asyncrl.trainers.rollout_tensors import rollout_tensors
from asyncrl.trainers.torch_trainer import TorchTrainer
from asyncrl.types import Group, Sample, SampleStatus, TrainBatch

SAMPLING = {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 24, "ignore_eos": True}


async def _generate(
    model_dir: Path, prompts: list[list[int]], n: int, device: str = "cpu"
) -> TrainBatch:
    engine = TorchEngine.from_pretrained(str(model_dir), device=device)
    task = asyncio.create_task(engine.run())
    try:
        groups = []
        for g, prompt in enumerate(prompts):
            samples = []
            for i in range(n):
                params = SamplingParams(**SAMPLING, sampling_seed=100 * g + i)
                request = GenerateRequest(rid=f"{g}-{i}", input_ids=prompt, sampling=params)
                out = [snapshot async for snapshot in engine.generate(request)][-1]
                s = Sample(uid=f"{g}/{i}", group_id=str(g), index=i,
                           packed_prompt=np.asarray(prompt, np.int32).tobytes())  # fmt: skip
                s.append_response(out.output_ids, out.logprobs, 0)
                s.temperature, s.reward = params.logprob_temperature, float(i % 2)
                s.status = SampleStatus.COMPLETED
                samples.append(s)
            groups.append(Group(uid=str(g), prompt_uid=str(g), samples=samples))
        return TrainBatch(batch_id=0, step=0, groups=groups)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _recomputed(trainer: TorchTrainer, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-probs of every response token and the engine's, over loss tokens."""
    rows = rollout_tensors(batch)
    mbs = trainer._microbatches(rows)
    scored = trainer._score(trainer.policy.model, mbs, (rows.num_rows + 1, rows.width))[:-1]
    mask = rows.mask.bool()
    return scored.cpu()[mask], rows.behaviour[mask]  # scored on the trainer's device


def _check(model_dir: Path, prompts: list[list[int]], n: int, device: str = "cpu") -> None:
    """Engine and trainer on ``device`` (tests/test_gpu.py runs it on a GPU)."""
    batch = asyncio.run(_generate(model_dir, prompts, n, device))
    cfg = TorchTrainer.Config(model_path=str(model_dir), lr=1e-6, device=device, dtype="float32")
    trainer = TorchTrainer(cfg, PolicyConfig(off_policy_correction="tis"))
    ours, engine = _recomputed(trainer, batch)
    assert ours.numel() == sum(s.response_length for g in batch.groups for s in g.samples)
    assert (ours - engine).abs().max() < 1e-4
    # At T = 1 the same tokens are scored under another distribution: not what was sampled.
    for s in (s for g in batch.groups for s in g.samples):
        s.temperature = 1.0
    at_one, _ = _recomputed(trainer, batch)
    assert (at_one - engine).abs().max() > 1e-2
    for s in (s for g in batch.groups for s in g.samples):
        s.temperature = SAMPLING["temperature"]
    assert trainer.train_step(batch).metrics["mismatch_kl"] < 1e-4


def test_the_toy_trainer_recomputes_the_engines_log_probs_at_t_0_6_top_p_0_9(tiny_dir):
    _check(tiny_dir, [[5, 9, 11], list(range(20, 40)), [300, 7]], n=2)


def test_the_real_model_trainer_recomputes_the_engines_log_probs(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    questions = ["What is 17 + 25?", "Name a prime number above 50.", "Spell 'cat' backwards."]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
        for q in questions
    ]  # fmt: skip
    _check(smollm2_dir, prompts, n=2)
