"""Cluster simulator (issue 11): a GPU cluster's rollout/train overlap, planned on 2 cores.

Every mode runs ``asyncrl train`` with ``--rollout.engine.type sim`` (model-free engines
whose decode time follows a latency model, ``asyncrl/engines/sim/engine.py``) and
``--train-backend sim`` (a step takes modelled time, ``asyncrl/trainers/sim_trainer.py``).
Everything else is the real code: the buffer and its admission rule, APRIL, the rollout
actors and their HTTP clients, the ZeroMQ channels, the weight-version broadcast.

The cluster. ``--gpus`` GPUs; an engine takes ``--engine-gpus`` of them and decodes up to
``--concurrency`` requests. A decode step of an engine takes
``decode_base_s + decode_s_per_seq * running`` modelled seconds. A train step takes
``train_base_s + train_gpu_s_per_token * tokens / train_gpus`` when training scales
linearly with its GPUs (``--train-scaling`` 1; ``per_token`` for less). The modes, at
the same GPU budget (anchors section 4.2):

    sync-colocated   eta 0; every GPU generates, then every GPU trains (engines release
                     and resume their memory around the step: ``switch_s``)
    april-colocated  the same with APRIL (alpha 0.5): slime's setting for APRIL
    sync             eta 0 on split pools: ``--rollout-share`` of the GPUs generate, the
                     rest train, each pool idle while the other works
    one-step         eta 1 on split pools (verl's one-step-off)
    async-2/4/8      eta 2, 4, 8 on split pools (AReaL's max_head_offpolicyness)
    april            eta 2 with APRIL (alpha 0.5) on split pools

A workload is a response-length distribution (lognormal by median and p99/median, cut at
a maximum): ``WORKLOADS``. ``--token-stride`` k sends one token id per k modelled tokens
so 28k-token responses fit through the real control plane; times and token figures are
in modelled tokens.

Time. Modelled seconds run ``--time-scale`` times faster than wall seconds; engines and
trainer are tied to the wall clock (a late event loop does not slow them), so modelled
figures are wall figures x scale as long as the control plane keeps up. Where it does not,
throughput falls short of what the engines could do; ``--load-test`` measures where
(below).

Reported per mode: trained samples/s and tokens/s (modelled), speed-up over
sync-colocated and over sync, trainer idle (waiting for data / span), rollout idle (the
share of time a rollout actor had nothing running), staleness of trained samples (mean,
p95, max), the untrained share of generated tokens (buffered, partial or in flight at the
end, which a longer job goes on to train, besides any thrown away), and in the eta-0 modes
the rollout phase's samples/s (samples per step / time the trainer waited), the figure
APRIL reports. Then the published speed-ups beside the comparable ones.

``--load-test``: the control plane alone. Engines decode a fixed response of
``--load-tokens`` ids in a fixed modelled time, the trainer steps in ``--load-step-s``;
each rung of ``--load-in-flight`` (requests the engines hold at once) runs with the
latency chosen so the engines could finish ``--load-rate`` samples a wall second
(Little's law: rate = in_flight / latency). Achieved samples/s below that rate means the
buffer, channels and rollout actors are the bottleneck. A rung trains ``--load-steps``
steps after the ``eta`` steps that drain the requests in flight at its start, and its
samples/s is taken over those only. Each rung runs once per
``--load-transport``: ``in-process`` (the rollout actors call their embedded sim engines'
``/generate`` directly, as an embedded engine is called by default) and ``http`` (over
loopback HTTP, as a rollout actor calls a remote SGLang server: both ends of each round
trip then cost CPU on these 2 cores). Reported per rung: peak requests in flight (the
rollout actors' ``rollout/in_flight``, summed per second), trained samples/s, and the CPU
seconds all actors used per 1,000 trained samples (start-up included).

``.venv/bin/python bench/cluster_sim.py --workload math-28k`` writes
``bench/results/cluster_sim.json`` (``--load-test``: ``cluster_load.json``) and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.config import load_config
from asyncrl.job import run_job
from bench.overlap import read_jsonl, summarize


@dataclass(frozen=True)
class Workload:
    """A response-length distribution (modelled tokens)."""

    median: int
    p99_ratio: float
    max_len: int
    note: str


#: Shaped after the workloads the async RL systems publish (AReaL, slime's APRIL, verl's
#: one-step and fully-async recipes, Laminar). They give maximum lengths; medians and
#: tails are our assumption ("p99 ~ 10x median", as Laminar reports).
WORKLOADS = {
    "short": Workload(200, 3.0, 1024, "GSM8K-like short answers: where async should not help"),
    "math-8k": Workload(1000, 6.0, 8192, "DAPO-Math-17k at 8k tokens (APRIL, verl one-step)"),
    "math-28k": Workload(3000, 8.0, 28672, "DAPO at 28k tokens (verl fully_async, 7B)"),
}

#: mode -> (colocated, eta, APRIL alpha)
MODES: dict[str, tuple[bool, int, float]] = {
    "sync-colocated": (True, 0, 0.0),
    "april-colocated": (True, 0, 0.5),
    "sync": (False, 0, 0.0),
    "one-step": (False, 1, 0.0),
    "async-2": (False, 2, 0.0),
    "async-4": (False, 4, 0.0),
    "async-8": (False, 8, 0.0),
    "april": (False, 2, 0.5),
}

#: (system, published figure, its setting, our mode, our baseline, the figure compared)
PUBLISHED = [
    ("AReaL", 2.77, "1.5B math, 16 nodes, eta up to 8 vs its sync mode", "async-8",
     "sync-colocated", "samples/s"),
    ("verl fully_async", 2.50, "2.35-2.67x; 7B DAPO 28k, 64:64 vs colocated sync on 128",
     "april", "sync-colocated", "samples/s"),
    ("verl one-step-off", 1.31, "+23% to +40%; 7B DAPO, 16 GPUs (4 gen / 12 train)",
     "one-step", "sync-colocated", "samples/s"),
    ("APRIL", 1.22, "+22.5% mean (+44% max) rollout throughput; slime sync colocated",
     "april-colocated", "sync-colocated", "rollout samples/s"),
]  # fmt: skip


def engines_of(mode: str, args: argparse.Namespace) -> tuple[int, int]:
    """(engines, training GPUs) of ``mode`` on the cluster of ``args``."""
    colocated = MODES[mode][0]
    rollout_gpus = args.gpus if colocated else round(args.gpus * args.rollout_share)
    train_gpus = args.gpus if colocated else args.gpus - rollout_gpus
    return max(1, rollout_gpus // args.engine_gpus), max(1, train_gpus)


def per_token(args: argparse.Namespace, train_gpus: int) -> float:
    """Train seconds per token on ``n`` GPUs: ``(c / gpus) * (gpus / n)**b`` with ``c`` =
    ``--train-gpu-s-per-token`` and ``b`` = ``--train-scaling``: ``c / gpus`` on the whole
    cluster; ``b = 1`` is linear scaling (``c / n``), ``b = 0`` none (verl's 7B update took
    114 s on 128 GPUs and 113 s on 64)."""
    c, b = args.train_gpu_s_per_token, args.train_scaling
    return c / args.gpus * (args.gpus / train_gpus) ** b


def mean_length(work: Workload, seed: int = 0) -> float:
    """E[min(L, max)] of the workload's lognormal, from 20,000 draws (modelled tokens)."""
    sigma = math.log(work.p99_ratio) / 2.326
    draws = np.random.default_rng(seed).lognormal(math.log(work.median), sigma, 20_000)
    return float(np.minimum(draws, work.max_len).mean())


