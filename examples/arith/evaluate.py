"""Held-out accuracy of an arithmetic-demo checkpoint: greedy, pass@1 and pass@k by kind.

``python examples/arith/evaluate.py [--model DIR] [--data FILE] [--out FILE.json]`` loads an
HF model directory with transformers (default ``examples/arith/model``), answers every
prompt of ``test.jsonl`` once greedily and ``--num-samples`` times at ``--temperature``,
and scores a response as correct when the text after its last ``####`` equals the label.
It prints one row per problem kind and writes the same numbers as JSON.

pass@1 and pass@k are the unbiased estimators of ``asyncrl.policies.pass_at_k`` over the
``n`` samples of each prompt, averaged over prompts. ``well_formed`` is the share of
sampled responses that end with EOS and carry an integer after ``####``; ``length`` is
the mean number of sampled response tokens, EOS included. ``by_style`` splits the sampled
accuracy by problem kind and by whether the response wrote the running sums.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is local; never reach a hub

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_rows(path: Path) -> list[dict]:
    """The RL/test rows of ``path`` (``prompt``, ``label``, ``metadata.kind``)."""
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def extract_answer(response: str) -> str | None:
    """The text after the last ``####``, stripped; ``None`` when the marker is missing."""
    if "####" not in response:
        return None
    return response.rsplit("####", 1)[1].strip()


def generate(
    model, tokenizer, prompts: list[str], *, n: int, temperature: float | None, max_new_tokens: int
) -> list[list[tuple[str, int, bool]]]:
    """``n`` responses per prompt as ``(text, tokens incl. EOS, ended with EOS)``.

    Greedy when ``temperature`` is None. Prompts go in their given order in one batch,
    so the caller batches prompts of similar length (generation runs until the longest).
    """
    import torch

    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    sampling = (
        {"do_sample": False}
        if temperature is None
        else {
            "do_sample": True,
            "temperature": temperature,
            "top_k": 0,
            "top_p": 1.0,
        }
    )
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            num_return_sequences=n,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
    new = out[:, enc["input_ids"].shape[1] :].tolist()
    results: list[list[tuple[str, int, bool]]] = [[] for _ in prompts]
    for i, ids in enumerate(new):
        ended = tokenizer.eos_token_id in ids
        ids = ids[: ids.index(tokenizer.eos_token_id) + 1] if ended else ids
        text = tokenizer.decode(ids, skip_special_tokens=True)
        results[i // n].append((text, len(ids), ended))
    return results


def evaluate(
    model_dir: Path,
    rows: list[dict],
    *,
    n: int,
    k: int,
    temperature: float,
    batch_size: int,
    max_new_tokens: int,
    seed: int,
) -> dict:
    """Score every row; returns ``{"overall": {...}, "by_kind": {kind: {...}}, ...}``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.policies import pass_at_k

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt"]))
    per_row: list[dict] = [{} for _ in rows]
    styles: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # kind/style -> [n, correct]
    start = time.perf_counter()
    for lo in range(0, len(order), batch_size):
        idx = order[lo : lo + batch_size]
        prompts = [rows[i]["prompt"] for i in idx]
        greedy = generate(
            model, tokenizer, prompts, n=1, temperature=None, max_new_tokens=max_new_tokens
        )
        sampled = generate(
            model, tokenizer, prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens
        )
        for i, g, s in zip(idx, greedy, sampled, strict=True):
            label = rows[i]["label"]
            c = sum(extract_answer(text) == label for text, _, _ in s)
            kind = rows[i].get("metadata", {}).get("kind", "all")
            for text, _, _ in s:
                tally = styles[f"{kind}/{style(text)}"]
                tally[0] += 1
                tally[1] += extract_answer(text) == label
            per_row[i] = {
                "greedy": float(extract_answer(g[0][0]) == label),
                "pass@1": pass_at_k(n, c, 1),
                f"pass@{k}": pass_at_k(n, c, k),
                "well_formed": sum(ok and (extract_answer(t) or "x").isdigit() for t, _, ok in s)
                / n,
                "length": sum(m for _, m, _ in s) / n,
            }
    elapsed = time.perf_counter() - start
    groups: dict[str, list[dict]] = defaultdict(list)
    for row, scores in zip(rows, per_row, strict=True):
        groups[row.get("metadata", {}).get("kind", "all")].append(scores)
    by_kind = {kind: _mean(groups[kind]) for kind in sorted(groups)}
    return {
        "model": str(model_dir),
        "num_prompts": len(rows),
        "num_samples": n,
        "temperature": temperature,
        "seconds": round(elapsed, 1),
        "overall": _mean(per_row),
        "by_kind": by_kind,
        "by_style": {
            key: {"samples": n, "accuracy": c / n} for key, (n, c) in sorted(styles.items())
        },
    }


def style(response: str) -> str:
    """``sums`` when the response writes anything before ``####`` (the running sums),
    else ``direct``: which of the two warm-up styles a sample used."""
    return "sums" if response.split("####", 1)[0].strip() else "direct"


def _mean(scores: list[dict]) -> dict:
    keys = scores[0].keys()
    return {"count": len(scores)} | {key: sum(s[key] for s in scores) / len(scores) for key in keys}


def print_table(report: dict) -> None:
    """One row per kind, then the overall row; accuracies in percent."""
    keys = [key for key in report["overall"] if key not in ("count", "length")]
    print(f"{'kind':<8} {'count':>5} " + " ".join(f"{key:>11}" for key in keys) + f" {'length':>7}")
    for name, scores in [*report["by_kind"].items(), ("overall", report["overall"])]:
        cells = " ".join(f"{100 * scores[key]:>10.1f}%" for key in keys)
        print(f"{name:<8} {scores['count']:>5} {cells} {scores['length']:>7.1f}")
    print(
        f"({report['num_samples']} samples/prompt at T={report['temperature']}, "
        f"{report['seconds']} s)"
    )
    print("sampled accuracy by kind and style (sums written before #### or not):")
    for key, cell in report["by_style"].items():
        print(f"  {key:<14} {cell['samples']:>6} samples {100 * cell['accuracy']:>6.1f}%")


def main() -> None:
    """Parse flags, evaluate, print the table and write the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=HERE / "model")
    parser.add_argument("--data", type=Path, default=HERE / "data" / "test.jsonl")
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON report (default: eval.json next to the model)"
    )
    parser.add_argument("--num-samples", type=int, default=16, help="samples per prompt")
    parser.add_argument("--k", type=int, default=8, help="pass@k to report besides pass@1")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per generate call")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--limit", type=int, default=None, help="first N rows only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = load_rows(args.data)[: args.limit]
    report = evaluate(
        args.model,
        rows,
        n=args.num_samples,
        k=args.k,
        temperature=args.temperature,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    print_table(report)
    out = args.out or args.model / "eval.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
