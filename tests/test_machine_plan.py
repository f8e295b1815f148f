"""The start-of-run line: what this machine has and how the job spends it."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 8)
    line = plan(tmp_path, "examples/word_problems/config.yaml", "--runtime.threads", "3")
    assert line.startswith("8 cores, bf16 instructions: " if bf16 else "8 cores: ")
    assert "trainer float32 x 2 threads (micro-batches of 1024 tokens)" in line  # its own
    assert "; 1 engine float32 x 3 threads; eval x 3 threads" in line
    assert ("--trainer.dtype bf16-mixed" in line) == bf16  # the hint only where it pays
    mixed = plan(tmp_path, "examples/word_problems/config.yaml", "--trainer.dtype", "bf16-mixed")
    assert "trainer bf16-mixed" in mixed and "--trainer.dtype" not in mixed


def test_engine_actors_are_the_engines_and_rollout_actors_are_not(tmp_path):
    line = plan(tmp_path, "examples/arith/config.yaml", "--rollout.num-actors", "2",
                "--rollout.engine.serve", "actor", "--update-weight-transport", "disk",
                "--eval-interval", "0")  # fmt: skip
    assert "2 engines float32" in line and "eval" not in line
