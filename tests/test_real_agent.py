"""Agents on the real model: SmolLM2-135M-Instruct with the tool agent's chat template
(``examples/tool_agent/``).

- A 2-step ``asyncrl train`` of the tool agent example: multi-turn episodes with the real
  calculator and Python sandbox, trained, every prompt accounted for.
- A streaming ``openai``-client agent through the proxy, on the real engine: the trained
  sequence is exactly the rendered first call, the tokens the engine generated and the
  template's rendering of what the tools returned, with no re-rendering between.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from asyncrl.buffer.dump import batch_files, read_batch
from asyncrl.config import load_config
from asyncrl.job import run_job
from asyncrl.rollout.agent_workflow import AgentWorkflow
from asyncrl.rollout.base import RolloutContext
from asyncrl.rollout.openai_proxy import AgentTask, Session
from asyncrl.rollout.tools.calculator import calculator
from asyncrl.types import Sample, SampleStatus
from tests.test_openai_proxy import Recording
from tests.test_train import accounted, last_buffer_metrics

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tool_agent"


def example_module(name: str) -> Any:
    """``examples/tool_agent/<name>.py`` (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"tool_agent_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool_model(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model's folder with the example's tool chat template (weights linked)."""
    base = tmp_path_factory.mktemp("tool-model") / "base"
    example_module("make_model").make_base(smollm2_dir, base)
    return base


async def test_two_steps_of_the_tool_agent_example_on_the_real_model(tool_model, tmp_path,
                                                                      monkeypatch):  # fmt: skip
    monkeypatch.chdir(ROOT)  # the example's data paths are relative to the repository
    run, dump = tmp_path / "run", tmp_path / "dump"
    flags = [
        "--hf-checkpoint", str(tool_model), "--rollout.engine.model-path", str(tool_model),
        "--output-dir", str(run), "--train.num-steps", "2", "--save-interval", "2",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--buffer.filters", "[]",
        "--rollout.sampling", '{"temperature": 0.7, "max_new_tokens": 96}',
        "--rollout.tool-use.max-tokens-per-turn", "40", "--eval-interval", "0",
        "--eval.sets", "[]",
        "--save-debug-rollout-data", str(dump),
    ]  # fmt: skip
    cfg = load_config(str(EXAMPLE / "config.yaml"), overrides=flags)
    result = await run_job(cfg)
    assert result.ok and result.steps == 2, result.error
    assert accounted(last_buffer_metrics(run))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("actor") == "trainer"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["mismatch_kl"] < 1e-3 and r["agent/turns"] >= 1 for r in steps), steps
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    samples = [s for p in batch_files(dump) for g in read_batch(p).groups for s in g.samples]
    assert len(samples) == 8
    for s in samples:
        prompt = tokenizer.decode(s.prompt_tokens.tolist())
        assert "- calculator(expression):" in prompt and "- python(code):" in prompt
        assert s.status in ("completed", "truncated") and "tool_calls" in s.metadata
        tool = [t for t in s.spans if t.role == "tool"]
        assert not any(s.loss_mask[t.start : t.end].any() for t in tool)


async def streaming_agent(session: Session, task: AgentTask) -> str:
    """The example agent's streaming loop for two calls: whatever the first reply says,
    the calculator's result for the task's expression goes back as a tool message."""
    gather = example_module("agent").gather
    tools = example_module("agent").registry().schemas()
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
    async with session.client(max_retries=0) as client:
        for _ in range(2):
            stream = await client.chat.completions.create(
                model=session.model, messages=messages, tools=tools, tool_choice="auto",
                stream=True, max_tokens=24,
            )  # fmt: skip
            messages.append(await gather(stream))
            result = calculator(str(task.metadata["expression"]))
            messages.append({"role": "tool", "tool_call_id": "x", "content": result})
    return str(messages[-2].get("content") or "")


async def score(sample: Sample) -> float:
    return 0.0


async def test_a_streaming_openai_agent_trains_exactly_the_engines_tokens_and_the_tools_text(
    tool_model,
):
    from asyncrl.engines.client.sglang import SGLangClient
    from asyncrl.engines.server.app import EngineServer
    from asyncrl.engines.torch.engine import TorchEngine

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    engine = TorchEngine.from_pretrained(str(tool_model))
    server = EngineServer(engine)
    url = await server.start("127.0.0.1", 0)
    question = "What is 347*29 + 512*18?"
    task = Sample(uid="g/0", group_id="g", prompt=question, label="19279",
                  metadata={"expression": "347*29 + 512*18"})  # fmt: skip
    try:
        async with SGLangClient(url) as client:
            recording = Recording(client)
            sampling = {"max_new_tokens": 400, "temperature": 0.7}
            ctx = RolloutContext(recording, score, sampling, tokenizer=tokenizer)
            workflow = AgentWorkflow(streaming_agent)
            async with workflow.resources(ctx):
                sample = await workflow(ctx, task)
    finally:
        await server.stop()
    assert sample.status is SampleStatus.COMPLETED, sample.error
    tools = example_module("agent").registry().schemas()
    first = tokenizer.apply_chat_template([{"role": "user", "content": question}], tools=tools,
                                          add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert sample.prompt_tokens.tolist() == tokenizer(first, add_special_tokens=False)["input_ids"]
    # Between the engine's outputs, only the template's rendering of the tool message.
    one, two = (r.output_ids for r in recording.results)
    closed = one[-1] == tokenizer.eos_token_id
    text = ("" if closed else "<|im_end|>") + "\n<|im_start|>tool\n19279<|im_end|>\n"
    observation = tokenizer(text + "<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert sample.response_tokens.tolist() == one + observation + two
    assert sample.loss_mask.tolist() == [1] * len(one) + [0] * len(observation) + [1] * len(two)
    lps = [lp for r in recording.results for lp in r.logprobs]
    np.testing.assert_allclose(sample.logprobs[sample.loss_mask == 1], lps, rtol=1e-6)
