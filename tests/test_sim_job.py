"""A job with no model: the sim engine in the rollout actor and the sim trainer, around the
real buffer, rollout actor, channels and weight versions (the cluster simulator's base)."""

from __future__ import annotations

import json

import pytest

from asyncrl.config import load_config
from asyncrl.job import run_job
from tests.test_train import accounted, job_flags, last_buffer_metrics, write_prompts
from tests.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow


async def test_a_sim_job_trains_in_modelled_time_with_the_accounting_whole(tmp_path):
    build_tiny_model(tmp_path / "model")  # its tokenizer and vocabulary: nothing is run
    write_prompts(tmp_path / "prompts.jsonl")
    engine = {"length-median": 4, "length-p99-ratio": 1.5, "time-scale": 100.0}
    trainer = {"step-base-s": 2.0, "step-s-per-token": 0.01, "time-scale": 100.0}
    flags = [
        *job_flags(tmp_path, steps=4),
        "--rollout.engine.type", "sim", "--rollout.engine.model-path", str(tmp_path / "model"),
        *(x for k, v in engine.items() for x in (f"--rollout.engine.sim.{k}", str(v))),
        "--train-backend", "sim",
        *(x for k, v in trainer.items() for x in (f"--trainer.sim.{k}", str(v))),
        "--buffer.filters", "[]",
    ]  # fmt: skip
    result = await run_job(load_config(overrides=flags))
    assert result.ok and result.steps == 4, result.error
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("actor") == "trainer"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # Each step took its modelled time: 2 s + 0.01 s per forwarded token.
    for r in rows:
        assert r["time/modelled_step"] == pytest.approx(2.0 + 0.01 * r["tokens"])
    clock = sum(r["time/modelled_step"] for r in rows)
    assert rows[-1]["time/modelled_clock"] == pytest.approx(clock)
    assert all(r["staleness/max"] <= 1 for r in rows)  # versions reached the sim engine
    assert accounted(last_buffer_metrics(tmp_path / "run"))


def test_the_sim_trainer_is_one_process():
    from asyncrl.trainers.config import TrainerConfig

    with pytest.raises(ValueError, match="backend=sim models a step's time in one process"):
        TrainerConfig(model_path="m", backend="sim", num_ranks=2)
