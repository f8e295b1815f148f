"""Rollout/train overlap, side by side in one run (issue 6): the same job in each mode.

Every mode runs ``asyncrl train`` on the same config (default: the arith demo), model,
engines, trainer, data and seed, for ``--steps`` steps; only the overlap settings change:

    sync      eta = 0 (generate a step's groups, then train on them: a barrier)
    colocated sync, and the engines sleep (flush, release memory) through each train step
              and wake for the new weights: sync plus the switch cost
    one-step  eta = 1
    async-2   eta = 2           async-4   eta = 4
    sync-april  sync with APRIL over-provisioning (alpha = 0.5: start 1.5x the groups,
              abort the rest once a step has enough; their partials resume at the next
              version), slime's setting
    april     eta = 2 with APRIL (alpha = 0.5): the extras run on across steps, and only
              work that can no longer land within the backstop is cut

Reported per mode, over the steady state (the steps after the first, which includes
start-up):

- ``samples/s`` = trained samples / seconds between the first and last step's end;
  ``tokens/s`` the same for trained (loss) tokens;
- idle fraction of the trainer (waiting for data / span) and of each engine
  (1 - busy / span, busy = some request running, from ``metrics/rollout-N.jsonl``);
- staleness of trained samples (mean, p95, max, from the buffer's histogram);
- groups cut by asynchronous APRIL (``cut``) and dropped by the backstop (``stale``);
- wasted tokens: generated but never trained (aborted and dropped partials, filtered
  groups, and what was in flight at the end), as a share of generated tokens;
- accuracy of the final weights on a held-out set (pass@1 at T = 1, 4 samples a prompt:
  what GRPO moves on the demo's warm-up, whose greedy accuracy barely changes), i.e. at equal
  trained samples, from the job's own eval actor (it evaluates only the final version,
  after the trainer has finished, so it does not slow the timed part).

The ideal overlap bound comes from the sync run's phase times: with ``G`` the mean time
the trainer waited for a batch (generation) and ``T`` the mean step time (train +
publish), full overlap would give ``(G + T) / max(G, T)`` times sync's samples/s.
``efficiency`` = (mode samples/s / sync samples/s) / bound.

With ``--repeats R`` every mode runs ``R`` times, in rounds (sync, colocated, ...,
then again), so that a slow spell of the machine hits all modes alike; each figure is
the median over the repeats, and ``samples/s min``/``max`` give the spread.

``.venv/bin/python bench/overlap.py`` prints the table, writes ``bench/results/overlap.json``
(the medians and every run's figures) and ``bench/results/overlap.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.config import load_config
from asyncrl.job import run_job

SYNC = ["--buffer.max-staleness", "0", "--buffer.hard-staleness", "0"]
MODES: dict[str, list[str]] = {
    "sync": SYNC,
    "colocated": [*SYNC, "--colocate"],
    # A resumed partial lands one version old: the backstop must let it through.
    "sync-april": ["--buffer.max-staleness", "0", "--buffer.over-provision", "0.5"],
    "one-step": ["--buffer.max-staleness", "1"],
    "async-2": ["--buffer.max-staleness", "2"],
    "async-4": ["--buffer.max-staleness", "4"],
    "april": ["--buffer.max-staleness", "2", "--buffer.over-provision", "0.5"],
}


def eval_flags(test: str, steps: int) -> list[str]:
    """Evaluate only the final version on ``test``: 4 samples a prompt at T = 1."""
    sampling = {"temperature": 1.0, "max_new_tokens": 64}
    sets = [{"name": "test", "path": test, "n_samples": 4, "sampling": sampling}]
    return ["--eval-interval", str(steps), "--eval.at-start", "false",
            "--eval.sets", json.dumps(sets)]  # fmt: skip


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of ``path`` (none if it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def percentile(hist: dict[str, float], q: float) -> float:
    """The ``q`` quantile of a ``{value: count}`` histogram."""
    items = sorted((float(k), v) for k, v in hist.items())
    total, seen = sum(v for _, v in items), 0.0
    for value, count in items:
        seen += count
        if seen >= q * total:
            return value
    return items[-1][0] if items else 0.0


def busy_seconds(rows: list[dict[str, Any]], lo: float, hi: float) -> float:
    """Seconds in ``[lo, hi]`` covered by the rows' ``busy`` intervals."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for r in rows for a, b in r.get("busy", []))