def time_scale(mode: str, args: argparse.Namespace, work: Workload) -> float:
    """The largest scale, up to ``--time-scale``, at which the engines could finish at most
    ``--wall-rate`` samples a wall second: ``scale = wall_rate * W / C`` (Little's law, with
    ``C`` the requests the engines may hold in ``mode`` and ``W`` a request's mean modelled
    latency), so the control plane keeps up and modelled time stays true."""
    _, eta, alpha = MODES[mode]
    engines, train_gpus = engines_of(mode, args)
    samples, mean = args.groups * args.group_size, mean_length(work)
    held = min(engines * args.concurrency, math.ceil((eta + 1 + alpha) * samples))
    step = args.decode_base_s + args.decode_s_per_seq * min(args.concurrency, held / engines)
    rate = held / (mean * step)
    if eta > 0:  # a steady flow, capped by the trainer: B / T (sync modes start in a burst)
        train = args.train_base_s + per_token(args, train_gpus) * samples * mean
        rate = min(rate, samples / train)
    return min(args.time_scale, args.wall_rate / rate)


def sim_flags(mode: str, args: argparse.Namespace, work: Workload, scale: float) -> list[str]:
    """The ``asyncrl train`` flags of ``mode``: engines, trainer, batch and overlap."""
    colocated, eta, alpha = MODES[mode]
    engines, train_gpus = engines_of(mode, args)
    per_actor = math.ceil(engines / args.actors)
    k = args.token_stride
    engine = {"decode-base-s": args.decode_base_s, "decode-s-per-seq": args.decode_s_per_seq,
              "prefill-s-per-token": 0.0, "weight-update-s": args.weight_update_s,
              "switch-s": args.switch_s, "length-median": work.median,
              "length-p99-ratio": work.p99_ratio, "length-max": work.max_len,
              "time-scale": scale, "token-stride": k}  # fmt: skip
    trainer = {"step-base-s": args.train_base_s, "time-scale": scale,
               "step-s-per-token": per_token(args, train_gpus) * k}  # fmt: skip
    sampling = {"temperature": 1.0, "max_new_tokens": math.ceil(work.max_len / k)}
    slots = per_actor * args.concurrency // args.group_size
    return [
        "--rollout.engine.type", "sim", "--rollout.engine.model-path", "examples/arith/model",
        "--rollout.engine.max-running", str(args.concurrency),
        "--rollout.num-actors", str(args.actors), "--rollout.max-groups", str(max(1, slots)),
        "--rollout.sampling", json.dumps(sampling),
        "--rollout-batch-size", str(args.groups), "--n-samples-per-prompt", str(args.group_size),
        *(x for key, v in engine.items() for x in (f"--rollout.engine.sim.{key}", str(v))),
        "--rollout.engine.sim-engines", str(per_actor),
        "--train-backend", "sim",
        *(x for key, v in trainer.items() for x in (f"--trainer.sim.{key}", str(v))),
        "--buffer.max-staleness", str(eta), "--buffer.hard-staleness", str(eta + 2),
        "--buffer.over-provision", str(alpha), "--colocate", str(colocated).lower(),
        "--buffer.filters", "[]", "--eval-interval", "0",
    ]  # fmt: skip


