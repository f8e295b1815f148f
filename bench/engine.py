"""Embedded engine against Hugging Face ``generate`` on a long-tail workload, one run.

    python bench/engine.py [--requests 64] [--batch 16] [--median 24] [--tail 16]
                           [--threads 2] [--device cpu] [--out FILE]

A random-init Qwen2 of about 30M parameters (hidden 512, 8 layers, 8 heads / 4 KV,
intermediate 2048, vocab 512, fp32 on CPU, bf16 on CUDA) serves ``--requests`` prompts of
16-64 tokens whose response lengths are lognormal with the given median and a p99 about
``--tail`` times the median (EOS ignored, so each request generates exactly its length).

- **engine**: every request submitted at once to ``TorchEngine`` with ``--batch`` running
  sequences at most; requests join the batch as others finish (continuous batching).
- **hf**: ``model.generate`` in static batches of ``--batch`` requests in arrival order,
  left-padded, each batch run to its longest request (what a static batch costs).

Rate = completed (requested) tokens / wall seconds; sampling at temperature 1 in both.
Target: engine >= 1.5x hf. Writes JSON (default ``bench/results/engine.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncrl.engines.base import GenerateRequest, SamplingParams
from asyncrl.engines.torch_engine import TorchEngine


def build_model(device: str) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=512, max_position_embeddings=4096,
        tie_word_embeddings=True, initializer_range=0.2,
    )  # fmt: skip
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return Qwen2ForCausalLM(cfg).to(device, dtype).eval()


def workload(n: int, median: int, tail: float, seed: int = 0) -> list[tuple[list[int], int]]:
    """Prompts and response lengths; lognormal sigma chosen so p99 / median = ``tail``."""
    rng = np.random.default_rng(seed)
    sigma = np.log(tail) / 2.326  # z of the 99th percentile
    lengths = np.clip(rng.lognormal(np.log(median), sigma, n), 1, None).astype(int)
    prompts = [rng.integers(4, 500, rng.integers(16, 65)).tolist() for _ in range(n)]
    return list(zip(prompts, lengths.tolist(), strict=True))


async def run_engine(model: Qwen2ForCausalLM, work: list, batch: int) -> tuple[float, int]:
    engine = TorchEngine(model, max_running=batch)
    task = asyncio.create_task(engine.run())

    async def one(i: int, ids: list[int], n: int) -> int:
        params = SamplingParams(max_new_tokens=n, ignore_eos=True, sampling_seed=i)
        request = GenerateRequest(rid=f"r{i}", input_ids=ids, sampling=params)
        outputs = [out async for out in engine.generate(request)]
        assert len(outputs[-1].output_ids) == n
        return n

    await one(-1, work[0][0], 4)  # warm-up
    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, ids, n) for i, (ids, n) in enumerate(work))))
    elapsed = time.perf_counter() - t0
    task.cancel()
    return tokens / elapsed, tokens


def run_hf(model: Qwen2ForCausalLM, work: list, batch: int) -> tuple[float, int]:
    device = next(model.parameters()).device
    model.generate(torch.tensor([work[0][0]], device=device), max_new_tokens=4, do_sample=True)
    t0, tokens = time.perf_counter(), 0
    for start in range(0, len(work), batch):
        chunk = work[start : start + batch]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(chunk):
            ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
        longest = max(n for _, n in chunk)
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                max_new_tokens=longest, min_new_tokens=longest, pad_token_id=0,
            )  # fmt: skip
        tokens += sum(n for _, n in chunk)  # only requested tokens count as completed
    return tokens / (time.perf_counter() - t0), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--median", type=int, default=24)
    ap.add_argument("--tail", type=float, default=16.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="bench/results/engine.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.device)
    work = workload(args.requests, args.median, args.tail)
    lengths = np.array([n for _, n in work])
    p50, p99 = np.percentile(lengths, 50), np.percentile(lengths, 99)
    if p99 < 8 * p50:
        raise SystemExit(f"workload tail p99/p50 = {p99 / p50:.1f} < 8: raise --tail")
    engine_rate, tokens = asyncio.run(run_engine(model, work, args.batch))
    hf_rate, _ = run_hf(model, work, args.batch)
    params = sum(p.numel() for p in model.parameters())
    print(f"model {params / 1e6:.1f}M params on {args.device}; {args.requests} requests, "
          f"{tokens} tokens, length p50 {p50:.0f} p99 {p99:.0f} ({p99 / p50:.1f}x), "
          f"batch {args.batch}, {args.threads} threads")  # fmt: skip
    print(f"{'':<34}{'tokens/s':>10}")
    print(f"{'HF generate, static batches':<34}{hf_rate:>10,.0f}")
    print(f"{'TorchEngine, continuous batching':<34}{engine_rate:>10,.0f}")
    ratio = engine_rate / hf_rate
    print(f"{'ratio (target >= 1.5)':<34}{ratio:>10.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"bench": "engine", "device": args.device, "params": params, "tokens": tokens,
              "p50": p50, "p99": p99, "batch": args.batch, "threads": args.threads,
              "hf_tokens_per_s": hf_rate, "engine_tokens_per_s": engine_rate,
              "ratio": ratio, "target": 1.5}  # fmt: skip
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
