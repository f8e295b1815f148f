"""The embedded engine on a batch that turns over, before and after a change, in one run.

``asyncrl eval``'s path (every sample submitted at once, continuously batched) on the
real model and the word-problems test rows, with more requests than ``max_running``:
rows finish and join nearly every decode step, as in scoring a checkpoint or a rollout
with a long tail. With ``--against CHECKOUT`` the same run is made from another checkout
of asyncrl (``git worktree add /tmp/before <commit>``), alternated round by round, each
run a fresh process alone on the machine; each checkout reads its own example config.
Reported: seconds per run, output tokens per second, and this checkout's time over the
other's. The same seed samples the same tokens, whatever the KV layout: each request
draws from its own generator, so the mean reply length is printed as a check.

    python bench/engine_turnover.py --rows 100 --max-running 128 --against /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(rows: int, samples: int, running: int, dtype: str) -> None:
    """One timed eval in this process (asyncrl imported from ``PYTHONPATH``), as JSON."""
    from asyncrl.config import load_config
    from asyncrl.model_zoo import smollm2_dir
    from asyncrl.offline_eval import evaluate_model

    root = Path.cwd()
    sampling = {"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 64}
    test = [{"name": "test", "path": f"{root}/examples/word_problems/data/test.jsonl@[0:{rows}]",
             "n_samples": samples, "pass_k": [1], "apply_chat_template": True,
             "sampling": sampling}]  # fmt: skip
    flags = ["--seed", "1", "--eval.sets", json.dumps(test), "--rm-type", "numeric",
             "--rollout.engine.dtype", dtype,
             "--rollout.engine.max-running", str(running)]  # fmt: skip
    cfg = load_config(root / "examples/word_problems/config.yaml", overrides=flags)
    start = time.perf_counter()
    row = asyncio.run(evaluate_model(cfg, Path(smollm2_dir())))[0]
    seconds = time.perf_counter() - start
    tokens = row["response_len"] * rows * samples
    print(json.dumps({"seconds": seconds, "tokens_per_s": tokens / seconds,
                      "response_len": row["response_len"], "pass@1": row["pass@1"]}))  # fmt: skip


def run(checkout: Path, args: argparse.Namespace) -> dict:
    """One worker from ``checkout``: its asyncrl, its config and data."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    flags = ["--rows", str(args.rows), "--samples", str(args.samples),
             "--max-running", str(args.max_running), "--dtype", args.dtype]  # fmt: skip
    done = subprocess.run([sys.executable, __file__, "--worker", *flags], cwd=checkout, env=env,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: the run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100, help="test rows (prompts)")
    parser.add_argument("--samples", type=int, default=4, help="samples a prompt")
    parser.add_argument("--max-running", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--against", type=Path, help="another checkout of asyncrl")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/results/engine_turnover.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.rows, args.samples, args.max_running, args.dtype)
    if args.against is not None and not (args.against / "asyncrl").is_dir():
        parser.error(f"--against {args.against}: not a checkout of asyncrl")
    sides = {"this": ROOT, **({"against": args.against.resolve()} if args.against else {})}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for i in range(args.rounds):
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        for name in order:
            runs[name].append(run(sides[name], args))
            print(f"round {i + 1} {name}: {json.dumps(runs[name][-1])}", flush=True)
    summary = {name: statistics.mean(r["seconds"] for r in rs) for name, rs in runs.items()}
    if "against" in summary:
        summary["this_over_against"] = summary["this"] / summary["against"]
        print(f"this checkout's time / the other's: {summary['this_over_against']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"settings": {k: str(v) for k, v in vars(args).items() if k != "worker"},
               "runs": runs, "summary": summary}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