async def run_mode(
    mode: str, args: argparse.Namespace, work: Workload, run_dir: Path
) -> dict[str, Any]:
    """Run ``mode`` to its end; its figures in modelled seconds and tokens."""
    scale = time_scale(mode, args, work)
    flags = ["--name", f"sim-{mode}", "--output-dir", str(run_dir), "--seed", str(args.seed),
             "--train.num-steps", str(args.steps), "--save-interval", "0",
             "--train.metrics-interval", "1.0", *sim_flags(mode, args, work, scale)]  # fmt: skip
    cfg = load_config("examples/arith/config.yaml", overrides=flags)
    result = await run_job(cfg)
    if not result.ok:
        raise RuntimeError(f"{mode}: {result.error or result.codes}")
    wall = summarize(run_dir, args.groups * args.group_size)
    return modelled(wall, scale, args.token_stride) | {"time_scale": scale}


def modelled(wall: dict[str, Any], scale: float, stride: int) -> dict[str, Any]:
    """Wall figures in modelled seconds and modelled tokens."""
    out = dict(wall)
    out["samples/s"] = wall["samples/s"] / scale
    out["tokens/s"] = wall["tokens/s"] * stride / scale
    out["wait_s"], out["step_s"] = wall["wait_s"] * scale, wall["step_s"] * scale
    out["rollout samples/s"] = out["samples/s"] * (out["wait_s"] + out["step_s"]) / out["wait_s"]
    out["rollout_idle"] = out.pop("engine_idle")
    # Generated, not trained by the end: buffered and partial groups (kept by a job that
    # goes on) besides what was thrown away; it grows with eta on short runs.
    out["untrained_share"] = out.pop("wasted_share")
    out.pop("accuracy", None)
    return out


def add_speedups(results: dict[str, dict[str, Any]]) -> None:
    """Samples/s over each sync baseline, and tokens/s over sync-colocated: a short async
    run trains the short responses first, so its samples/s flatter it; tokens/s do not."""
    for base in ("sync-colocated", "sync"):
        if base in results:
            for r in results.values():
                r[f"vs {base}"] = r["samples/s"] / results[base]["samples/s"]
    if "sync-colocated" in results:
        for r in results.values():
            r["tokens vs sync-colocated"] = r["tokens/s"] / results["sync-colocated"]["tokens/s"]


