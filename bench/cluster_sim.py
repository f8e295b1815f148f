"""Cluster simulator, first version (issue 11): the overlap modes with simulated engines
and a simulated trainer, everything else the real control plane.

Every mode runs ``asyncrl train`` on the arith demo's config with ``--rollout-engine-type
sim`` (``--engines`` SimEngines in each of ``--actors`` rollout actors, each decoding up to
``--concurrency`` requests; response lengths lognormal with ``--median`` and
``--p99-ratio``) and ``--train-backend sim`` (a step of ``--step-base`` + ``--step-per-token``
x tokens modelled seconds). The modes are ``bench/overlap.py``'s: sync, one-step, async-2,
async-4, april. Modelled time runs ``--time-scale`` times faster than wall time, so the
figures are reported in modelled seconds (wall figures x time scale); the control plane
(buffer, admission, channels, weight versions) runs at wall speed, which is what makes it
a load test too: where it cannot keep up, the modelled throughput falls short.

Reported per mode (``bench/overlap.py``'s summary): samples/s (modelled), speed-up over
sync, the ideal overlap bound from sync's phases, trainer and engine idle fractions,
staleness, wasted token share. Writes ``bench/results/cluster_sim.json``.

Not yet here (issue 11): the published workloads' length distributions side by side,
the 64 x 256 scale, and the comparison with AReaL / verl / APRIL's figures. Not yet
validated. The first run found a real bug: the trainer counted only the last request of a
wait in ``time/wait_data``, so sync's generation phase G read 7.6 modelled seconds. It now
reads 137 (6.9 s wall x 20), where the longest of 256 responses alone should take about
60 (2,700 tokens at 0.022 s a step). The sim engines' own cost was one cause: woken every
step, each caller copied its whole output once per token. Waking only at the end (or
every ``stream_interval``) cut the engines' Python time 2.2x (16 engines x 16 requests:
2.1 -> 0.95 s wall) and G to 95 modelled s (4.7 s wall). The rest is still unexplained;
the next version reads the engines' and the trainer's modelled clocks instead of wall x
scale, and splits the control plane's share out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.actors.controller import run_job
from asyncrl.config import load_config
from bench.overlap import MODES, add_bounds, medians, print_table, summarize

#: Figures that are rates or durations: scaled from wall to modelled seconds.
RATES, DURATIONS = ("samples/s", "tokens/s", "samples/s min", "samples/s max"), ("wait_s", "step_s")


def sim_flags(args: argparse.Namespace) -> list[str]:
    engine = {"length-median": args.median, "length-p99-ratio": args.p99_ratio,
              "length-max": args.max_len, "time-scale": args.time_scale}  # fmt: skip
    trainer = {"step-base-s": args.step_base, "step-s-per-token": args.step_per_token,
               "time-scale": args.time_scale}  # fmt: skip
    sampling = {"temperature": 1.0, "max_new_tokens": args.max_len}
    return [
        "--rollout-engine-type", "sim", "--rollout-engine-model-path", "examples/arith/model",
        "--rollout-engine-sim-engines", str(args.engines),
        "--rollout-engine-max-running", str(args.concurrency),
        "--rollout-num-actors", str(args.actors),
        "--rollout-max-groups", str(args.engines * args.concurrency // 8),
        "--rollout-sampling", json.dumps(sampling),
        *(x for k, v in engine.items() for x in (f"--rollout-engine-sim-{k}", str(v))),
        "--train-backend", "sim",
        *(x for k, v in trainer.items() for x in (f"--trainer-sim-{k}", str(v))),
        "--buffer-filters", "[]", "--eval-interval", "0",
    ]  # fmt: skip


async def run_mode(mode: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    flags = ["--name", f"sim-{mode}", "--output-dir", str(run_dir),
             "--train-num-steps", str(args.steps), "--save-interval", "0",
             "--train-metrics-interval", "1.0", *sim_flags(args), *MODES[mode]]  # fmt: skip
    cfg = load_config("examples/arith/config.yaml", overrides=flags)
    result = await run_job(cfg)
    if not result.ok:
        raise RuntimeError(f"{mode}: {result.error or result.codes}")
    samples = cfg.buffer.groups_per_step * cfg.buffer.num_samples_per_prompt
    return summarize(run_dir, samples)


def modelled(figures: dict[str, Any], scale: float) -> dict[str, Any]:
    """Wall-clock figures in modelled seconds."""
    out = dict(figures)
    for key in RATES:
        if key in out:
            out[key] = out[key] / scale
    for key in DURATIONS:
        if key in out:
            out[key] = out[key] * scale
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["sync", "one-step", "async-2", "async-4"],
                    choices=list(MODES))  # fmt: skip
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--actors", type=int, default=2, help="rollout actors (processes)")
    ap.add_argument("--engines", type=int, default=8, help="sim engines per rollout actor")
    ap.add_argument("--concurrency", type=int, default=64, help="requests each engine decodes")
    ap.add_argument("--median", type=int, default=256, help="median response tokens")
    ap.add_argument("--p99-ratio", type=float, default=8.0, help="p99 / median response length")
    ap.add_argument("--max-len", type=int, default=4096, help="longest response")
    ap.add_argument("--step-base", type=float, default=5.0, help="train step fixed seconds")
    ap.add_argument("--step-per-token", type=float, default=2e-4, help="train seconds/token")
    ap.add_argument("--time-scale", type=float, default=20.0, help="modelled s per wall s")
    ap.add_argument("--out", type=Path, default=Path("bench/results/cluster_sim.json"))
    args = ap.parse_args()
    if args.modes[0] != "sync":
        args.modes = ["sync", *[m for m in args.modes if m != "sync"]]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="cluster-sim-") as tmp:
        for mode in args.modes:
            print(f"running {mode} ...", flush=True)
            wall = asyncio.run(run_mode(mode, args, Path(tmp) / mode))
            results[mode] = modelled(medians([wall]), args.time_scale)
    bound = add_bounds(results)
    print(f"{args.actors} x {args.engines} sim engines, {args.concurrency} requests each; "
          f"modelled seconds (x{args.time_scale:g} wall)")  # fmt: skip
    print_table(results, bound)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "bound": bound,
               "modes": results}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
