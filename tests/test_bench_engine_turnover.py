"""bench/engine_turnover.py: the same eval from two checkouts, timed side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "engine_turnover.py"


def test_another_folder_than_a_checkout_is_refused_before_anything_runs(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--against", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and "not a checkout of asyncrl" in done.stderr
    assert not (tmp_path / "bench").exists()


def test_two_runs_of_one_checkout_sample_the_same_replies(tmp_path, smollm2_dir):
    out = tmp_path / "turnover.json"
    flags = ["--rows", "2", "--samples", "2", "--max-running", "2", "--against", str(ROOT),
             "--out", str(out)]  # fmt: skip
    subprocess.run([sys.executable, SCRIPT, *flags], check=True, cwd=ROOT, timeout=300)
    runs = json.loads(out.read_text())["runs"]
    (this,), (other,) = runs["this"], runs["against"]
    assert this["response_len"] == other["response_len"] > 0  # the same seed's tokens
    assert this["pass@1"] == other["pass@1"]
    assert "this_over_against" in json.loads(out.read_text())["summary"]
