"""Sums of products for SmolLM2 with tools: SFT traces, RL prompts, a held-out test set.

``python examples/tool_agent/make_data.py`` writes, under ``--out`` (default
``examples/tool_agent/data``):

- ``sft.jsonl``: ``{"messages", "tools"}`` rows for ``asyncrl sft`` (loss on the
  assistant turns; tool results are context);
- ``train.jsonl`` and ``test.jsonl``: ``{"prompt", "label", "metadata"}`` rows. A problem
  is held out by a hash of its numbers, so no test problem is ever trained on.

A problem is ``a*b + c*d`` with ``a, c`` of 3-4 digits and ``b, d`` of 2-3, in one of
four phrasings (``metadata.kind``). SmolLM2 cannot multiply such numbers in its head. An
SFT trace answers in one of three styles (``--styles``, shares of the rows):

- ``calc``: both products in parallel calls, then their sum in a third, then the answer
  (three assistant turns, three calls):
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "347*29"}}</tool_call>``;
- ``python``: one program, ``print(347*29 + 512*18)``, then the answer;
- ``direct``: the answer at once. It states the right number, which the model cannot
  compute, so what it learns from these rows is to guess.

Which style pays is what RL finds out. Everything comes from the seeds: two runs write
identical bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path
from typing import Any

from asyncrl.rollout.tools import calculator_tool
from asyncrl.rollout.tools.registry import openai_schema
from asyncrl.rollout.tools.sandbox import python_tool

#: The tools every prompt offers, as ``rollout.tool_use`` describes them.
TOOLS = [openai_schema(calculator_tool()), openai_schema(python_tool(isolate=False))]

PHRASINGS = {
    "bare": "What is {a}*{b} + {c}*{d}?",
    "shop": "A shop sells {a} boxes at {b} dollars each and {c} bags at {d} dollars each. "
    "How many dollars does it take in?",
    "library": "A library has {a} shelves of {b} books and {c} shelves of {d} books. "
    "How many books does it have?",
    "words": "Compute {a} times {b} plus {c} times {d}.",
}

Problem = tuple[int, int, int, int]


def draw(rng: random.Random) -> Problem:
    """``(a, b, c, d)``: ``a, c`` of 3-4 digits, ``b, d`` of 2-3 digits."""
    a, b = rng.randint(100, 9999), rng.randint(10, 999)
    return a, b, rng.randint(100, 9999), rng.randint(10, 999)


def held_out(p: Problem) -> bool:
    """True for the tenth of all problems reserved for the test set."""
    return hashlib.sha256(repr(p).encode()).digest()[0] % 10 == 0


def answer(p: Problem) -> int:
    a, b, c, d = p
    return a * b + c * d


def call(name: str, **arguments: str) -> dict[str, Any]:
    """One OpenAI-style tool call (the template renders it as a ``<tool_call>`` block)."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def trace(question: str, p: Problem, style: str) -> list[dict[str, Any]]:
    """The SFT conversation for one problem in ``style`` (module docstring)."""
    a, b, c, d = p
    final = {"role": "assistant", "content": f"The answer is {answer(p)}."}
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    if style == "calc":
        calls = [call("calculator", expression=e) for e in (f"{a}*{b}", f"{c}*{d}")]
        messages += [
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": str(a * b)},
            {"role": "tool", "content": str(c * d)},
            {"role": "assistant", "content": "", "tool_calls": [
                call("calculator", expression=f"{a * b}+{c * d}")]},
            {"role": "tool", "content": str(answer(p))},
        ]  # fmt: skip
    elif style == "python":
        messages += [
            {"role": "assistant", "content": "",
             "tool_calls": [call("python", code=f"print({a}*{b} + {c}*{d})")]},
            {"role": "tool", "content": f"{answer(p)}\n[exit status 0]"},
        ]  # fmt: skip
    return [*messages, final]


def problems(split: str, total: int, rng: random.Random) -> list[tuple[str, str, Problem]]:
    """``total`` distinct ``(kind, question, problem)`` rows of ``split``."""
    test, seen, rows = split == "test", set(), []
    kinds = list(PHRASINGS)
    while len(rows) < total:
        p = draw(rng)
        if held_out(p) != test or p in seen:
            continue
        seen.add(p)
        kind = kinds[len(rows) % len(kinds)]
        rows.append((kind, PHRASINGS[kind].format(a=p[0], b=p[1], c=p[2], d=p[3]), p))
    rng.shuffle(rows)
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def parse_styles(text: str) -> dict[str, float]:
    """``calc=0.35,python=0.15,direct=0.5`` -> shares that sum to 1."""
    shares = {k: float(v) for k, v in (part.split("=") for part in text.split(","))}
    if set(shares) - {"calc", "python", "direct"} or abs(sum(shares.values()) - 1) > 1e-6:
        raise SystemExit(f"--styles: calc, python, direct shares summing to 1, got {text!r}")
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train and test sets")
    parser.add_argument("--sft-seed", type=int, default=0, help="seed of the SFT traces")
    parser.add_argument("--num-sft", type=int, default=160)
    parser.add_argument("--num-train", type=int, default=4000)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--styles", type=parse_styles, default="calc=0.25,python=0.1,direct=0.65")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    style_rng = random.Random(f"{args.sft_seed}:style")
    names, weights = zip(*args.styles.items(), strict=True)
    sft = [
        {"messages": trace(q, p, style_rng.choices(names, weights)[0]), "tools": TOOLS}
        for _, q, p in problems("sft", args.num_sft, random.Random(f"{args.sft_seed}:sft"))
    ]
    write_jsonl(args.out / "sft.jsonl", sft)
    print(f"  sft: {len(sft)} rows -> {args.out / 'sft.jsonl'}")
    for split, total in (("train", args.num_train), ("test", args.num_test)):
        rows = problems(split, total, random.Random(f"{args.seed}:{split}"))
        write_jsonl(args.out / f"{split}.jsonl", [
            {"prompt": q, "label": str(answer(p)), "metadata": {"kind": k}} for k, q, p in rows
        ])  # fmt: skip
        print(f"{split:>5}: {len(rows)} rows -> {args.out / (split + '.jsonl')}")


if __name__ == "__main__":
    main()
