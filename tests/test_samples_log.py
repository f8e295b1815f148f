"""The trained samples logged as text (asyncrl/observe/samples.py): which samples, which
fields, and their way into TensorBoard and W&B (asyncrl/observe/trackers.py)."""

from __future__ import annotations

import json

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from asyncrl.observe.samples import COLUMNS, sample_rows
from asyncrl.observe.trackers import MetricsFollower, Point, TensorBoardTracker
from asyncrl.types import Group, Sample, SampleStatus, TrainBatch


def batch() -> TrainBatch:
    groups = []
    for g, rewards in enumerate(([0.1, 0.9], [0.5, {"score": -1.0, "format": 1.0}])):
        samples = []
        for i, reward in enumerate(rewards):
            s = Sample(uid=f"{g}/{i}", group_id=str(g), index=i,
                       prompt=[{"role": "user", "content": f"q{g}"}], response_text=f"a{g}{i}",
                       packed_prompt=np.array([1, 2], np.int32).tobytes())  # fmt: skip
            s.append_response(np.array([5, 6, 7]), np.zeros(3), 3 + i)
            s.reward, s.status = reward, SampleStatus.COMPLETED
            samples.append(s)
        groups.append(Group(uid=f"g{g}", prompt_uid=str(g), samples=samples))
    return TrainBatch(batch_id=0, step=4, groups=groups)


def test_the_highest_and_lowest_rewards_come_first_with_their_text():
    rows = sample_rows(batch(), version=5, n=3, reward_key="score")
    assert [r["response"] for r in rows] == ["a01", "a11", "a10"]  # 0.9, -1.0, then 0.5
    top = rows[0]
    assert tuple(top) == COLUMNS
    assert top["prompt"] == "user: q0" and top["reward"] == 0.9 and top["status"] == "completed"
    assert top["response_tokens"] == 3 and top["staleness"] == 5 - 1 - 4
    assert rows[1]["reward"] == {"score": -1.0, "format": 1.0}
    assert sample_rows(batch(), 5, 0, "score") == []
    assert len(sample_rows(batch(), 5, 10, "score")) == 4


def test_each_steps_samples_reach_tensorboard_as_one_text_table(tmp_path):
    rows = sample_rows(batch(), version=5, n=2, reward_key="score")
    with (tmp_path / "samples.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tb = TensorBoardTracker(tmp_path / "tb")
    follower = MetricsFollower(tmp_path, [tb])
    assert follower.poll() == 1  # one point: step 5's table
    follower.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    [text] = events.Tensors("samples/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 5 and "| step | group | prompt |" in table and "a01" in table


def test_a_samples_point_goes_to_wandb_as_a_table(tmp_path, monkeypatch):
    from asyncrl.observe.trackers import WandbTracker
    from tests.test_trackers import wandb_history

    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbTracker(project="asyncrl-test", name="s", directory=tmp_path, config={},
                           mode="offline")  # fmt: skip
    rows = sample_rows(batch(), version=5, n=2, reward_key="score")
    tracker.log(Point("samples", 5, {}, rows))
    tracker.close()
    [run] = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    history = wandb_history(run, lambda r: any("samples/table/_type" in x for x in r))
    [row] = [r for r in history if "samples/table/_type" in r]
    assert row["samples/table/_type"] == "table-file" and row["samples/step"] == 5
    assert (row["samples/table/nrows"], row["samples/table/ncols"]) == (2, len(COLUMNS))
