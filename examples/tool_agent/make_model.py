"""Build the tool agent's starting checkpoint: SmolLM2-135M-Instruct, warmed up on tool traces.

``python examples/tool_agent/make_model.py`` (``make tool-agent-model``; from the
repository root, after ``make smollm2``):

1. writes the data with ``make_data.py`` (SFT traces, RL prompts, the test set);
2. makes ``<work-dir>/base``: the real model's folder with ``chat_template.jinja``, the
   tool-calling chat template SmolLM2 lacks (its weights are linked, not copied);
3. runs the real CLI, ``asyncrl sft``, on ``data/sft.jsonl`` (loss on the assistant turns)
   into ``<work-dir>/sft``, and links ``<work-dir>/sft/model`` at ``--dest``.

It prints the time each stage took.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BASE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def make_base(real: Path, base: Path) -> None:
    """``base``: ``real``'s files with this example's chat template; weights linked."""
    if not (real / "model.safetensors").exists():
        raise SystemExit(f"{real} has no model.safetensors: run `make smollm2` first")
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    for name in BASE_FILES:
        shutil.copy(real / name, base / name)
    (base / "model.safetensors").symlink_to((real / "model.safetensors").resolve())
    shutil.copy(HERE / "chat_template.jinja", base / "chat_template.jinja")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", type=Path, default=ROOT / "models/smollm2-135m-instruct")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "runs/tool-agent-sft")
    parser.add_argument("--dest", type=Path, default=ROOT / "models/tool-agent-sft")
    parser.add_argument("--num-sft", type=int, default=160)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0, help="SFT traces and their order")
    args = parser.parse_args()
    if args.dest.exists() and not args.dest.is_symlink():
        raise SystemExit(f"--dest {args.dest} is a folder, not this script's link: move it away")
    bin_dir = Path(sys.executable).parent
    start = time.perf_counter()
    subprocess.run([sys.executable, str(HERE / "make_data.py"), "--num-sft", str(args.num_sft),
                    "--sft-seed", str(args.seed)], check=True)  # fmt: skip
    base, out = args.work_dir / "base", args.work_dir / "sft"
    make_base(args.real, base)
    sft = [str(bin_dir / "asyncrl"), "sft", "--model", str(base),
           "--data", str(HERE / "data/sft.jsonl"), "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--lr", str(args.lr),
           "--seed", str(args.seed), "--output-dir", str(out)]  # fmt: skip
    sft_start = time.perf_counter()
    subprocess.run(sft, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    print(f"sft: {time.perf_counter() - sft_start:.0f} s")
    args.dest.parent.mkdir(parents=True, exist_ok=True)
    if args.dest.is_symlink():
        args.dest.unlink()
    args.dest.symlink_to((out / "model").resolve())
    print(f"{args.dest} -> {out / 'model'} ({time.perf_counter() - start:.0f} s in all)")


if __name__ == "__main__":
    main()
