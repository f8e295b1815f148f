"""Build the calculator agent's starting checkpoint: a tiny Qwen2 warmed up on tool-use traces.

``python examples/calculator_agent/make_model.py`` (from the repository root):

1. writes the data with ``make_data.py`` (``--tool-share`` of the SFT traces call the
   calculator, the rest answer at once);
2. builds ``tool_tokenizer.py``'s tokenizer and a seeded random-init Qwen2 (the arithmetic
   demo's shape: hidden 128, 4 layers) into ``<work-dir>/init``;
3. runs the real CLI, ``asyncrl sft``, on ``data/sft.jsonl`` (the loss covers the assistant
   turns only) into ``<work-dir>/sft``;
4. copies the weights and the tokenizer files to ``examples/calculator_agent/model/``.

The helpers are the arithmetic demo's (``examples/arith/make_model.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "arith")]

from tool_tokenizer import build_tool_tokenizer  # noqa: E402


def _arith() -> ModuleType:
    """The arithmetic demo's ``make_model.py`` (same file name as this one)."""
    spec = importlib.util.spec_from_file_location(
        "arith_make_model", HERE.parent / "arith" / "make_model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


arith = _arith()


def main() -> None:
    """Parse flags, then data -> init -> sft -> copy; prints the timings."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("runs/calculator-sft"))
    parser.add_argument("--dest", type=Path, default=HERE / "model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=256, help="positions; longest trace")
    parser.add_argument("--num-sft", type=int, default=32000, help="SFT traces to generate")
    parser.add_argument("--tool-share", type=float, default=0.6, help="traces using the tool")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument(
        "--from", dest="start", type=Path, help="continue from this checkpoint, not random init"
    )
    parser.add_argument("--warmup", type=int, default=100, help="learning-rate warmup steps")
    args = parser.parse_args()

    # The train and test sets never change (make_data's default seed); --seed picks the
    # SFT traces, the initial weights and the SFT order.
    data = [sys.executable, str(HERE / "make_data.py"), "--sft-seed", str(args.seed)]
    data += ["--num-sft", str(args.num_sft), "--tool-share", str(args.tool_share)]
    subprocess.run(data, check=True)
    init, out = args.work_dir / "init", args.work_dir / "sft"
    if args.start is not None:  # a second stage: the previous checkpoint, copied first
        shutil.rmtree(init, ignore_errors=True)
        shutil.copytree(args.start, init)
    else:
        num_params = arith.build_init(init, args, build_tool_tokenizer())
        print(f"init: {num_params:,} parameters -> {init}")
    command = arith.sft_command(init, out, args, HERE / "data" / "sft.jsonl")
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True)
    print(f"sft: {time.perf_counter() - start:.0f} s")

    shutil.rmtree(args.dest, ignore_errors=True)
    args.dest.mkdir(parents=True)
    for name in arith.MODEL_FILES:
        shutil.copy2(out / "model" / name, args.dest / name)
    for path in init.iterdir():
        if path.name.startswith("tokenizer") or path.suffix == ".jinja":
            shutil.copy2(path, args.dest / path.name)
    print(f"copied to {args.dest}")


if __name__ == "__main__":
    main()
