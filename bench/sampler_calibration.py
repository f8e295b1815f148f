"""Does the embedded engine draw each token from the distribution it reports? On the real model.

The engine samples ``--groups`` word problems x 4 at T = ``--temperature`` (up to 64 new
tokens, the example's settings), then HF's forward on its own copy of the model scores
every sampled token. For a token ``x`` drawn from ``p = softmax(z / T)``:

- the randomised probability integral transform ``F(x-) + V p(x)`` (V uniform) is
  uniform on [0, 1): its ten deciles should each hold a tenth of the tokens (a
  chi-square over them has 9 degrees of freedom: 27.9 is p = 0.001);
- ``E[log p(x)] = -H(p)``: the mean sampled log-prob equals the mean negative entropy;
- the reported log-prob equals HF's ``log p(x)`` (the trainer's recompute).

A draw from the wrong distribution with the right reported log-probs passes the last
check and the engine/trainer ``mismatch_kl`` but fails the first two.

    .venv/bin/python bench/sampler_calibration.py [--groups 16] [--model DIR]

prints the figures and writes ``bench/results/sampler_calibration.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples/word_problems/data/train.jsonl"


def prompts(tokenizer: Any, groups: int) -> list[list[int]]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:groups]]
    out = []
    for row in rows:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


async def sample(model_dir: str, ids: list[list[int]], temperature: float) -> list[Any]:
    from asyncrl.engines.base import GenerateRequest, SamplingParams
    from asyncrl.engines.torch.engine import TorchEngine

    engine = TorchEngine.from_pretrained(model_dir, max_running=64, seed="calibration")
    params = SamplingParams(max_new_tokens=64, temperature=temperature)

    async def one(rid: str, prompt: list[int]) -> Any:
        request = GenerateRequest(rid=rid, input_ids=prompt, sampling=params)
        return [out async for out in engine.generate(request)][-1]

    async with asyncio.TaskGroup() as tg:
        runner = tg.create_task(engine.run())
        outs = await asyncio.gather(
            *(one(f"{i}-{j}", p) for i, p in enumerate(ids) for j in range(4))
        )
        runner.cancel()
    return outs


def score(model: Any, prompt: list[int], out: Any, t: float, gen: torch.Generator) -> dict:
    """Per sampled token: HF's log p(x), -H(p), the PIT, and the engine's log-prob."""
    full = prompt + out.output_ids
    with torch.no_grad():
        logits = model(torch.tensor([full])).logits[0, len(prompt) - 1 : len(full) - 1]
    logp = torch.log_softmax(logits.double() / t, -1)
    x = torch.tensor(out.output_ids)[:, None]
    p, lx = logp.exp(), logp.gather(-1, x).squeeze(-1)
    below = p.cumsum(-1).gather(-1, x).squeeze(-1) - lx.exp()
    return {
        "logp": lx,
        "neg_entropy": (p * logp).sum(-1),
        "pit": below + torch.rand(len(x), generator=gen, dtype=torch.double) * lx.exp(),
        "reported": torch.tensor(out.logprobs, dtype=torch.double),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models/smollm2-135m-instruct"))
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = prompts(tokenizer, args.groups)
    outs = asyncio.run(sample(args.model, ids, args.temperature))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    rows = [score(model, ids[k // 4], o, args.temperature, gen) for k, o in enumerate(outs)]
    cat = {key: torch.cat([r[key] for r in rows]) for key in rows[0]}
    n = len(cat["pit"])
    deciles = torch.histc(cat["pit"].float(), bins=10, min=0, max=1)
    gap = cat["logp"] - cat["neg_entropy"]
    result = {
        "model": args.model,
        "temperature": args.temperature,
        "tokens": n,
        "pit_deciles": deciles.int().tolist(),
        "pit_chi2": float(((deciles - n / 10) ** 2 / (n / 10)).sum()),
        "mean_logp": float(cat["logp"].mean()),
        "mean_neg_entropy": float(cat["neg_entropy"].mean()),
        "logp_minus_neg_entropy": float(gap.mean()),
        "its_standard_error": float(gap.std() / n**0.5),
        "max_reported_error": float((cat["reported"] - cat["logp"]).abs().max()),
    }
    for key, value in result.items():
        print(f"{key:>24}: {value}")
    out = ROOT / "bench/results/sampler_calibration.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
