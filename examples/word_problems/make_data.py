"""One-step word problems for SmolLM2-135M-Instruct: ``data/{train,test}.jsonl``.

Each row is a chat prompt (the system line asks for the answer at the end) with an
integer label and its kind (add, sub, mul, div) in the metadata. Numbers are small
(2-20, products and dividends up to 200), so the model half-knows the task: greedy it
answers about half of them, sampled at T = 0.7 about a fifth. A problem goes to the test
set by a hash of its text, so no test problem is ever trained on.

    python examples/word_problems/make_data.py [--train 4000] [--test 500]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
SYSTEM = "Solve the problem. End your reply with: The answer is N."
NAMES = ["Tom", "Anna", "Ben", "Maria", "Sam", "Lena", "Omar", "Julia", "Ravi", "Chloe"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "cards"]


def problem(rng: random.Random) -> tuple[str, int, str]:
    """``(question, answer, kind)`` of one random problem."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(["add", "sub", "mul", "div"])
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    if kind == "add":
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        return q, a + b, kind
    if kind == "sub":
        a, b = max(a, b) + b, b
        return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b, kind
    if kind == "mul":
        a = rng.randint(2, 10)
        q = f"{name} buys {a} boxes with {b} {item} in each box. How many {item} is that in all?"
        return q, a * b, kind
    a = rng.randint(2, 10)
    q = f"{name} shares {a * b} {item} equally among {a} friends. "
    q += f"How many {item} does each friend get?"
    return q, b, kind


def is_test(question: str) -> bool:
    """About one problem in ten, fixed by its text."""
    return hashlib.sha256(question.encode()).digest()[0] < 26


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng, seen = random.Random(args.seed), set()
    rows: dict[str, list[dict]] = {"train": [], "test": []}
    while len(rows["train"]) < args.train or len(rows["test"]) < args.test:
        question, answer, kind = problem(rng)
        split = "test" if is_test(question) else "train"
        if question in seen or len(rows[split]) >= getattr(args, split):
            continue
        seen.add(question)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        rows[split].append({"prompt": messages, "label": str(answer), "metadata": {"kind": kind}})
    (HERE / "data").mkdir(exist_ok=True)
    for split, items in rows.items():
        path = HERE / "data" / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in items))
        print(f"{path}: {len(items)} rows")


if __name__ == "__main__":
    main()
