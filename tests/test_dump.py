"""Batch dumps (``asyncrl.buffer.dump``) and the sources a trainer reads batches from
(``asyncrl.actors.batches``): round trip, numbering across restarts, refusals that name
the file, and the debug-mode config checks."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from asyncrl.actors.batches import DumpedBatches
from asyncrl.actors.dumper import batch_summary
from asyncrl.buffer.dump import BatchWriter, batch_files, read_batch
from asyncrl.config import RunConfig, TrainConfig
from asyncrl.types import Group, Sample, SampleStatus, TrainBatch, pack_int32


def batch(batch_id: int, lengths: tuple[int, ...] = (3, 5), rewards=(1.0, 0.0)) -> TrainBatch:
    samples = []
    for i, (n, r) in enumerate(zip(lengths, rewards, strict=True)):
        s = Sample(uid=f"g{batch_id}/{i}", group_id=f"g{batch_id}", packed_prompt=pack_int32([1]))
        # 20,000 tokens is past the wire codec's inline limit: the dump must still be one body.
        s.append_response(np.arange(n) % 50, np.full(n, -0.5), 0)
        s.reward, s.status = r, SampleStatus.COMPLETED
        samples.append(s)
    return TrainBatch(
        batch_id=batch_id,
        step=0,
        groups=[Group(uid=f"g{batch_id}", prompt_uid="p", samples=samples)],
    )


def test_batches_round_trip_in_order_and_a_reopened_writer_continues_the_numbering(tmp_path):
    first = BatchWriter(tmp_path)
    paths = [first.write(batch(i)) for i in (1, 2)]
    assert [p.name for p in paths] == ["batch_000001.msgpack", "batch_000002.msgpack"]
    big = batch(3, lengths=(20_000, 1))
    assert BatchWriter(tmp_path).write(big).name == "batch_000003.msgpack"
    (tmp_path / "batch_000004.msgpack.tmp").write_bytes(b"half a batch")  # a crash mid-write
    files = batch_files(tmp_path)
    assert [read_batch(p).batch_id for p in files] == [1, 2, 3]
    back = read_batch(files[2])
    assert (
        back == big
        and back.samples[0].response_tokens.tolist() == (np.arange(20_000) % 50).tolist()
    )


def test_a_file_that_is_not_a_batch_is_refused_by_name(tmp_path):
    bad = tmp_path / "batch_000001.msgpack"
    bad.write_bytes(b"\x93\x01\x02")
    with pytest.raises(ValueError, match=r"batch_000001\.msgpack: not a dumped TrainBatch"):
        read_batch(bad)


async def test_dumped_batches_skip_what_a_resumed_trainer_trained_then_run_out(tmp_path):
    """A batch's id is its file's number (a dump written again after a restart may hold
    other ids), so a trainer's ``last_batch`` is where it resumes in this dump."""
    writer = BatchWriter(tmp_path)
    for i in (1, 5, 2):
        writer.write(batch(i))
    source = DumpedBatches(tmp_path, skip=1)
    got = [(await source.next(version=0)).batch for _ in range(2)]
    assert [b.batch_id for b in got] == [2, 3]
    end = await source.next(version=2)
    assert end.batch is None and end.exhausted
    with pytest.raises(ValueError, match=r"no batch_NNNNNN\.msgpack"):
        DumpedBatches(tmp_path / "empty")


def test_batch_summary_counts_samples_tokens_rewards_and_failures():
    b = batch(1, lengths=(2, 4), rewards=(1.0, 0.0))
    b.groups[0].samples[1].status = SampleStatus.FAILED
    b.groups[0].samples[1].reward = None
    summary = batch_summary(b)
    assert summary["samples"] == 2 and summary["tokens"] == 6 and summary["failed"] == 1
    assert summary["reward/mean"] == 1.0  # the failed sample has no reward
    assert summary["response_len/mean"] == 3 and summary["response_len/max"] == 4


def test_debug_modes_are_checked_before_launch(tmp_path):
    with pytest.raises(ValidationError, match="pick one"):
        TrainConfig(debug_rollout_only=True, load_rollout_data=str(tmp_path))
    with pytest.raises(ValidationError, match=r"holds no batch_NNNNNN\.msgpack"):
        TrainConfig(load_rollout_data=str(tmp_path))
    with pytest.raises(ValidationError, match="nothing new to evaluate"):
        RunConfig(
            train={"debug_rollout_only": True},
            eval={"interval": 5, "sets": [{"name": "t", "path": str(tmp_path / "t.jsonl")}]},
        )
    # Rollout-only trains nothing, so async without an off-policy correction is fine there.
    RunConfig(
        train={"debug_rollout_only": True},
        buffer={"max_staleness": 2},
        algo={"off_policy_correction": "none"},
    )
    assert (
        TrainConfig(debug_rollout_only=True).rollout_data_dir(tmp_path) == tmp_path / "rollout_data"
    )
    assert TrainConfig().rollout_data_dir(tmp_path) is None
