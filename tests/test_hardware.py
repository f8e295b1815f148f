"""What pays on this machine: a model's width, and ``dtype: auto``'s choice for the
trainer and the engines that sample for it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from asyncrl import hardware
from asyncrl.config import RunConfig
from asyncrl.engines.config import EngineConfig
from asyncrl.job import job_actor_specs
from asyncrl.offline_eval import engine_config
from asyncrl.role_configs import role_params
from asyncrl.runtime import machine
from asyncrl.trainers.config import TrainerConfig


def model_dir(root: Path, hidden: int) -> Path:
    path = root / f"hidden-{hidden}"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    return path


@pytest.fixture
def bf16_cpu(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))


@pytest.fixture
def old_cpu(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))


DATA = {"path": "examples/arith/data/train.jsonl"}


def job(model: Path, **sections) -> RunConfig:
    return RunConfig.model_validate({"trainer": {"model_path": str(model)}, "data": DATA}
                                    | sections)  # fmt: skip


def test_a_model_whose_width_cannot_be_read_is_assumed_wide(tmp_path):
    assert hardware.wide_model(None) and hardware.wide_model(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text("{not json")
    assert hardware.wide_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"n_embd": 64}))  # GPT-2's name
    assert not hardware.wide_model(str(tmp_path))
    assert hardware.model_hidden(str(tmp_path)) == 64


def test_auto_trains_a_wide_model_in_bf16_on_a_cpu_with_bf16(tmp_path, bf16_cpu):
    cfg = job(model_dir(tmp_path, 576), rollout={"engine": {"type": "torch"}},
              eval={"engine": {"type": "torch"}})  # fmt: skip
    assert cfg.trainer.dtype == "bf16-mixed"
    assert cfg.rollout.engine.dtype == cfg.eval.engine.dtype == "bfloat16"
    # What an actor rebuilds from the spec is the choice, not auto again.
    again = RunConfig.model_validate(cfg.model_dump())
    assert again.trainer.dtype == "bf16-mixed" and again.rollout.engine.dtype == "bfloat16"


@pytest.mark.parametrize("hidden", [128, 576])
def test_auto_is_float32_on_a_cpu_without_bf16_and_for_a_narrow_model(tmp_path, hidden, request):
    request.getfixturevalue("bf16_cpu" if hidden == 128 else "old_cpu")
    cfg = job(model_dir(tmp_path, hidden), rollout={"engine": {"type": "torch"}})
    assert (cfg.trainer.dtype, cfg.rollout.engine.dtype) == ("float32", "float32")


def test_an_engine_left_to_auto_samples_at_the_trainers_chosen_precision(tmp_path, bf16_cpu):
    wide = model_dir(tmp_path, 576)
    cfg = RunConfig.model_validate({
        "trainer": {"model_path": str(wide), "dtype": "float32"},
        "rollout": {"engine": {"type": "torch"}},
    })  # fmt: skip
    assert cfg.rollout.engine.dtype == "float32"  # alone it would be bfloat16
    assert EngineConfig(model_path=str(wide)).dtype == "bfloat16"
    cfg = RunConfig.model_validate({
        "trainer": {"model_path": str(wide), "dtype": "float32"},
        "rollout": {"engine": {"type": "torch", "dtype": "bfloat16"}},
    })  # fmt: skip
    assert cfg.rollout.engine.dtype == "bfloat16"  # set: kept
    # No engine section: the rollout actor's engine and `asyncrl eval`'s follow too.
    cfg = job(wide)
    assert cfg.rollout.engine is None and cfg.trainer.dtype == "bf16-mixed"
    params = role_params(cfg, tmp_path, resume=False)
    assert params["rollout"].engine.dtype == "bfloat16"
    assert engine_config(cfg, wide).dtype == "bfloat16"
    explicit = RunConfig.model_validate(
        {"trainer": {"model_path": str(wide), "dtype": "float32"}, "data": DATA}
    )
    assert role_params(explicit, tmp_path, resume=False)["rollout"].engine.dtype == "float32"
    assert engine_config(explicit, wide).dtype == "float32"


def test_a_cpu_engine_beside_a_gpu_trainer_stays_float32_where_its_cpu_lacks_bf16(
    tmp_path, old_cpu
):
    wide = model_dir(tmp_path, 576)
    cfg = RunConfig.model_validate({
        "trainer": {"model_path": str(wide), "device": "cuda"}, "data": DATA,
        "rollout": {"engine": {"type": "torch"}},
    })  # fmt: skip
    assert cfg.trainer.dtype == "bf16-mixed" and cfg.rollout.engine.dtype == "float32"
    on_gpu = RunConfig.model_validate({
        "trainer": {"model_path": str(wide), "device": "cuda"}, "data": DATA,
        "rollout": {"engine": {"type": "torch", "device": "cuda"}},
    })  # fmt: skip
    assert on_gpu.rollout.engine.dtype == "bfloat16"
    default = RunConfig.model_validate(
        {"trainer": {"model_path": str(wide), "device": "cuda"}, "data": DATA}
    )
    assert role_params(default, tmp_path, resume=False)["rollout"].engine.dtype == "float32"


def test_asyncrl_eval_without_a_trainer_chooses_for_the_model_it_evaluates(tmp_path, bf16_cpu):
    wide, narrow = model_dir(tmp_path, 576), model_dir(tmp_path, 64)
    cfg = RunConfig.model_validate({"rollout": {"engine": {"model_path": str(wide)}}})
    assert cfg.rollout.engine.dtype == "bfloat16"
    assert engine_config(cfg, narrow).dtype == "float32"
    assert engine_config(cfg, wide).dtype == "bfloat16"
    pinned = RunConfig.model_validate(
        {"rollout": {"engine": {"model_path": str(wide), "dtype": "bfloat16"}}}
    )
    assert engine_config(pinned, narrow).dtype == "bfloat16"  # set: kept


def test_auto_is_bf16_on_a_gpu_and_float32_for_the_sim_trainer(tmp_path, old_cpu):
    narrow = model_dir(tmp_path, 64)
    assert TrainerConfig(model_path=str(narrow), device="cuda").dtype == "bf16-mixed"
    assert EngineConfig(model_path=str(narrow), device="cuda:0").dtype == "bfloat16"
    sim = TrainerConfig(model_path=str(narrow), backend="sim", device="cuda")
    assert sim.dtype == "float32"


def test_the_start_line_says_the_choice_and_hints_only_against_it(tmp_path, bf16_cpu):
    wide = model_dir(tmp_path, 576)

    def line(*trainer: tuple[str, str]) -> str:
        cfg = RunConfig.model_validate({
            "trainer": {"model_path": str(wide), **dict(trainer)},
            "data": DATA,
        })  # fmt: skip
        return machine.describe(cfg, job_actor_specs(cfg, {}, tmp_path, resume=False))

    auto = line()
    assert "trainer bf16-mixed" in auto and re.search(r"engines? bfloat16", auto)
    assert "--trainer.dtype" not in auto
    fp32 = line(("dtype", "float32"))
    assert "trainer float32" in fp32 and re.search(r"engines? float32", fp32)
    assert "--trainer.dtype bf16-mixed" in fp32


def test_available_memory_is_the_hosts_or_less_where_a_container_leaves_less(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    host = 4_000_000 * 1024
    assert hardware.available_memory(tmp_path) == host  # no cgroup files
    v2 = tmp_path / "sys/fs/cgroup"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("max\n")  # no limit
    (v2 / "memory.current").write_text("100\n")
    assert hardware.available_memory(tmp_path) == host
    (v2 / "memory.max").write_text(f"{2 * 1024**3}\n")  # a 2 GiB container, 0.5 GiB used
    (v2 / "memory.current").write_text(f"{1024**3 // 2}\n")
    assert hardware.available_memory(tmp_path) == 3 * 1024**3 // 2
    (v2 / "memory.max").unlink()
    v1 = v2 / "memory"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text(f"{(1 << 63) - 4096}\n")  # v1's "unlimited"
    (v1 / "memory.usage_in_bytes").write_text("0\n")
    assert hardware.available_memory(tmp_path) == host
    (v1 / "memory.limit_in_bytes").write_text(f"{1024**3}\n")
    assert hardware.available_memory(tmp_path) == 1024**3
    (tmp_path / "proc/meminfo").write_text("MemTotal: 8000000 kB\n")  # an old kernel
    assert hardware.available_memory(tmp_path) is None


def test_cpu_shares_split_the_time_between_two_readings_by_kind(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3\n")
    before = hardware.cpu_times(stat)
    assert before == {"user": 100, "nice": 0, "system": 50, "idle": 800, "iowait": 10,
                      "irq": 0, "softirq": 5, "steal": 35}  # fmt: skip
    stat.write_text("cpu  250 0 100 850 10 0 5 85 0 0\n")  # 300 ticks: 150 user, 50 stolen
    shares = hardware.cpu_shares(before, hardware.cpu_times(stat))
    assert shares["user"] == pytest.approx(0.5) and shares["steal"] == pytest.approx(1 / 6)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert hardware.cpu_shares(before, before) is None  # no time between them
    assert hardware.cpu_times(tmp_path / "absent") is None
    assert hardware.cpu_shares(None, before) is None
    real = hardware.cpu_times()
    assert real is None or (set(real) == set(hardware.CPU_COLUMNS) and real["user"] > 0)
