"""One job setting off and on, side by side in one run: by default the cores an idle
trainer lends its engines.

Runs ``asyncrl train CONFIG`` (default: the real-model example without its eval actor)
for ``--steps`` steps with ``--setting KEY OFF ON`` (default ``runtime.lend-trainer-cores
never always``; e.g. ``trainer.share-prompts false true``) at each value, alternated
``--repeats`` times (off, on, then on, off, ...) after an uncounted warm-up run, so that
neither the cold start nor a slow spell of the machine falls on one side. Per run:

- ``first_step_s``: launch to the first trained step (model loads and the first batch,
  which the engine generates while the trainer has nothing to do);
- ``wall_s``: launch to the last step; ``samples/s`` and ``tokens/s`` over the steps
  after the first, the trainer's idle share and mean wait, as ``bench/overlap.py``
  counts them;
- ``lent_share``: the engines' steps run on lent threads, over all their steps.

``.venv/bin/python bench/lend_cores.py [--repeats 2] [--setting KEY OFF ON] [-- FLAGS]``
prints each run, the medians and on / off ratios, and writes ``--out``
(``bench/results/lend_cores.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.config import load_config
from asyncrl.job import run_job
from bench.overlap import read_jsonl, summarize

FIGURES = ("first_step_s", "wall_s", "samples/s", "tokens/s", "trainer_idle", "wait_s",
           "lent_share")  # fmt: skip


async def run_once(args: argparse.Namespace, lend: bool, run_dir: Path) -> dict[str, Any]:
    """One job into ``run_dir`` with the setting on (``lend``) or off; its figures."""
    key, off, on = args.setting
    flags = ["--name", f"lend-{lend}", "--output-dir", str(run_dir),
             "--train.num-steps", str(args.steps), "--eval.interval", "0",
             "--save-interval", "0", "--train.metrics-interval", "1.0", *args.flags,
             f"--{key}", on if lend else off]  # fmt: skip
    cfg = load_config(args.config, overrides=flags)
    start = time.time()
    result = await run_job(cfg)
    if not result.ok:
        raise RuntimeError(f"lend {lend}: {result.error or result.codes}")
    steps = read_jsonl(run_dir / "metrics.jsonl")
    out = summarize(run_dir, cfg.buffer.groups_per_step * cfg.buffer.num_samples_per_prompt)
    out.pop("accuracy", None)  # no eval here (NaN)
    out["first_step_s"] = steps[0]["time"] - start
    out["wall_s"] = steps[-1]["time"] - start
    files = (run_dir / "metrics").glob("rollout-*.jsonl")
    last = [rows[-1] for path in files if (rows := read_jsonl(path))]  # counters: cumulative
    lent = sum(r.get("engine/lent_thread_steps", 0.0) for r in last)
    out["lent_share"] = lent / max(sum(r.get("engine/steps", 0.0) for r in last), 1.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/word_problems/config.yaml")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="runs each way, alternated")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the uncounted first run")  # fmt: skip
    parser.add_argument("--setting", nargs=3, metavar=("KEY", "OFF", "ON"),
                        default=["runtime.lend-trainer-cores", "never", "always"],
                        help="the flag (without --) and its off and on values")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/results/lend_cores.json"))
    parser.add_argument("flags", nargs="*", help="asyncrl train flags for every run (after --)")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="lend-") as tmp:
        if args.warmup:  # the first run pays the cold page cache: timed by neither side
            print("warm-up run (not counted) ...", flush=True)
            asyncio.run(run_once(args, True, Path(tmp) / "warmup"))
        for rep in range(args.repeats):
            for key in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                run = asyncio.run(run_once(args, key == "on", Path(tmp) / f"{key}-{rep}"))
                runs[key].append(run)
                print(f"{key} ({rep + 1}/{args.repeats}): " +
                      "  ".join(f"{k} {run[k]:.3g}" for k in FIGURES), flush=True)  # fmt: skip
    medians = {k: {f: statistics.median(r[f] for r in v) for f in FIGURES} for k, v in runs.items()}
    ratios = {f: medians["on"][f] / medians["off"][f] for f in FIGURES if medians["off"][f]}
    for f in FIGURES:
        on, off = medians["on"][f], medians["off"][f]
        print(f"{f:>14}: off {off:8.3f}  on {on:8.3f}  on/off {ratios.get(f, float('nan')):.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": args.config, "setting": args.setting, "flags": args.flags,
               "steps": args.steps,
               "repeats": args.repeats, "medians": medians, "ratios": ratios,
               "runs": runs}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
