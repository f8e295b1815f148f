"""The megatron trainer against the torch trainer, side by side on the same batch (issue 10).

Both train the same random-init Qwen2 (``--size``: ``30m``, bench/trainer.py's shape, or
``0.5b``, Qwen2-0.5B's) on the same long-tail GRPO batch with the same token budget; the
steps alternate (one megatron, one torch) after a warm-up step each, and the medians of
``--steps`` are compared. Tokens/s = real tokens / step seconds. MFU (CUDA only) counts
6 N FLOPs per token (forward and backward; the old log-probs come from that forward, so
no other pass runs without a reference model; the attention's FLOPs are left out)
against the GPU's dense bf16 peak.

``.venv/bin/python bench/train_backends.py --device cuda --size 0.5b`` on a GPU (bf16) writes
``bench/results/train_backends.json``. On the CPU it runs megatron-core under the tests' shim
(``tests/megatron_shim.py``), whose Python dispatch on every torch call slows megatron:
that ratio says the path works, not how fast megatron is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.policies.config import PolicyConfig
from asyncrl.trainers.backends import create_trainer
from asyncrl.trainers.config import TrainerConfig
from bench.trainer import long_tail_batch

SIZES = {
    "30m": {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512},
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936},
}  # fmt: skip
#: Dense bf16 peak FLOP/s by GPU name (the vendors' figures, without sparsity).
PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def save_model(directory: Path, size: str) -> int:
    torch.manual_seed(0)
    cfg = Qwen2Config(**SIZES[size], max_position_embeddings=4096, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def peak_flops(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK.items() if k in name), None)


def timed(trainer: Any, batch: Any, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    trainer.train_step(batch)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def compare(args: argparse.Namespace, model_dir: Path, params: int) -> dict[str, Any]:
    batch = long_tail_batch(args.groups, 4, args.median, args.tail)
    tokens = sum(len(s.prompt_tokens) + s.response_length for s in batch.samples)
    common = {
        "model_path": str(model_dir),
        "max_tokens_per_microbatch": args.budget,
        "device": args.device,
        "dtype": "bf16-mixed" if args.device.startswith("cuda") else "float32",
        "lr": 1e-6,
    }
    trainers = {
        backend: create_trainer(TrainerConfig(**common, backend=backend), PolicyConfig())
        for backend in ("megatron", "torch")
    }
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for trainer in trainers.values():  # warm-up: allocator, kernels, threads
        timed(trainer, batch, args.device)
    for _ in range(args.steps):
        for backend, trainer in trainers.items():
            times[backend].append(timed(trainer, batch, args.device))
    peak = peak_flops(args.device)
    out: dict[str, Any] = {"tokens": tokens, "sequences": len(batch.samples), "params": params}
    for backend, seconds in times.items():
        step = statistics.median(seconds)
        out[backend] = {"step_s": step, "tokens_per_s": tokens / step, "steps_s": seconds}
        if peak:
            out[backend]["mfu"] = 6 * params * tokens / step / peak
    out["ratio_tokens_per_s"] = out["megatron"]["tokens_per_s"] / out["torch"]["tokens_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="30m")
    ap.add_argument("--groups", type=int, default=8, help="groups of 4 samples in the batch")
    ap.add_argument("--median", type=int, default=48, help="median response length")
    ap.add_argument("--tail", type=float, default=8.0, help="p99 / median of response length")
    ap.add_argument("--budget", type=int, default=2048, help="tokens per micro-batch")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per backend")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="bench/results/train_backends.json")
    args = ap.parse_args()
    hf_logging.disable_progress_bar()
    shim: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if not args.device.startswith("cuda"):
        from tests.megatron_shim import cpu_megatron

        shim = cpu_megatron()
    with tempfile.TemporaryDirectory() as tmp, shim:
        params = save_model(Path(tmp), args.size)
        result = compare(args, Path(tmp), params)
    result |= {"device": torch.cuda.get_device_name() if args.device.startswith("cuda")
               else "cpu (megatron under the test shim)", "size": args.size}  # fmt: skip
    m, t = result["megatron"], result["torch"]
    mfu = f", MFU megatron {m['mfu']:.1%} torch {t['mfu']:.1%}" if "mfu" in m else ""
    print(
        f"{result['device']}: {params / 1e6:.0f}M params, {result['sequences']} seqs, "
        f"{result['tokens']} tokens a step\n  megatron {m['tokens_per_s']:.0f} tok/s "
        f"({m['step_s']:.3f} s), torch {t['tokens_per_s']:.0f} tok/s ({t['step_s']:.3f} s), "
        f"ratio {result['ratio_tokens_per_s']:.2f}{mfu}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
