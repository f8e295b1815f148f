"""Local processes against Ray actors, side by side in one run: the same job on each runtime.

Every run is ``asyncrl train`` on the same config (default: the arith demo, no eval), model,
data and seed for ``--steps`` steps; only ``--runtime`` changes. The Ray runs start their
own local cluster (``ray.init`` inside the job), as ``asyncrl train --runtime ray`` does
with no address, so its start-up cost is part of what is measured.

Reported per runtime (medians over ``--repeats``, run in rounds local, ray, local, ...
so a slow spell of the machine hits both alike):

- ``wall_s``: the whole job, from ``run_job`` called to returned (cluster start, actor
  start-up, training, the ordered stop);
- ``first_step_s``: from the call to the end of the first optimizer step (start-up);
- ``samples/s``: trained samples per second over the steps after the first (the steady
  state, as in ``bench/overlap.py``), and the trainer's idle share over them;
- ``ray / local``: each figure's ratio.

``.venv/bin/python bench/runtimes.py`` prints the table and writes
``bench/results/runtimes.json``.
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

RUNTIMES = ("local", "ray")
FIGURES = ("wall_s", "first_step_s", "samples/s", "trainer_idle")


async def run_once(runtime: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """One job on ``runtime``; its figures."""
    flags = ["--runtime", runtime, "--output-dir", str(run_dir), "--eval-interval", "0",
             "--train.num-steps", str(args.steps)]  # fmt: skip
    cfg = load_config(args.config, flags)
    start_wall, start = time.time(), time.monotonic()
    result = await run_job(cfg)
    wall = time.monotonic() - start
    if not result.ok:
        raise RuntimeError(f"{runtime} run failed: {result.error}")
    samples_per_step = cfg.buffer.groups_per_step * cfg.buffer.num_samples_per_prompt
    figures = summarize(run_dir, samples_per_step)
    first = read_jsonl(run_dir / "metrics.jsonl")[0]["time"]
    return {
        "wall_s": wall,
        "first_step_s": first - start_wall,
        "samples/s": figures["samples/s"],
        "trainer_idle": figures["trainer_idle"],
        "steps": figures["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/arith/config.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/runtimes.json"))
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in RUNTIMES}
    with tempfile.TemporaryDirectory(prefix="runtimes-") as tmp:
        for rep in range(args.repeats):
            for runtime in RUNTIMES:
                print(f"running {runtime} ({rep + 1}/{args.repeats}) ...", flush=True)
                run_dir = Path(tmp) / f"{runtime}-{rep}"
                runs[runtime].append(asyncio.run(run_once(runtime, args, run_dir)))
    medians = {r: {k: statistics.median(x[k] for x in runs[r]) for k in FIGURES} for r in runs}
    ratios = {k: medians["ray"][k] / medians["local"][k] for k in FIGURES}
    print(f"\n{'figure':<14}{'local':>10}{'ray':>10}{'ray / local':>14}")
    for k in FIGURES:
        print(f"{k:<14}{medians['local'][k]:>10.2f}{medians['ray'][k]:>10.2f}{ratios[k]:>14.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": args.config, "steps": args.steps, "repeats": args.repeats,
               "medians": medians, "ray_over_local": ratios, "runs": runs}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
