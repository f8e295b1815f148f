"""The tool-use examples run from their configs, shortened: the shipped checkpoint, the
real engine, tools, proxy and trainer, and the accounting whole at the end.

``examples/calculator_agent`` (multi-turn with ``rollout.tool_use``) and
``examples/openai_agent`` (the same task as an ``openai``-client agent through the proxy)
each train 2 steps of 4 groups x 4 samples and evaluate 12 held-out prompts. The learning
itself is measured by the full runs in the examples' READMEs, not here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.job import run_job
from asyncrl.preflight import check_agent, check_tool_use
from tests.test_train import accounted, last_buffer_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def short(tmp_path: Path, example: str) -> list[str]:
    test = json.dumps([{"name": "test", "path": "examples/calculator_agent/data/test.jsonl@[0:12]",
                        "n_samples": 1, "pass_k": [1], "group_by": "kind",
                        "apply_chat_template": example == "calculator_agent",
                        "sampling": {"temperature": 1.0, "max_new_tokens": 120}}])  # fmt: skip
    return [
        "--output-dir", str(tmp_path / "run"), "--train.num-steps", "2",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--eval-interval", "2",
        "--eval.sets", test, "--save-interval", "0", "--buffer.filters", "[]",
    ]  # fmt: skip


@pytest.mark.parametrize("example", ["calculator_agent", "openai_agent"])
async def test_the_tool_use_examples_train_end_to_end(example, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs' paths are relative to the repository root
    cfg = load_config(f"examples/{example}/config.yaml", overrides=short(tmp_path, example))
    check_tool_use(cfg)
    check_agent(cfg)
    result = await run_job(cfg)
    assert result.ok and result.steps == 2, result.error
    assert accounted(last_buffer_metrics(tmp_path / "run"))
    rows = [json.loads(x) for x in (tmp_path / "run/metrics/eval.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [0, 2] and all(r["samples"] == 12 for r in rows)
    assert all(r["failed"] == 0 and r["tool_calls"] > 0 for r in rows)  # the model calls tools


def test_the_python_api_example_trains_reads_and_exports(tmp_path, monkeypatch, capsys):
    """``examples/python_api/train.py``: config, train, metrics, eval, export, as a
    script would (2 steps of the arith job)."""
    import importlib.util

    monkeypatch.chdir(ROOT)
    spec = importlib.util.spec_from_file_location(
        "api_example", ROOT / "examples/python_api/train.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--steps", "2", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "trained 2 steps" in out and "eval v2: pass@1" in out
    assert (tmp_path / "run" / "exported" / "model.safetensors").is_file()
    import asyncrl

    run = asyncrl.open_run(tmp_path / "run")
    assert [r["step"] for r in run.metrics] == [1, 2] and run.checkpoints.keys() == {2}
    with pytest.raises(asyncrl.ConfigError, match=r"--lora-rank"):
        asyncrl.make_config(settings={"lora_rank": -1})
