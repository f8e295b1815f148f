"""Build the arithmetic demo's starting checkpoint: a tiny Qwen2 warmed up by ``asyncrl sft``.

``python examples/arith/make_model.py`` (from the repository root) does, in order:

1. writes the data with ``make_data.py`` (``examples/arith/data/``);
2. builds the character tokenizer and a random-init Qwen2 from ``--seed`` and saves them
   to ``<work-dir>/init``;
3. runs the real CLI, ``asyncrl sft``, on ``data/sft.jsonl`` into ``<work-dir>/sft``;
4. copies the result (``config.json``, ``generation_config.json``, ``model.safetensors``)
   and the tokenizer files to ``examples/arith/model/``.

The SFT budget is deliberately small, and the loss is label-smoothed (``--label-smoothing``,
0.1): greedy decoding gets about half the sums right, while sampling at T = 1 slips on
about one token in ten. GRPO's gain on the demo is mostly learning not to slip (see
README.md). Every step is seeded, so a rerun on the same machine gives the same weights.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # make_data and char_tokenizer sit next to this script

#: Files of the shipped checkpoint; anything else the SFT run wrote stays in the work dir.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")


def build_init(directory: Path, args: argparse.Namespace, tokenizer: Any = None) -> int:
    """Save ``tokenizer`` (default: the character tokenizer) and a seeded random Qwen2 to
    ``directory``; returns its size. ``args.max_len`` (default 256) sets its positions."""
    import torch
    from char_tokenizer import build_char_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = tokenizer or build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=getattr(args, "max_len", 256),
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def sft_command(
    init: Path, out: Path, args: argparse.Namespace, data: Path = HERE / "data" / "sft.jsonl"
) -> list[str]:
    """The ``asyncrl sft`` command line on ``data``: AdamW, linear warmup, cosine decay to
    10 %."""
    steps = args.epochs * -(-args.num_sft // args.batch_size)
    exe = Path(sys.executable).with_name("asyncrl")
    return [
        str(exe) if exe.exists() else "asyncrl",
        "sft",
        "--model",
        str(init),
        "--data",
        str(data),
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--seed",
        str(args.seed),
        "--lr",
        str(args.lr),
        "--weight-decay",
        "0.01",
        "--lr-warmup-iters",
        str(min(getattr(args, "warmup", 100), steps // 10)),
        "--trainer.lr-schedule",
        "cosine",
        "--trainer.total-steps",
        str(steps),
        "--trainer.min-lr-ratio",
        "0.1",
        "--trainer.seed",
        str(args.seed),
        "--max-len",
        str(getattr(args, "max_len", 256)),
        "--label-smoothing",
        str(args.label_smoothing),
        "--output-dir",
        str(out),
    ]


def main() -> None:
    """Parse flags, then data -> init -> sft -> copy; prints the timings."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("runs/arith-sft"))
    parser.add_argument("--dest", type=Path, default=HERE / "model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--num-sft", type=int, default=64000, help="SFT rows to generate")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--shortcut", type=float, default=0.5, help="make_data.py --shortcut: direct-answer share"
    )
    parser.add_argument(
        "--label-smoothing", type=float, default=0.1, help="asyncrl sft --label-smoothing"
    )
    parser.add_argument(
        "--noise", type=float, default=0.0, help="make_data.py --noise: wrong-answer share"
    )
    args = parser.parse_args()

    subprocess.run(
        [
            sys.executable,
            str(HERE / "make_data.py"),
            "--seed",
            str(args.seed),
            "--num-sft",
            str(args.num_sft),
            "--shortcut",
            str(args.shortcut),
            "--noise",
            str(args.noise),
        ],
        check=True,
    )
    init, out = args.work_dir / "init", args.work_dir / "sft"
    num_params = build_init(init, args)
    print(f"init: {num_params:,} parameters -> {init}")
    command = sft_command(init, out, args)
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True)
    seconds = time.perf_counter() - start
    print(f"sft: {seconds:.0f} s")

    shutil.rmtree(args.dest, ignore_errors=True)
    args.dest.mkdir(parents=True)
    for name in MODEL_FILES:
        shutil.copy2(out / "model" / name, args.dest / name)
    for path in init.iterdir():
        if path.name.startswith("tokenizer") or path.suffix == ".jinja":
            shutil.copy2(path, args.dest / path.name)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    print(f"copied to {args.dest} (last step {last['step']}, loss {last['loss']:.4f})")


if __name__ == "__main__":
    main()
