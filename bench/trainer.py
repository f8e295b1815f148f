"""Trainer benchmarks, side by side in one run (issue 5):

1. Packing vs padding: ``TorchTrainer.train_step`` (GRPO, decoupled PPO: one no-grad
   recompute pass plus forward/backward) on the same long-tail batch with
   ``packing=True`` (each micro-batch is one row, block-diagonal attention) and
   ``packing=False`` (each micro-batch right-padded to its longest sequence), same model,
   token budget and seed. Tokens/s = real (unpadded) tokens / step seconds, median of
   ``--steps`` alternating steps after a warm-up. Ratio = packed / padded.
2. Weight publish of the same ~30M model to 2 subscriber processes against raw pyzmq
   (``bench/weights_publish.py``).

``.venv/bin/python bench/trainer.py`` (``make bench-trainer``) prints both and writes
``bench/results/trainer.json``. With ``--device cuda`` the step runs on the GPU (bf16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.policies.config import PolicyConfig
from asyncrl.trainers.torch_trainer import TorchTrainer
from asyncrl.types import Group, Prompt, Sample, SampleStatus, TrainBatch
from bench import weights_publish


def save_model(directory: Path) -> int:
    """A random-init ~30M Qwen2 (bench/engine.py's shape) saved as an HF directory."""
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=512, max_position_embeddings=4096,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def long_tail_batch(groups: int, n: int, median: int, tail: float, seed: int = 0) -> TrainBatch:
    """``groups`` x ``n`` samples; response lengths lognormal with p99 / median = ``tail``."""
    rng = np.random.default_rng(seed)
    sigma = np.log(tail) / 2.326  # z of the 99th percentile
    out = []
    for g in range(groups):
        ids = rng.integers(4, 500, 32).tolist()
        prompt = Prompt(uid=f"p{g}", prompt_id=f"p{g}", prompt="", packed_prompt=_pack(ids))
        samples = []
        for j in range(n):
            length = int(np.clip(rng.lognormal(np.log(median), sigma), 4, 8 * median))
            s = Sample.for_prompt(prompt, group_id=f"g{g}", index=j, version=0)
            s.temperature = 1.0
            logprobs = (-rng.random(length) * 3).tolist()
            s.append_response(rng.integers(4, 500, length).tolist(), logprobs, 0)
            s.status, s.reward = SampleStatus.COMPLETED, float(rng.random())
            samples.append(s)
        out.append(Group(uid=f"g{g}", prompt_uid=f"p{g}", samples=samples))
    return TrainBatch(batch_id=0, step=0, groups=out)


def _pack(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype=np.int32).tobytes()


def step_seconds(trainer: TorchTrainer, batch: TrainBatch) -> float:
    start = time.perf_counter()
    trainer.train_step(batch)
    return time.perf_counter() - start


def packing_vs_padding(args: argparse.Namespace, model_dir: Path) -> dict[str, float]:
    batch = long_tail_batch(args.groups, 4, args.median, args.tail)
    lengths = [len(s.prompt_tokens) + s.response_length for s in batch.samples]
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    trainers = {
        layout: TorchTrainer(
            TorchTrainer.Config(
                model_path=str(model_dir),
                packing=layout == "packed",
                max_tokens_per_microbatch=args.budget,
                device=args.device,
                dtype=dtype,
                lr=1e-6,
            ),
            PolicyConfig(),
        )
        for layout in ("packed", "padded")
    }
    times: dict[str, list[float]] = {"packed": [], "padded": []}
    for trainer in trainers.values():  # warm-up: allocator, kernels, threads
        step_seconds(trainer, batch)
    for _ in range(args.steps):
        for layout, trainer in trainers.items():
            times[layout].append(step_seconds(trainer, batch))
    tokens = sum(lengths)
    packed, padded = (statistics.median(times[k]) for k in ("packed", "padded"))
    return {
        "sequences": len(lengths),
        "tokens": tokens,
        "length_median": float(np.median(lengths)),
        "length_max": max(lengths),
        "packed_tokens_per_s": tokens / packed,
        "padded_tokens_per_s": tokens / padded,
        "ratio": padded / packed,
        "packed_step_s": packed,
        "padded_step_s": padded,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--groups", type=int, default=8, help="groups of 4 samples in the batch")
    ap.add_argument("--median", type=int, default=48, help="median response length")
    ap.add_argument("--tail", type=float, default=8.0, help="p99 / median of response length")
    ap.add_argument("--budget", type=int, default=2048, help="tokens per micro-batch")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    ap.add_argument("--versions", type=int, default=5, help="timed weight versions")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="bench/results/trainer.json")
    args = ap.parse_args()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        params = save_model(Path(tmp))
        packing = packing_vs_padding(args, Path(tmp))
    publish = weights_publish.run(args.versions)
    result = {"device": args.device, "params": params, "packing": packing, "publish": publish}
    print(
        f"train step, {packing['sequences']} seqs, {packing['tokens']} tokens "
        f"(median {packing['length_median']:.0f}, max {packing['length_max']}), {params / 1e6:.1f}M"
        f" params:\n  packed {packing['packed_tokens_per_s']:.0f} tok/s, padded "
        f"{packing['padded_tokens_per_s']:.0f} tok/s, ratio {packing['ratio']:.2f}\n"
        f"weight publish, {publish['bytes'] / 2**20:.0f} MiB to {publish['subscribers']} "
        f"subscriber processes:\n  raw pyzmq {publish['raw_s'] * 1e3:.0f} ms, asyncrl "
        f"{publish['asyncrl_s'] * 1e3:.0f} ms, ratio {publish['ratio']:.2f} (target >= 0.7)"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
