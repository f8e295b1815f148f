"""The train progress bar: rates over this run's steps, columns from trainer heartbeats."""

from __future__ import annotations

import pytest

from asyncrl.observe.progress import JobProgress, RateMeter, progress_fields
from asyncrl.runtime.supervisor import ActorStatus


def test_samples_per_second_counts_from_the_first_step_seen():
    meter = RateMeter(samples_per_step=64)
    assert meter.rate(10, now=100.0) is None  # a resumed run starts at step 10
    assert meter.rate(10, now=101.0) is None  # no step yet
    assert meter.rate(14, now=104.0) == pytest.approx(4 * 64 / 4.0)
    assert meter.rate(3, now=105.0) is None  # a new run (version went back): start again


def test_columns_show_the_trainer_figures_or_a_dash():
    stats = {"reward/mean": 0.53125, "staleness/mean": 1.5}
    assert progress_fields(stats, 12.34) == {"reward": "0.531", "staleness": "1.50", "rate": "12.3"}
    assert progress_fields({}, None) == {"reward": "-", "staleness": "-", "rate": "-"}


def test_the_bar_follows_the_trainer_version():
    bar = JobProgress(num_steps=10, samples_per_step=8)
    status = {"trainer": ActorStatus(name="trainer", role="trainer", version=3,
                                     stats={"reward/mean": 0.25})}  # fmt: skip
    bar.update(status)
    task = bar.progress.tasks[0]
    assert (task.completed, task.total, task.fields["reward"]) == (3, 10, "0.250")
    bar.update({})  # before the trainer says hello: nothing to show, no error
