"""bench/lend_cores.py: the same job with the trainer's cores lent and not, really run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_train import write_prompts
from tests.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def tiny_job(tmp_path: Path) -> tuple[Path, list[str]]:
    """A config file and the flags of a tiny job: one rollout actor, 2 x 2 samples a step."""
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    config = tmp_path / "job.yaml"
    config.write_text("name: tiny\n")
    flags = ["--hf-checkpoint", str(tmp_path / "model"), "--prompt-data",
             str(tmp_path / "prompts.jsonl"), "--rollout.num-actors", "1",
             "--rollout.sampling", '{"temperature": 1.0, "max_new_tokens": 6}',
             "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]  # fmt: skip
    return config, flags


def test_both_ways_run_alternated_and_only_the_loan_lends(tmp_path: Path) -> None:
    config, flags = tiny_job(tmp_path)
    flags += ["--rollout.max-groups", "4", "--runtime.heartbeat-interval", "0.5"]
    out = tmp_path / "lend.json"
    command = [sys.executable, str(ROOT / "bench" / "lend_cores.py"), "--config", str(config),
               "--steps", "3", "--repeats", "2", "--no-warmup", "--out", str(out), "--",
               *flags]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, check=True, timeout=600, capture_output=True,
                          text=True)  # fmt: skip
    order = [line.split()[0] for line in done.stdout.splitlines() if "/2)" in line]
    assert order == ["off", "on", "on", "off"], done.stdout  # alternated
    result = json.loads(out.read_text())
    for run in result["runs"]["off"]:
        assert run["lent_share"] == 0.0
        assert 0 < run["first_step_s"] < run["wall_s"] and run["samples/s"] > 0
    # The trainer waits for its first batch, so with the loan some engine steps are lent.
    assert all(0 < run["lent_share"] <= 1 for run in result["runs"]["on"])
    assert result["ratios"]["wall_s"] > 0 and "accuracy" not in result["medians"]["on"]


def test_any_one_setting_runs_off_and_on(tmp_path: Path) -> None:
    """``--setting`` A/Bs another flag, and the flag reaches each run's config."""
    config, flags = tiny_job(tmp_path)
    out = tmp_path / "ab.json"
    command = [sys.executable, str(ROOT / "bench" / "lend_cores.py"), "--config", str(config),
               "--steps", "3", "--repeats", "1", "--no-warmup", "--out", str(out),
               "--setting", "trainer.share-prompts", "false", "true", "--", *flags]  # fmt: skip
    subprocess.run(command, cwd=ROOT, check=True, timeout=600, capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert result["setting"] == ["trainer.share-prompts", "false", "true"]
    assert result["runs"]["off"][0]["samples/s"] > 0 and result["runs"]["on"][0]["samples/s"] > 0
    # The value reaches the job's config: an invalid "on" value stops the bench, named.
    command[command.index("true")] = "sometimes"
    bad = subprocess.run(command, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert bad.returncode != 0 and "share_prompts" in bad.stderr, bad.stderr[-2000:]