def summarize(run_dir: Path, samples_per_step: int) -> dict[str, Any]:
    """The figures of one finished run (see the module docstring)."""
    steps = read_jsonl(run_dir / "metrics.jsonl")
    if len(steps) < 3:
        raise RuntimeError(f"{run_dir}: only {len(steps)} steps recorded")
    steady = steps[1:]
    lo, hi = steps[0]["time"], steps[-1]["time"]
    span = hi - lo
    out: dict[str, Any] = {
        "steps": len(steps),
        "samples/s": len(steady) * samples_per_step / span,
        "tokens/s": sum(r["num_tokens"] for r in steady) / span,
        "trainer_idle": sum(r["time/wait_data"] for r in steady) / span,
        "wait_s": statistics.mean(r["time/wait_data"] for r in steady),
        "step_s": statistics.mean(r["time/step"] + r["time/publish"] for r in steady),
    }
    rollouts = sorted((run_dir / "metrics").glob("rollout-*.jsonl"))
    idle = [1 - busy_seconds(read_jsonl(p), lo, hi) / span for p in rollouts]
    out["engine_idle"] = statistics.mean(idle) if idle else float("nan")
    buffer = read_jsonl(run_dir / "metrics" / "buffer.jsonl")
    hist = buffer[-1].get("buffer.staleness_samples", {}) if buffer else {}
    n = sum(hist.values()) or 1
    out["staleness_mean"] = sum(float(k) * v for k, v in hist.items()) / n
    out["staleness_p95"] = percentile(hist, 0.95)
    out["staleness_max"] = max((float(k) for k in hist), default=0.0)
    last = buffer[-1] if buffer else {}
    out["cut_groups"] = last.get("buffer.filtered.cut", 0)  # asynchronous APRIL's cuts
    out["stale_groups"] = last.get("buffer.filtered.stale", 0)  # the backstop's drops
    generated = sum(read_jsonl(p)[-1]["rollout/tokens"] for p in rollouts if read_jsonl(p))
    trained = sum(r["num_tokens"] for r in steps)
    out["wasted_share"] = max(0.0, generated - trained) / generated if generated else 0.0
    evals = read_jsonl(run_dir / "metrics" / "eval.jsonl")
    out["accuracy"] = evals[-1]["pass@1"] if evals else float("nan")
    return out


async def run_mode(
    mode: str, args: argparse.Namespace, run_dir: Path, samples_per_step: int
) -> dict[str, Any]:
    """Run ``mode`` into ``run_dir`` to its end and summarize it."""
    flags = ["--name", f"overlap-{mode}", "--output-dir", str(run_dir),
             "--train.num-steps", str(args.steps), "--save-interval", "0",
             "--train.metrics-interval", "1.0", *args.flags, *MODES[mode]]  # fmt: skip
    flags += eval_flags(args.test, args.steps)
    cfg = load_config(args.config, overrides=flags)
    result = await run_job(cfg)
    if not result.ok:
        raise RuntimeError(f"{mode}: {result.error or result.codes}")
    return summarize(run_dir, samples_per_step)


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over ``runs``, with the spread of samples/s."""
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["samples/s min"] = min(r["samples/s"] for r in runs)
    out["samples/s max"] = max(r["samples/s"] for r in runs)
    out["repeats"] = len(runs)
    return out


def add_bounds(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Speed-ups over sync and the ideal bound ``(G + T) / max(G, T)`` from sync's phases."""
    sync = results["sync"]
    g, t = sync["wait_s"], sync["step_s"]
    bound = (g + t) / max(g, t)
    for r in results.values():
        r["speedup"] = r["samples/s"] / sync["samples/s"]
        r["efficiency"] = r["speedup"] / bound
    return {"G_s": g, "T_s": t, "ideal_bound": bound}


