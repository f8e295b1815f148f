"""A real pretrained model end to end: SmolLM2-135M-Instruct (49k vocabulary, 30 layers,
chat template) trains two steps of the word-problems example through ``asyncrl train``
with chat-template prompts, an eval actor and checkpoints, and the exported checkpoint
loads with plain transformers, tokenizer and chat template included, and generates what
the engine generates from it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.engines.base import GenerateRequest, SamplingParams
from asyncrl.engines.torch.engine import TorchEngine
from asyncrl.job import run_job
from tests.test_train import accounted, last_buffer_metrics

ROOT = Path(__file__).resolve().parents[1]


async def engine_greedy(model_dir: Path, ids: list[int], n: int) -> list[int]:
    engine = TorchEngine.from_pretrained(str(model_dir))
    task = asyncio.create_task(engine.run())
    try:
        params = SamplingParams(temperature=0, max_new_tokens=n)
        request = GenerateRequest(rid="g", input_ids=ids, sampling=params)
        return [o async for o in engine.generate(request)][-1].output_ids
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_two_steps_with_chat_template_eval_and_export(smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the example's data paths are relative to the repository
    run = tmp_path / "run"
    test = json.dumps([{"name": "test", "path": "examples/word_problems/data/test.jsonl@[0:4]",
                        "n_samples": 1, "pass_k": [1]}])  # fmt: skip
    flags = [
        "--hf-checkpoint", str(smollm2_dir), "--output-dir", str(run),
        "--train.num-steps", "2", "--save-interval", "2", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--buffer.filters", "[]",
        "--rollout.sampling", '{"temperature": 0.7, "max_new_tokens": 12}',
        "--eval-interval", "2", "--eval.sets", test,
    ]  # fmt: skip
    cfg = load_config("examples/word_problems/config.yaml", overrides=flags)
    assert cfg.eval.sets[0].apply_chat_template  # inherited from the data
    result = await run_job(cfg)
    assert result.ok and result.steps == 2, result.error
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("actor") == "trainer"]
    assert [r["step"] for r in steps] == [1, 2]
    # Sampled at T 0.7 and trained at T 0.7: the recomputed log-probs are the engine's
    # (within a version of staleness 1, as the decoupled objective allows).
    assert all(r["mismatch_kl"] < 1e-3 for r in steps), steps
    assert accounted(last_buffer_metrics(run))
    evals = [json.loads(x) for x in (run / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["version"] == 2 and all(r["failed"] == 0 for r in evals)

    out = tmp_path / "export"
    assert main(["export", str(run), str(out)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert tokenizer.chat_template and len(tokenizer) == model.config.vocab_size
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    hf = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids) :]
    assert hf.tolist() == await engine_greedy(out, ids, 10)
