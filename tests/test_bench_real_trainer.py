"""bench/real_trainer.py: TRL's side trains on exactly the samples asyncrl's side does."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "bench_real_trainer", ROOT / "bench" / "real_trainer.py"
)
assert _spec is not None and _spec.loader is not None
real_trainer = importlib.util.module_from_spec(_spec)
sys.modules["bench_real_trainer"] = real_trainer
_spec.loader.exec_module(real_trainer)


def rows(inputs: dict[str, torch.Tensor]) -> list[tuple[list[int], list[int]]]:
    """Each row's unpadded (prompt, completion) ids."""
    out = []
    for i in range(inputs["prompt_ids"].size(0)):
        p = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist()
        c = inputs["completion_ids"][i][inputs["completion_mask"][i].bool()].tolist()
        out.append((p, c))
    return out


def test_trl_batches_hold_the_same_tokens_padded_as_trl_pads_them() -> None:
    args = argparse.Namespace(groups=2, prompt=6, response=5, lengths="varied")
    batch = real_trainer.batch(0, args)
    samples = [s for g in batch.groups for s in g.samples]
    inputs = real_trainer.trl_inputs(batch)
    expected = [(s.prompt_tokens.tolist(), s.response_tokens.tolist()) for s in samples]
    assert rows(inputs) == expected
    assert len({len(c) for _, c in expected}) > 1  # varied lengths: padding is exercised
    # prompts are left-padded, completions right-padded
    assert bool(inputs["prompt_mask"][:, -1].all()) and bool(inputs["completion_mask"][:, 0].all())
    parts = real_trainer.trl_split(inputs, 4)
    assert [r for part in parts for r in rows(part)] == expected
    for part in parts:  # each per-device batch trimmed to its own longest row, no wider
        assert bool(part["prompt_mask"][:, 0].any()) and bool(part["completion_mask"][:, -1].any())
        assert part["num_items_in_batch"] == inputs["completion_mask"].sum()
    # GRPO advantages per group of 8: zero mean, and the rewards' order
    adv = inputs["advantages"].view(-1, 8)
    assert torch.allclose(adv.mean(1), torch.zeros(2), atol=1e-6)
    assert bool((adv[:, 1] > adv[:, 0]).all())
