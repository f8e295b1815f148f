"""Synthetic addition problems for the arithmetic demo: SFT pairs, RL prompts, a test set.

Run ``python examples/arith/make_data.py`` (``make_model.py`` runs it first). It writes, under
``--out`` (default ``examples/arith/data``):

- ``sft.jsonl``: ``{"prompt", "response"}`` rows for ``asyncrl sft`` (loss on response + EOS);
- ``train.jsonl``: ``{"prompt", "label", "metadata"}`` rows, the RL prompts;
- ``test.jsonl``: the held-out set, same shape as ``train.jsonl``.

A problem is a sum of non-negative integers written without spaces, ``"12+7+30+5="``. The
response writes the running sums after the first, comma separated, then `` #### `` and the
answer: ``" 19,49,54 #### 54"``. A two-operand sum has no chain: ``" #### 85"``. So the
response grows with the number of operands, and a reward reads the answer after the last
``####``. ``label`` is the answer as a decimal string; ``metadata.kind`` names the family:

| kind    | operands | digits each | share | response length (chars) |
|---------|----------|-------------|-------|-------------------------|
| short   | 2        | 1-2         | 50 %  | 7-9                     |
| chain   | 3-5      | 1 (10 %: 2) | 35 %  | 10-22                   |
| long    | 8-14     | 1-2         | 15 %  | 30-60                   |

The warm-up data teaches two styles: in ``sft.jsonl`` a ``--shortcut`` share (default half)
of the sums of three or more operands is answered at once, ``" #### 54"``, without the
running sums. The SFT policy picks either, and which one pays is for GRPO to find out. On
the shipped 1M-parameter model, answering at once pays: every written partial sum is one
more chance to slip at T = 1, so sampled direct answers were right far more often than
written sums (``evaluate.py`` reports the split, ``by_style``), and GRPO's responses get
shorter as it learns.

The three files hold disjoint prompts (every prompt is unique across them), and everything
comes from one seed, so two runs write identical bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

#: (kind, share of the rows, (min, max) operands, chance that an operand has two digits).
KINDS = (
    ("short", 0.50, (2, 2), 0.5),
    ("chain", 0.35, (3, 5), 0.1),
    ("long", 0.15, (8, 14), 0.0),
)


def problem(operands: list[int], *, shortcut: bool = False, slip: int = 0) -> tuple[str, str, str]:
    """``(prompt, response, label)`` for the sum of ``operands`` (at least two); with
    ``shortcut`` the response gives the answer without the running sums; ``slip`` is added
    to the answer the response states (a teacher's mistake), never to the label."""
    partial = [sum(operands[: i + 1]) for i in range(1, len(operands))]
    answer = str(partial[-1])
    chain = ",".join(map(str, partial)) if len(operands) > 2 and not shortcut else ""
    prompt = "+".join(map(str, operands)) + "="
    return prompt, (f" {chain}" if chain else "") + f" #### {int(answer) + slip}", answer


def draw_slip(rng: random.Random, noise: float) -> int:
    """With probability ``noise``, a teacher's slip of 1 to 3 either way; else 0."""
    if noise <= 0 or rng.random() >= noise:  # no draw at all without noise: same data
        return 0
    return rng.choice((-3, -2, -1, 1, 2, 3))


def extract_answer(response: str) -> str | None:
    """The text after the last ``####``, stripped; ``None`` when the marker is missing."""
    if "####" not in response:
        return None
    return response.rsplit("####", 1)[1].strip()


def held_out(prompt: str) -> bool:
    """True for the tenth of all prompts reserved for the test set (by a hash of the text),
    so no training row can equal a test row whatever the sizes and seeds."""
    return hashlib.sha256(prompt.encode()).digest()[0] % 10 == 0


def draw(rng: random.Random, kind: str) -> list[int]:
    """Random operands for one problem of ``kind``."""
    _, _, (lo, hi), two_digits = next(k for k in KINDS if k[0] == kind)
    return [
        rng.randint(10, 99) if rng.random() < two_digits else rng.randint(0, 9)
        for _ in range(rng.randint(lo, hi))
    ]


def generate(
    split: str, total: int, rng: random.Random, shortcut: float = 0.0, noise: float = 0.0
) -> list[dict[str, object]]:
    """``total`` rows of ``split`` in the shares of ``KINDS``, shuffled; a ``shortcut``
    share of the multi-operand rows answer without the running sums, and a ``noise`` share
    of the responses state a wrong answer (``draw_slip``; the label stays right).

    Test rows are held-out prompts, each once; training rows (``sft``, ``train``) are never
    held out and may repeat, as independent draws from the same distribution do.
    """
    test = split == "test"
    seen: set[str] = set()
    rows: list[dict[str, object]] = []
    for kind, share, _, _ in KINDS:
        made, tries = 0, 0
        while made < round(total * share):
            tries += 1
            if tries > 100 * total:
                raise ValueError(f"{split}: too few distinct {kind!r} problems for {total} rows")
            operands, short = draw(rng, kind), rng.random() < shortcut
            prompt, response, label = problem(operands, shortcut=short, slip=draw_slip(rng, noise))
            if held_out(prompt) != test or (test and prompt in seen):
                continue
            seen.add(prompt)
            rows.append({"prompt": prompt, "response": response, "label": label, "kind": kind})
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-sft", type=int, default=8000)
    parser.add_argument("--num-train", type=int, default=4000)
    parser.add_argument("--num-test", type=int, default=500)
    parser.add_argument(
        "--shortcut", type=float, default=0.5, help="share of SFT sums answered without work"
    )
    parser.add_argument(
        "--noise", type=float, default=0.0, help="share of SFT answers that are wrong by 1-3"
    )
    args = parser.parse_args()
    counts = {"test": args.num_test, "sft": args.num_sft, "train": args.num_train}
    # One generator per split, so a split's rows do not depend on the others' sizes.
    splits = {
        split: generate(
            split, total, random.Random(f"{args.seed}:{split}"),
            *((args.shortcut, args.noise) if split == "sft" else (0.0, 0.0)),
        )
        for split, total in counts.items()
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    sft = [{"prompt": r["prompt"], "response": r["response"]} for r in splits["sft"]]
    write_jsonl(args.out / "sft.jsonl", sft)
    for split in ("train", "test"):
        rl = [
            {"prompt": r["prompt"], "label": r["label"], "metadata": {"kind": r["kind"]}}
            for r in splits[split]
        ]
        write_jsonl(args.out / f"{split}.jsonl", rl)
    for split, rows in splits.items():
        print(f"{split:>5}: {len(rows)} rows -> {args.out / (split + '.jsonl')}")


if __name__ == "__main__":
    main()
