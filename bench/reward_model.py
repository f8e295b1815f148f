"""The reward model's batching against one forward a pair, side by side, on the real model.

    python bench/reward_model.py [--model models/smollm2-135m-instruct] [--pairs 64]
                                 [--batch 16] [--threads 2] [--out FILE]

SmolLM2-135M-Instruct's backbone with a classification head that transformers
initialises (the same seed in both systems; label 0 is the score): the scores mean
nothing, the compute is a real 135M reward model's. The pairs are word problems of
``examples/word_problems/data/test.jsonl`` with answers of 20-60 words, rendered by the
chat template. Systems, each timed after one
warm-up pass over the first 8 pairs:

- **batched**: ``RewardModel`` (``rollout/reward_model.py``) with every pair submitted at
  once, ``--batch`` pairs a forward;
- **one-by-one**: a plain transformers forward of each pair alone, as a reward function
  that calls the model per sample does.

Prints pairs/s of each and the ratio; checks the two agree on every score (1e-4); writes
JSON (default ``bench/results/reward_model.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from asyncrl.rollout.reward_config import RewardModelConfig
from asyncrl.rollout.reward_model import RewardModel

DATA = Path(__file__).resolve().parents[1] / "examples/word_problems/data/test.jsonl"
WORDS = "so the total is then we add each and take away of left over".split()


def pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    rows = [json.loads(x) for x in DATA.read_text().splitlines()[:n]]
    answer = (" ".join(rng.choices(WORDS, k=rng.randint(20, 60))) for _ in rows)
    return [(r["prompt"], f"{a} #### {r['label']}") for r, a in zip(rows, answer, strict=True)]


async def batched(cfg: RewardModelConfig, work: list[tuple[str, str]]) -> tuple[float, list]:
    async with RewardModel(cfg) as rm:
        await rm.score_many([p for p, _ in work[:8]], [r for _, r in work[:8]])
        start = time.perf_counter()
        scores = await rm.score_many([p for p, _ in work], [r for _, r in work])
        return time.perf_counter() - start, [rm.text(p, r) for p, r in work], scores


def one_by_one(path: str, texts: list[str]) -> tuple[float, list[float]]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    if tokenizer.pad_token_id is None:  # as RewardModel does
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id

    def score(text: str) -> float:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            return float(model(input_ids=ids).logits[0, 0])

    for text in texts[:8]:
        score(text)
    start = time.perf_counter()
    scores = [score(t) for t in texts]
    return time.perf_counter() - start, scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/reward_model.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # the same head in both systems (transformers draws it at load)
    work = pairs(args.pairs)
    cfg = RewardModelConfig(path=args.model, batch_size=args.batch, batch_wait_ms=5,
                            threads=args.threads)  # fmt: skip
    t_batched, texts, got = asyncio.run(batched(cfg, work))
    torch.manual_seed(0)
    t_single, want = one_by_one(args.model, texts)
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    result = {
        "model": args.model, "pairs": args.pairs, "batch": args.batch, "threads": args.threads,
        "batched_pairs_per_s": args.pairs / t_batched,
        "one_by_one_pairs_per_s": args.pairs / t_single,
        "ratio": t_single / t_batched, "max_abs_score_difference": worst,
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    if worst > 1e-4:
        raise SystemExit(f"the systems disagree on a score by {worst}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
