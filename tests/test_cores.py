"""The cores an idle trainer lends: its busy mark, an engine's thread count from it, and
which processes of a job take part."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from asyncrl import cores, hardware
from asyncrl.config import RunConfig, load_config
from asyncrl.cores import BusyMark, LentThreads
from asyncrl.engines.base import GenerateRequest, SamplingParams
from asyncrl.engines.torch.engine import TorchEngine
from asyncrl.job import job_actor_specs
from asyncrl.rollout.config import RolloutConfig
from tests.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_reopen_wait(monkeypatch):
    monkeypatch.setattr(cores, "REOPEN_S", 0.0)


def test_an_engine_runs_on_its_own_threads_unless_the_mark_says_the_trainer_waits(tmp_path):
    path = tmp_path / "trainer.busy"
    threads = LentThreads(path, own=1, idle=4)
    assert threads() == 1  # no mark yet: the trainer may be computing
    path.write_bytes(b"")
    assert threads() == 1  # created but not written yet
    mark = BusyMark(path)
    assert threads() == 4  # a trainer that set up and waits
    with mark.busy():
        assert threads() == 1
    assert threads() == 4
    with pytest.raises(RuntimeError), mark.busy():
        raise RuntimeError("a failed step")
    assert threads() == 4  # cleared however the step ended
    mark.close()
    assert threads() == 4 and path.read_bytes() == b"\x00"
    threads.close()


def test_a_restarted_trainer_clears_the_mark_a_crash_left_in_the_file_engines_read(tmp_path):
    path = tmp_path / "trainer.busy"
    crashed = BusyMark(path)
    crashed.set(True)  # killed mid-step: never cleared
    threads = LentThreads(path, own=2, idle=6)
    assert threads() == 2
    inode = path.stat().st_ino
    BusyMark(path)  # the restart: the same file, so the engine's open one sees it
    assert path.stat().st_ino == inode and threads() == 6


def test_a_mark_missing_at_first_is_found_once_it_appears(tmp_path, monkeypatch):
    path = tmp_path / "trainer.busy"
    monkeypatch.setattr(cores, "REOPEN_S", 3600.0)
    threads = LentThreads(path, own=1, idle=2)
    assert threads() == 1
    BusyMark(path)
    assert threads() == 1  # not looked for again within REOPEN_S
    monkeypatch.setattr(threads, "_next_open", 0.0)
    assert threads() == 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    build_tiny_model(directory)
    return directory


async def test_the_engine_steps_on_the_lent_threads_while_the_trainer_waits(tiny, tmp_path):
    engine = TorchEngine.from_pretrained(str(tiny))
    mark = BusyMark(tmp_path / "trainer.busy")
    engine.follow_threads(LentThreads(mark.path, own=1, idle=2))
    task = asyncio.create_task(engine.run())
    loop = asyncio.get_running_loop()

    async def generate(rid: str) -> int:
        """Tokens of one request; then the step thread's torch thread count."""
        sampling = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        request = GenerateRequest(rid=rid, input_ids=[1, 2, 3], sampling=sampling)
        outs = [out async for out in engine.generate(request)]
        assert len(outs[-1].output_ids) == 6
        assert engine._steps is not None
        return await loop.run_in_executor(engine._steps, torch.get_num_threads)

    try:
        assert await generate("idle") == 2
        lent = engine.stats["lent_thread_steps"]
        assert lent == engine.stats["steps"] >= 5  # every step of that request
        with mark.busy():
            assert await generate("busy") == 1
        assert engine.stats["lent_thread_steps"] == lent  # none lent while it computed
        await engine.set_threads(1)  # a fixed count (the eval's final) outranks the loan
        assert await generate("fixed") == 1
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def specs_of(tmp_path: Path, *flags: str) -> dict[str, object]:
    cfg = load_config(ROOT / "examples/word_problems/config.yaml", overrides=list(flags))
    return {s.name: s for s in job_actor_specs(cfg, {}, tmp_path, resume=False)}


