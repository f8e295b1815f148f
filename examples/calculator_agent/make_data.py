"""Synthetic arithmetic for the calculator agent: SFT tool-use traces, RL prompts, a test set.

``python examples/calculator_agent/make_data.py`` (``make_model.py`` runs it first) writes,
under ``--out`` (default ``examples/calculator_agent/data``):

- ``sft.jsonl``: ``{"messages", "tools"}`` chat rows for ``asyncrl sft`` (the loss covers
  the assistant turns only; the tool's answer is context);
- ``train.jsonl`` and ``test.jsonl``: ``{"prompt", "label", "metadata"}`` rows, the RL
  prompts and the held-out set (a tenth of all problems by a hash of the text, so no
  training prompt is ever a test prompt).

A problem is one operation written without spaces; the label is its exact value:

| kind  | problem        | operands                | share |
|-------|----------------|-------------------------|-------|
| mul   | ``347*86``     | 3 digits times 2 digits | 40 %  |
| add   | ``4821+7390``  | two 4-digit numbers     | 35 %  |
| small | ``7*48``, ``3+65`` | 0-9 and 0-99        | 25 %  |

An SFT trace answers in one of two styles. With the tool (a ``--tool-share`` of the rows,
default 0.3)::

    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "347*86"}}</tool_call>
    tool:      29842
    assistant: #### 29842

or at once, ``assistant: #### 29842``. Both state the right answer, but a 1M-parameter
model cannot multiply 3-digit numbers in one go, so the direct style is mostly a guess on
the multi-digit kinds, while the tool style only has to copy. Which one pays is what RL
finds out. Everything comes from one seed: two runs write identical bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

from asyncrl.rollout.tools import calculator_tool
from asyncrl.rollout.tools.registry import openai_schema

#: (kind, share of the rows).
KINDS = (("mul", 0.40), ("add", 0.35), ("small", 0.25))

#: The calculator's schema, the one ``rollout.tool_use`` offers (the template prints only
#: the name; the OpenAI agent passes the same schema).
CALCULATOR = openai_schema(calculator_tool())


def draw(rng: random.Random, kind: str) -> tuple[str, int]:
    """One problem of ``kind``: ``(expression, value)``."""
    if kind == "mul":
        a, b, op = rng.randint(100, 999), rng.randint(10, 99), "*"
    elif kind == "add":
        a, b, op = rng.randint(1000, 9999), rng.randint(1000, 9999), "+"
    else:
        a, b, op = rng.randint(0, 9), rng.randint(0, 99), rng.choice("+*")
    return f"{a}{op}{b}", a * b if op == "*" else a + b


def tool_call(expression: str) -> str:
    """The assistant turn that asks the calculator for ``expression``."""
    body = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(body)}</tool_call>"


def trace(expression: str, value: int, *, use_tool: bool) -> list[dict[str, str]]:
    """The SFT conversation for one problem, in the tool or the direct style."""
    messages = [{"role": "user", "content": expression}]
    if use_tool:
        messages += [
            {"role": "assistant", "content": tool_call(expression)},
            {"role": "tool", "content": str(value)},
        ]
    return [*messages, {"role": "assistant", "content": f"#### {value}"}]


def held_out(expression: str) -> bool:
    """True for the tenth of all problems reserved for the test set."""
    return hashlib.sha256(expression.encode()).digest()[0] % 10 == 0


def generate(split: str, total: int, rng: random.Random) -> list[tuple[str, str, int]]:
    """``total`` rows ``(kind, expression, value)`` of ``split`` in the shares of ``KINDS``.

    Test problems are held out and distinct; training problems are never held out and may
    repeat (the small kind has 2,000 problems).
    """
    test, seen, rows = split == "test", set(), []
    for kind, share in KINDS:
        made = 0
        while made < round(total * share):
            expression, value = draw(rng, kind)
            if held_out(expression) != test or (test and expression in seen):
                continue
            seen.add(expression)
            rows.append((kind, expression, value))
            made += 1
    rng.shuffle(rows)
    return rows


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    """One JSON object a line."""
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    """Parse flags, generate, write the three files and print their sizes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train and test sets")
    parser.add_argument("--sft-seed", type=int, help="seed of the SFT traces (default: --seed)")
    parser.add_argument("--num-sft", type=int, default=16000)
    parser.add_argument("--num-train", type=int, default=4000)
    parser.add_argument("--num-test", type=int, default=400)
    parser.add_argument("--tool-share", type=float, default=0.3, help="SFT rows using the tool")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sft_seed = args.seed if args.sft_seed is None else args.sft_seed
    style = random.Random(f"{sft_seed}:style")
    sft = [
        {"messages": trace(e, v, use_tool=style.random() < args.tool_share), "tools": [CALCULATOR]}
        for _, e, v in generate("sft", args.num_sft, random.Random(f"{sft_seed}:sft"))
    ]
    write_jsonl(args.out / "sft.jsonl", sft)
    for split, total in (("train", args.num_train), ("test", args.num_test)):
        rows = generate(split, total, random.Random(f"{args.seed}:{split}"))
        write_jsonl(
            args.out / f"{split}.jsonl",
            [{"prompt": e, "label": str(v), "metadata": {"kind": k}} for k, e, v in rows],
        )
        print(f"{split:>5}: {len(rows)} rows -> {args.out / (split + '.jsonl')}")
    print(f"  sft: {len(sft)} rows -> {args.out / 'sft.jsonl'}")


if __name__ == "__main__":
    main()
