"""What a JSON schema costs the embedded engine, on the real model.

32 concurrent chat requests, 64 new tokens each, run side by side (alternating, medians of
``--repeats``): free, and under a JSON schema whose string cannot close within 64 tokens
(so both arms decode the same number of tokens and the difference is the mask: filling
each row's token bitmask with xgrammar and applying it). Also: a schema's compile time,
cold and cached, and the mask's cost per row per step.

    .venv/bin/python bench/grammar.py [--model DIR] [--repeats 3]

prints the figures and writes ``bench/results/grammar.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples/word_problems/data/train.jsonl"
#: A string longer than 64 tokens can hold: every request decodes its whole budget.
LONG = {
    "type": "object",
    "properties": {"reason": {"type": "string", "minLength": 2000}, "answer": {"type": "integer"}},
    "required": ["reason", "answer"],
}


def prompts(tokenizer: Any, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:n]]
    out = []
    for row in rows:
        messages = [*row["prompt"], {"role": "user", "content": "Answer as JSON."}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


async def arm(engine: Any, ids: list[list[int]], tag: str, **sampling: Any) -> dict[str, float]:
    from asyncrl.engines.base import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=64, temperature=1.0, **sampling)

    async def one(i: int, prompt: list[int]) -> int:
        request = GenerateRequest(rid=f"{tag}{i}", input_ids=prompt, sampling=params)
        outs = [o async for o in engine.generate(request)]
        return len(outs[-1].output_ids)

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(ids))))
    wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def compile_times(engine: Any, schema: str) -> dict[str, float]:
    from asyncrl.engines.torch.grammar import Grammars

    grammars = Grammars(
        engine.tokenizer, engine.grammars.vocab_size, engine.eos_ids, any_whitespace=False
    )
    start = time.perf_counter()
    grammars.matcher("json_schema", "{}")  # the tokenizer's tables, once per engine
    setup = time.perf_counter() - start
    start = time.perf_counter()
    grammars.matcher("json_schema", schema)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(20):
        grammars.matcher("json_schema", schema)
    cached = (time.perf_counter() - start) / 20
    return {"tokenizer_setup_s": setup, "compile_cold_s": cold, "compile_cached_s": cached}


def mask_cost(engine: Any, schema: str, rows: int = 32) -> float:
    """Seconds per row per step to fill and apply the bitmask of ``rows`` matchers."""
    from asyncrl.engines.torch.grammar import mask_rows

    matchers = [engine.grammars.matcher("json_schema", schema) for _ in range(rows)]
    logits = torch.randn(rows, engine.grammars.vocab_size)
    start = time.perf_counter()
    for _ in range(20):
        mask_rows(logits, matchers)
    return (time.perf_counter() - start) / 20 / rows


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from asyncrl.engines.torch.engine import TorchEngine

    engine = TorchEngine.from_pretrained(args.model, json_any_whitespace=False)
    task = asyncio.create_task(engine.run())
    ids = prompts(engine.tokenizer, 32)
    schema = json.dumps(LONG)
    await arm(engine, ids[:4], "warm", ignore_eos=True)
    runs: dict[str, list[dict[str, float]]] = {"free": [], "json_schema": []}
    for r in range(args.repeats):
        runs["free"].append(await arm(engine, ids, f"f{r}-", ignore_eos=True))
        runs["json_schema"].append(await arm(engine, ids, f"j{r}-", json_schema=schema))
    task.cancel()
    median = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in runs.items()}
    return {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "concurrent": 32,
        "runs": runs,
        "tokens_per_s": median,
        "ratio_json_over_free": median["json_schema"] / median["free"],
        "mask_s_per_row_step": mask_cost(engine, schema),
        **compile_times(engine, schema),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models/smollm2-135m-instruct"))
    ap.add_argument("--repeats", type=int, default=3)
    result = asyncio.run(main(ap.parse_args()))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    out = ROOT / "bench/results/grammar.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
