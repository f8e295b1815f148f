"""A job whose samples keep failing, or that trains nothing, ends non-zero with the reason
and the counts, instead of "train ok: 0 steps"."""

from __future__ import annotations

import pytest

from asyncrl.buffer.accounting import FailureWatch
from asyncrl.config import load_config
from asyncrl.job import run_job
from tests.test_train import job_flags, write_prompts
from tests.tiny_model import build_tiny_model


def test_the_failure_watch_trips_on_a_full_window_of_mostly_failed_groups():
    watch = FailureWatch(window=4, max_share=0.75)
    for outcome in ["failed", "failed", "partial", "duplicate", "failed"]:
        watch.record(outcome)
    assert not watch.tripped()  # three finished groups: the window is not full yet
    watch.record("filtered")
    assert watch.tripped()  # 3 of the last 4 failed
    watch.record("stored")
    assert not watch.tripped()  # 2 of the last 4
    never = FailureWatch(window=0, max_share=0.5)
    for _ in range(10):
        never.record("failed")
    assert not never.tripped()


def reward_that_always_raises(sample) -> float:
    raise LookupError("no answer field in the sample's metadata")


def constant_reward(sample) -> float:
    return 0.0


@pytest.mark.slow
async def test_a_job_whose_samples_keep_failing_ends_with_the_reason(tmp_path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    flags = [*job_flags(tmp_path, steps=4), "--rm-type", "custom"]
    flags += ["--custom-rm-path", "tests.test_failing_jobs:reward_that_always_raises"]
    flags += ["--buffer.failure-window", "4", "--num-epoch", "50"]
    flags += ["--runtime.stop-timeout", "3"]  # the others stop quickly once it failed
    result = await run_job(load_config(overrides=flags))
    assert not result.ok and result.steps == 0
    assert "samples keep failing: 4 of the last 4 finished groups failed" in result.error
    assert "no answer field in the sample" in result.error and "not restarted" in result.error


@pytest.mark.slow
async def test_a_job_that_trains_nothing_says_why(tmp_path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=8)
    flags = [*job_flags(tmp_path, steps=4), "--rm-type", "custom"]
    flags += ["--custom-rm-path", "tests.test_failing_jobs:constant_reward"]
    # Every group has one reward for all its samples: GRPO learns nothing from it.
    flags += ["--buffer.filters", '["zero_reward_variance"]', "--num-epoch", "1"]
    result = await run_job(load_config(overrides=flags))
    assert not result.ok and result.steps == 0
    assert "the job trained nothing" in result.error, result.error
    assert "of 8 groups admitted, 0 failed, 8 filtered" in result.error, result.error
