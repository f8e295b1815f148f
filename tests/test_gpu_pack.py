"""``bench/gpu_pack.py``: a model split into parts for the lent GPU's 64 MiB calls comes
back whole, its matrices within int8's rounding and the rest exact in bf16."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def pack(*args: object) -> str:
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_pack.py"), *map(str, args)]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def test_a_packed_model_unpacks_within_int8_rounding(tmp_path: Path):
    build_tiny_model(tmp_path / "model")
    args = ["--first-mb", 0.03, "--chunk-mb", 0.05, "--min-numel", 8192]
    out = pack("pack", tmp_path / "model", tmp_path / "parts", *args)
    parts = sorted((tmp_path / "parts").glob("part*"))
    assert len(parts) >= 3 and f"in {len(parts)} parts" in out
    assert parts[0].stat().st_size == 30_000
    assert max(p.stat().st_size for p in parts) == 50_000
    pack("unpack", tmp_path / "parts", tmp_path / "back")
    want, got = (
        load_file(tmp_path / "model" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert want.keys() == got.keys()
    rounded = 0
    for name, w in want.items():
        g = got[name].float()
        assert got[name].dtype == torch.bfloat16
        if w.dim() == 2 and w.numel() >= 8192:  # int8 rows: at most half a step off
            step = w.abs().amax(dim=1, keepdim=True) / 127
            assert ((g - w).abs() <= step / 2 + w.abs() / 128).all(), name
            rounded += not torch.equal(g, w.to(torch.bfloat16).float())
        else:
            assert torch.equal(g, w.to(torch.bfloat16).float()), name
    big = sum(w.dim() == 2 and w.numel() >= 8192 for w in want.values())
    assert rounded == big >= 3  # the embedding and the MLP matrices went as int8
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (
        tmp_path / "model" / "tokenizer.json"
    ).read_bytes()