def comparisons(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each published speed-up beside ours, where both modes ran."""
    rows = []
    for system, figure, setting, mode, base, key in PUBLISHED:
        if mode in results and base in results:
            ours = results[mode][key] / results[base][key]
            rows.append({"system": system, "published": figure, "setting": setting,
                         "ours": ours, "mode": mode, "baseline": base, "figure": key})  # fmt: skip
    return rows


def print_table(results: dict[str, dict[str, Any]]) -> None:
    cols = [("samples/s", "{:.2f}"), ("tokens/s", "{:.0f}"), ("vs sync-colocated", "{:.2f}x"),
            ("tokens vs sync-colocated", "{:.2f}x"), ("vs sync", "{:.2f}x"),
            ("trainer_idle", "{:.0%}"), ("rollout_idle", "{:.0%}"),
            ("staleness_mean", "{:.2f}"), ("staleness_p95", "{:.0f}"),
            ("staleness_max", "{:.0f}"), ("untrained_share", "{:.1%}"),
            ("rollout samples/s", "{:.2f}")]  # fmt: skip
    heads = [c.replace("sync-colocated", "sync-col").replace("tokens", "tok") for c, _ in cols]
    print(f"{'mode':<16}" + "".join(f"{h:>18}" for h in heads))
    for mode, r in results.items():
        # The rollout phase is the trainer's wait only where the two take turns (eta 0).
        turns = MODES[mode][1] == 0
        shown = r if turns else {k: v for k, v in r.items() if k != "rollout samples/s"}
        cells = (fmt.format(shown[c]) if c in shown else "-" for c, fmt in cols)
        print(f"{mode:<16}" + "".join(f"{cell:>18}" for cell in cells))


def print_comparisons(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'published':<20}{'figure':>8}{'ours':>8}  {'ours: mode / baseline':<40}setting")
    for r in rows:
        ours = f"{r['mode']} / {r['baseline']} ({r['figure']})"
        print(f"{r['system']:<20}{r['published']:>7.2f}x{r['ours']:>7.2f}x  {ours:<40}"
              f"{r['setting']}")  # fmt: skip


def plot(results: dict[str, dict[str, Any]], rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.bar(modes, [results[m].get("vs sync-colocated", float("nan")) for m in modes])
    ax1.set_ylabel("samples/s vs sync-colocated")
    ax1.tick_params(axis="x", rotation=30)
    xs = range(len(rows))
    ax2.bar([x - 0.2 for x in xs], [r["published"] for r in rows], 0.4, label="published")
    ax2.bar([x + 0.2 for x in xs], [r["ours"] for r in rows], 0.4, label="simulated")
    ax2.set_xticks(list(xs), [r["system"] for r in rows], rotation=15)
    ax2.set_ylabel("speed-up")
    ax2.legend()
    fig.suptitle("asyncrl cluster simulator: modes at one GPU budget (modelled time)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_json(payload: dict[str, Any], path: Path) -> None:
    """``asyncrl plot bench/results/cluster_sim.json``: the figure again from the JSON."""
    plot(payload["modes"], payload["published"], path)


# -- the load test ----------------------------------------------------------------------
async def run_load(
    in_flight: int, transport: str, args: argparse.Namespace, run_dir: Path
) -> dict[str, Any]:
    """One rung: ``in_flight`` requests held by the engines, each taking the latency that
    lets the engines finish ``--load-rate`` samples a wall second."""
    engines = args.actors * args.load_engines
    per_engine = math.ceil(in_flight / engines)
    latency_wall = in_flight / args.load_rate
    step_wall = latency_wall / args.load_tokens
    groups = max(1, args.load_batch // args.group_size)
    engine = {"decode-base-s": step_wall, "decode-s-per-seq": 0.0, "prefill-s-per-token": 0.0,
              "weight-update-s": 0.0, "length-median": args.load_tokens,
              "length-p99-ratio": 1.0, "length-max": args.load_tokens}  # fmt: skip
    eta = math.ceil(in_flight / (groups * args.group_size)) + 1
    fill = eta  # steps that drain the requests in flight at the start (not sustained)
    flags = [
        "--name", f"load-{in_flight}", "--output-dir", str(run_dir), "--seed", str(args.seed),
        "--train.num-steps", str(fill + args.load_steps), "--save-interval", "0",
        "--train.metrics-interval", "1.0",
        "--rollout.engine.type", "sim", "--rollout.engine.model-path", "examples/arith/model",
        "--rollout.engine.in-process", str(transport == "in-process").lower(),
        "--rollout.engine.max-running", str(per_engine),
        "--rollout.num-actors", str(args.actors),
        "--rollout.max-groups", str(math.ceil(in_flight / args.actors / args.group_size)),
        "--rollout.sampling", json.dumps({"temperature": 1.0,
                                          "max_new_tokens": args.load_tokens}),
        "--rollout-batch-size", str(groups), "--n-samples-per-prompt", str(args.group_size),
        *(x for key, v in engine.items() for x in (f"--rollout.engine.sim.{key}", str(v))),
        "--rollout.engine.sim-engines", str(args.load_engines),
        "--train-backend", "sim", "--trainer.sim.step-base-s", str(args.load_step_s),
        "--trainer.sim.step-s-per-token", "0",
        "--buffer.max-staleness", str(eta), "--buffer.hard-staleness", str(eta + 4),
        "--buffer.filters", "[]", "--eval-interval", "0",
    ]  # fmt: skip
    cfg = load_config("examples/arith/config.yaml", overrides=flags)
    cpu_before = _children_cpu_s()
    result = await run_job(cfg)
    if not result.ok:
        raise RuntimeError(f"load {in_flight}: {result.error or result.codes}")
    cpu_s = _children_cpu_s() - cpu_before
    out = summarize(run_dir, groups * args.group_size)
    steps = read_jsonl(run_dir / "metrics.jsonl")
    trained = len(steps) * groups * args.group_size
    return {"target in flight": in_flight, "transport": transport,
            "target samples/s": args.load_rate,
            "peak in flight": peak_in_flight(run_dir, args.group_size),
            "samples/s": sustained(steps, fill, groups * args.group_size),
            "trainer_idle": out["trainer_idle"], "rollout_idle": out["engine_idle"],
            "cpu_s per 1k samples": 1000 * cpu_s / trained}  # fmt: skip


def sustained(steps: list[dict[str, Any]], fill: int, per_step: int) -> float:
    """Trained samples/s over the steps after ``fill``: the requests in flight at the
    start were all admitted before the first step, and a rung that trained only them
    would report a backlog drained, not a rate sustained."""
    window = steps[fill:]
    if len(window) < 2:
        raise RuntimeError(f"{len(steps)} steps leave no window after the first {fill}")
    return (len(window) - 1) * per_step / (window[-1]["time"] - window[0]["time"])


def peak_in_flight(run_dir: Path, group_size: int) -> float:
    """The most samples the rollout actors held at once: per wall second, each actor's
    most groups in flight (its metric rows may share a second), summed over actors."""
    by_time: dict[int, float] = {}
    for path in sorted((run_dir / "metrics").glob("rollout-*.jsonl")):
        mine: dict[int, float] = {}
        for r in read_jsonl(path):
            key = round(r["time"])
            mine[key] = max(mine.get(key, 0.0), r.get("rollout/in_flight", 0.0))
        for key, groups in mine.items():
            by_time[key] = by_time.get(key, 0.0) + groups * group_size
    return max(by_time.values(), default=0.0)


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished children (the actors)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def load_test(args: argparse.Namespace) -> None:
    rungs = []
    with tempfile.TemporaryDirectory(prefix="cluster-load-") as tmp:
        for n in args.load_in_flight:
            for transport in args.load_transport:
                print(f"load: {n} in flight, {transport} ...", flush=True)
                run_dir = Path(tmp) / f"load-{n}-{transport}"
                rungs.append(asyncio.run(run_load(n, transport, args, run_dir)))
    print(f"{'in flight':>10}{'transport':>12}{'peak seen':>11}{'engines could':>15}"
          f"{'trained/s':>11}{'share':>7}{'CPU s/1k':>10}")  # fmt: skip
    for r in rungs:
        share = r["samples/s"] / r["target samples/s"]
        print(f"{r['target in flight']:>10}{r['transport']:>12}{r['peak in flight']:>11.0f}"
              f"{r['target samples/s']:>15.0f}{r['samples/s']:>11.0f}{share:>7.0%}"
              f"{r['cpu_s per 1k samples']:>10.2f}")  # fmt: skip
    out = args.out.with_name("cluster_load.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": _jsonable(args), "rungs": rungs}, indent=2) + "\n")
    print(f"wrote {out}")


def _jsonable(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=list(WORKLOADS), default="math-28k")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpus", type=int, default=128)
    ap.add_argument("--engine-gpus", type=int, default=1, help="GPUs per engine (its TP)")
    ap.add_argument("--rollout-share", type=float, default=0.5, help="split pools: rollout's")
    ap.add_argument("--concurrency", type=int, default=256, help="requests each engine decodes")
    ap.add_argument("--actors", type=int, default=2, help="rollout actors (processes)")
    ap.add_argument("--groups", type=int, default=128, help="prompt groups per step (B)")
    ap.add_argument("--group-size", type=int, default=16, help="samples per prompt")
    ap.add_argument("--decode-base-s", type=float, default=0.006, help="decode step, 1 request")
    ap.add_argument("--decode-s-per-seq", type=float, default=2e-5, help="added per request")
    ap.add_argument("--weight-update-s", type=float, default=5.0, help="engine loads weights")
    ap.add_argument("--switch-s", type=float, default=30.0, help="colocated memory swap")
    ap.add_argument("--train-base-s", type=float, default=10.0, help="train step fixed cost")
    ap.add_argument("--train-gpu-s-per-token", type=float, default=5e-4,
                    help="GPU-seconds per trained token (fwd, bwd, log-probs)")  # fmt: skip
    ap.add_argument("--train-scaling", type=float, default=1.0,
                    help="how train speed grows with GPUs: 1 linear, 0 not at all")  # fmt: skip
    ap.add_argument("--token-stride", type=int, default=32, help="modelled tokens per id")
    ap.add_argument("--time-scale", type=float, default=40.0, help="most modelled s per wall s")
    ap.add_argument("--wall-rate", type=float, default=400.0,
                    help="most samples a wall second the engines finish (time scale)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("bench/results/cluster_sim.json"))
    ap.add_argument("--load-test", action="store_true", help="the control plane's limits")
    ap.add_argument("--load-in-flight", type=int, nargs="+", default=[2000, 5000, 10000, 20000])
    ap.add_argument("--load-rate", type=float, default=4000, help="samples/s engines allow")
    ap.add_argument("--load-transport", nargs="+", default=["in-process", "http"],
                    choices=["in-process", "http"], help="rollout to engine calls")  # fmt: skip
    ap.add_argument("--load-tokens", type=int, default=16, help="ids per response")
    ap.add_argument("--load-engines", type=int, default=8, help="engines per rollout actor")
    ap.add_argument("--load-batch", type=int, default=2048, help="samples per train step")
    ap.add_argument("--load-step-s", type=float, default=0.05, help="train step (wall s)")
    ap.add_argument("--load-steps", type=int, default=12)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.load_test:
        load_test(args)
        return
    work = WORKLOADS[args.workload]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="cluster-sim-") as tmp:
        for mode in args.modes:
            engines, train_gpus = engines_of(mode, args)
            scale = time_scale(mode, args, work)
            print(f"running {mode}: {engines} engines, {train_gpus} training GPUs, "
                  f"time scale {scale:.2f}", flush=True)  # fmt: skip
            results[mode] = asyncio.run(run_mode(mode, args, work, Path(tmp) / mode))
    add_speedups(results)
    rows = comparisons(results)
    scales = sorted({round(r["time_scale"], 2) for r in results.values()})
    print(f"\n{args.workload}: {asdict(work)}; {args.gpus} GPUs, {args.concurrency} requests "
          f"an engine, B = {args.groups} x {args.group_size}; modelled seconds "
          f"(time scales {scales})")  # fmt: skip
    print_table(results)
    print_comparisons(rows)
    sync = results.get("sync-colocated")
    if sync:
        print(f"sync-colocated phases: G = {sync['wait_s']:.0f} s, T = {sync['step_s']:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"args": _jsonable(args), "workload": asdict(work), "modes": results,
               "published": rows, "median_step_s": {m: r["step_s"] for m, r in
                                                    results.items()}}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    plot(results, rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
