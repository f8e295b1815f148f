"""The start-of-run line: what this machine has and how the job spends it."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl import hardware
from asyncrl.config import load_config
from asyncrl.job import job_actor_specs
from asyncrl.runtime import machine

ROOT = Path(__file__).resolve().parents[1]


def plan(tmp_path: Path, config: str, *flags: str) -> str:
    cfg = load_config(ROOT / config, overrides=list(flags))
    return machine.describe(cfg, job_actor_specs(cfg, {}, tmp_path, resume=False))


@pytest.mark.parametrize("bf16", [True, False])
def test_the_line_names_each_torch_process_its_threads_and_dtype(tmp_path, monkeypatch, bf16):
    flags = frozenset({"avx2", "avx512_bf16"} if bf16 else {"avx2"})
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    monkeypatch.setattr(hardware, "usable_cores", lambda: 8)
    line = plan(tmp_path, "examples/word_problems/config.yaml")
    assert line.startswith("8 cores, bf16 instructions: " if bf16 else "8 cores: ")
    assert "trainer float32 x 8 threads (micro-batches of 1024 tokens)" in line  # every core
    # 8 shared by 3; the trainer's 8 lent to the engine while it waits for a batch
    assert "; 1 engine float32 x 2 threads (8 while the trainer waits); eval x 2 threads" in line
    assert ("--trainer.dtype bf16-mixed" in line) == bf16  # the hint only where it pays
    mixed = plan(tmp_path, "examples/word_problems/config.yaml", "--trainer.dtype", "bf16-mixed")
    assert "trainer bf16-mixed" in mixed
    # bf16 where the CPU has no bf16 instructions is the slow choice, and is said to be.
    assert ("no native bf16" in mixed and "--trainer.dtype float32" in mixed) == (not bf16)
    assert ("bf16-mixed on such a CPU" in mixed) is False
    # An engine set to bf16 (auto would pick float32 without bf16 instructions) likewise.
    engine = plan(tmp_path, "examples/word_problems/config.yaml",
                  "--rollout.engine.dtype", "bfloat16")  # fmt: skip
    assert "1 engine bfloat16" in engine
    assert ("--rollout.engine.dtype bfloat16 will be slow" in engine) == (not bf16)
    assert ("--trainer.dtype" in engine) == bf16  # the trainer's float32 is not named slow
    both = plan(tmp_path, "examples/word_problems/config.yaml", "--trainer.dtype",
                "bf16-mixed", "--rollout.engine.dtype", "bfloat16")  # fmt: skip
    fix = "--trainer.dtype float32 --rollout.engine.dtype float32)"
    assert both.endswith(fix) == (not bf16)


def test_engine_actors_are_the_engines_and_rollout_actors_are_not(tmp_path):
    line = plan(tmp_path, "examples/arith/config.yaml", "--rollout.num-actors", "2",
                "--rollout.engine.serve", "actor", "--update-weight-transport", "disk",
                "--eval-interval", "0")  # fmt: skip
    assert "2 engines float32" in line and "eval" not in line
    vllm = plan(tmp_path, "examples/arith/config.yaml", "--rollout.engine.type", "vllm",
                "--rollout.engine.serve", "actor", "--update-weight-transport", "disk",
                "--eval-interval", "0")  # fmt: skip
    assert "; 1 vllm engine" in vllm and "engine float32" not in vllm  # its threads are its own


def test_flags_alone_give_the_trainer_every_core_and_the_devices_micro_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "usable_cores", lambda: 8)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset())
    cfg = load_config(overrides=["--hf-checkpoint", "m", "--prompt-data", "p.jsonl"])
    specs = {s.role: s.threads for s in job_actor_specs(cfg, {}, tmp_path, resume=False)}
    # Two rollout actors' engines and the trainer share the 8 cores; the trainer takes all.
    assert specs["trainer"] == 8 and specs["rollout"] == 8 // 3
    # On 2 cores one engine, lent the trainer's cores (a model of unknown width is wide).
    monkeypatch.setattr(hardware, "usable_cores", lambda: 2)
    two = load_config(overrides=["--hf-checkpoint", "m", "--prompt-data", "p.jsonl"])
    assert (two.rollout.num_actors, two.rollout.max_groups) == (1, 16)
    monkeypatch.setattr(hardware, "usable_cores", lambda: 8)
    assert cfg.trainer.microbatch_tokens == 1024
    line = machine.describe(cfg, job_actor_specs(cfg, {}, tmp_path, resume=False))
    assert "trainer float32 x 8 threads (micro-batches of 1024 tokens)" in line
    cuda = load_config(overrides=["--hf-checkpoint", "m", "--prompt-data", "p.jsonl",
                                  "--trainer.device", "cuda"])  # fmt: skip
    assert cuda.trainer.microbatch_tokens == 8192
    # Set, they are what was set; runtime.threads holds for the trainer too.
    flags = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--max-tokens-per-gpu", "300",
             "--runtime.threads", "3"]  # fmt: skip
    cfg = load_config(overrides=flags)
    specs = {s.role: s.threads for s in job_actor_specs(cfg, {}, tmp_path, resume=False)}
    assert cfg.trainer.microbatch_tokens == 300 and specs["trainer"] == 3


def test_trainer_ranks_share_the_cores_and_ray_keeps_the_shared_count(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "usable_cores", lambda: 8)
    base = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl"]

    def trainer_threads(*flags: str) -> int | None:
        cfg = load_config(overrides=[*base, *flags])
        specs = job_actor_specs(cfg, {}, tmp_path, resume=False)
        return next(s.threads for s in specs if s.role == "trainer")

    assert trainer_threads() == 8
    assert trainer_threads("--trainer.num-ranks", "2") == 4  # each rank's, 8 in all
    assert trainer_threads("--runtime.type", "ray") == 8 // 3  # the shared count there
    assert trainer_threads("--runtime.trainer-threads", "3") == 3