def test_a_local_job_lends_the_trainers_cores_to_its_embedded_engines(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "usable_cores", lambda: 8)
    specs = specs_of(tmp_path, "--rollout.num-actors", "2")
    mark = str(tmp_path / "trainer.busy")
    assert specs["trainer"].busy_mark == mark and specs["trainer"].idle_trainer_threads is None
    for name in ("rollout-0", "rollout-1"):  # 8 cores shared by 4 processes; 8 // 2 lent
        assert (specs[name].threads, specs[name].idle_trainer_threads) == (2, 4)
        assert specs[name].busy_mark == mark
    assert specs["eval"].busy_mark is None and specs["buffer"].busy_mark is None
    served = specs_of(
        tmp_path, "--rollout.engine.serve", "actor", "--update-weight-transport", "disk"
    )
    assert served["engine-0"].idle_trainer_threads == 8 and served["rollout-0"].busy_mark is None


@pytest.mark.parametrize(
    "flags",
    [
        ["--runtime.lend-trainer-cores", "never"],
        ["--runtime.threads", "2"],  # the user shares the cores
        [
            "--rollout.engine.type",
            "vllm",
            "--rollout.engine.serve",
            "actor",
            "--update-weight-transport",
            "disk",
        ],
        ["--debug-rollout-only", "--eval.interval", "0"],  # nothing trains
        ["--rollout.engine.device", "cuda"],  # an engine's CPU threads barely matter
    ],
)
def test_no_loan_where_the_job_does_not_share_the_cores_itself(tmp_path, monkeypatch, flags):
    monkeypatch.setattr(hardware, "usable_cores", lambda: 8)
    specs = specs_of(tmp_path, *flags)
    assert all(s.busy_mark is None and s.idle_trainer_threads is None for s in specs.values())


def test_one_core_lends_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "usable_cores", lambda: 1)
    specs = specs_of(tmp_path)
    assert specs["rollout-0"].threads == 1
    assert all(s.busy_mark is None and s.idle_trainer_threads is None for s in specs.values())


@pytest.mark.parametrize(("hidden", "lend", "lent"), [
    (128, "auto", False),  # the 1M arith toy's width: a second thread did not pay
    (576, "auto", True),  # SmolLM2-135M's
    (128, "always", True),
])  # fmt: skip
def test_auto_lends_where_the_model_is_wide_enough(tmp_path, monkeypatch, hidden, lend, lent):
    monkeypatch.setattr(hardware, "usable_cores", lambda: 8)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    flags = ["--rollout.engine.model-path", str(model), "--runtime.lend-trainer-cores", lend]
    specs = specs_of(tmp_path, *flags)
    assert (specs["rollout-0"].idle_trainer_threads == 8) is lent
    assert (specs["trainer"].busy_mark is not None) is lent


@pytest.mark.parametrize(("hidden", "cores", "flags", "actors"), [
    (576, 2, [], 1),  # SmolLM2's width on 2 cores: one engine, lent the trainer's cores
    (576, 1, [], 1),
    (128, 2, [], 2),  # a toy's: no loan, so generation keeps its two engines
    (576, 3, [], 2),  # a thread of its own for the trainer and each of two engines
    (576, 2, ["--rollout.num-actors", "2"], 2),  # set: kept
    (576, 2, ["--runtime.lend-trainer-cores", "never"], 2),
    (576, 2, ["--runtime.threads", "1"], 2),  # the user shares the cores
    (576, 2, ["--runtime.type", "ray"], 2),
    (576, 2, ["--trainer.device", "cuda"], 2),  # the trainer computes elsewhere
])  # fmt: skip
def test_a_job_that_lends_the_trainers_cores_starts_one_engine_unless_told(
    tmp_path, monkeypatch, hidden, cores, flags, actors
):
    monkeypatch.setattr(hardware, "usable_cores", lambda: cores)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    flags = ["--hf-checkpoint", str(model), "--prompt-data", str(data), *flags]
    cfg = load_config(None, overrides=flags)
    assert cfg.rollout.num_actors == actors
    again = load_config(None, overrides=[*flags, "--rollout.num-actors", "3"])
    assert again.rollout.num_actors == 3
    # A config built around a caller's section leaves that section as it was.
    rollout = RolloutConfig()
    RunConfig(rollout=rollout, trainer=cfg.trainer, data=cfg.data)
    assert "num_actors" not in rollout.model_fields_set and rollout.num_actors == 2