def print_table(results: dict[str, dict[str, Any]], bound: dict[str, float]) -> None:
    cols = [("samples/s", "{:.1f}"), ("tokens/s", "{:.0f}"), ("speedup", "{:.2f}x"),
            ("efficiency", "{:.0%}"), ("trainer_idle", "{:.0%}"), ("engine_idle", "{:.0%}"),
            ("staleness_mean", "{:.2f}"), ("staleness_p95", "{:.0f}"),
            ("staleness_max", "{:.0f}"), ("cut_groups", "{:.0f}"), ("stale_groups", "{:.0f}"),
            ("wasted_share", "{:.1%}"), ("accuracy", "{:.1%}")]  # fmt: skip
    print(f"{'mode':<11}" + "".join(f"{c:>15}" for c, _ in cols) + f"{'samples/s range':>18}")
    for mode, r in results.items():
        spread = f"{r['samples/s min']:.1f}-{r['samples/s max']:.1f}"
        print(
            f"{mode:<11}" + "".join(f"{fmt.format(r[c]):>15}" for c, fmt in cols) + f"{spread:>18}"
        )
    print(
        f"sync phases: G = {bound['G_s']:.2f} s generating, T = {bound['T_s']:.2f} s training "
        f"per step; ideal overlap bound (G + T) / max(G, T) = {bound['ideal_bound']:.2f}x"
    )


def plot(results: dict[str, dict[str, Any]], bound: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(modes, [results[m]["speedup"] for m in modes], color="tab:blue")
    ax1.axhline(bound["ideal_bound"], color="k", ls="--", label="ideal (G+T)/max(G,T)")
    ax1.set_ylabel("samples/s vs sync")
    ax1.legend()
    width = 0.4
    xs = range(len(modes))
    ax2.bar([x - width / 2 for x in xs], [results[m]["trainer_idle"] for m in modes], width,
            label="trainer idle")  # fmt: skip
    ax2.bar([x + width / 2 for x in xs], [results[m]["engine_idle"] for m in modes], width,
            label="engine idle")  # fmt: skip
    ax2.set_xticks(list(xs), modes)
    ax2.set_ylabel("idle fraction")
    ax2.legend()
    fig.suptitle("asyncrl overlap modes (same job; medians of each mode's runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_json(payload: dict[str, Any], path: Path) -> None:
    """``asyncrl plot bench/results/overlap.json``: the figure again from the JSON."""
    plot(payload["modes"], payload["bound"], path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/arith/config.yaml")
    parser.add_argument("--test", default="examples/arith/data/test.jsonl@[0:200]")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode (medians)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--out", type=Path, default=Path("bench/results/overlap.json"))
    parser.add_argument("flags", nargs="*", help="asyncrl train flags for every mode (after --)")
    args = parser.parse_args()
    if args.modes[0] != "sync":
        args.modes = ["sync", *[m for m in args.modes if m != "sync"]]  # the baseline
    base = load_config(args.config, overrides=args.flags)
    samples_per_step = base.buffer.groups_per_step * base.buffer.num_samples_per_prompt
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    with tempfile.TemporaryDirectory(prefix="overlap-") as tmp:
        for rep in range(args.repeats):
            for mode in args.modes:
                print(f"running {mode} ({rep + 1}/{args.repeats}) ...", flush=True)
                run_dir = Path(tmp) / f"{mode}-{rep}"
                runs[mode].append(asyncio.run(run_mode(mode, args, run_dir, samples_per_step)))
    results = {mode: medians(r) for mode, r in runs.items()}
    bound = add_bounds(results)
    print_table(results, bound)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": args.config, "flags": args.flags, "steps": args.steps,
               "repeats": args.repeats,
               "bound": bound, "modes": results, "runs": runs}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    plot(results, bound, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
