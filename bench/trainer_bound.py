"""Where a vs-trl seed's asyncrl time goes on this machine, and what separate cores give.

    python bench/trainer_bound.py --seed 4 --dtype bf16 \\
        --trl-result docs/data/vs_trl_real_bf16_share/real/seed_4/result.json

Three runs of ``bench/vs_trl.py``'s asyncrl job on the real model, one after another:
the job itself with every batch it trains dumped; its trainer alone on those batches
(replayed from the same weights: the losses must repeat at every step); its engine alone
at version 0 (rollout-only), for the engine's seconds per generated token ``g``.

Per step i (2..N), with ``J_i`` the job's trainer step, ``U_i`` the trainer's alone and
``T_i`` the step's response tokens, the engine alone needs ``G_i = g T_i``. Where the
engine and the trainer have their own cores the step is ``max(U_i, G_i)``; ``U_i`` is the
floor on any machine where generation costs nothing. Writes JSON; prints the means and,
given a seed's TRL result, each step against TRL's.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import vs_trl  # noqa: E402


def run(flags: list[str], out: Path, extra: list[str]) -> float:
    """``asyncrl train`` with ``flags`` writing to ``out``; its wall seconds."""
    flags = list(flags)
    flags[flags.index("--output-dir") + 1] = str(out)
    command = [sys.executable, "-m", "asyncrl.cli", "train", *flags, *extra]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)}\nrc {done.returncode}:\n{done.stderr[-4000:]}")
    return time.perf_counter() - start


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def span_per_step(steps: list[dict[str, Any]]) -> float:
    """Wall seconds a step from the first step's end to the last's (saves included)."""
    return (steps[-1]["time"] - steps[0]["time"]) / (len(steps) - 1)


def summarize(
    job: list[dict[str, Any]], alone: list[dict[str, Any]], rollout: list[dict[str, Any]]
) -> dict[str, Any]:
    """The per-step arithmetic of the module docstring over steps 2..N (step 1 waits for
    the first batch and warms up). ``rollout``: the rollout-only run's batch rows."""
    if len(job) != len(alone) or len(job) < 3 or len(rollout) < 3:
        raise ValueError(f"steps: job {len(job)}, alone {len(alone)}, rollout {len(rollout)}")
    g = (rollout[-1]["time"] - rollout[0]["time"]) / sum(r["tokens"] for r in rollout[1:])
    table = [{"step": j["step"], "tokens": j["num_tokens"], "job_s": j["time/step"],
              "alone_s": u["time/step"], "engine_s": g * j["num_tokens"],
              "loss_job": j["loss"], "loss_alone": u["loss"]}
             for j, u in zip(job[1:], alone[1:], strict=True)]  # fmt: skip
    mean = {k: statistics.fmean(r[k] for r in table) for k in ("job_s", "alone_s", "engine_s")}
    own = statistics.fmean(max(r["alone_s"], r["engine_s"]) for r in table)
    return {
        "steps": table,
        "replay_matches": all(r["loss_job"] == r["loss_alone"] for r in table),
        "engine_s_per_token": g,
        "mean": mean | {"own_cores_s": own},
        "wall_per_step": {"job": span_per_step(job), "alone": span_per_step(alone)},
        "engine_busy": mean["engine_s"] / mean["alone_s"],
    }


def against_trl(summary: dict[str, Any], trl: dict[str, Any]) -> dict[str, float]:
    """Each wall step over TRL's (its generate + train + save, ``step_s``): the time to
    accuracy ratio at equal learning per step, before start-up."""
    step = trl["step_s"]
    wall = summary["wall_per_step"]
    saves = wall["alone"] - summary["mean"]["alone_s"]  # the same saves in both runs
    return {"trl_step_s": step, "job": wall["job"] / step, "trainer_alone": wall["alone"] / step,
            "own_cores": (summary["mean"]["own_cores_s"] + saves) / step}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=list(vs_trl.DTYPE_FLAGS), default="bf16")
    parser.add_argument("--steps", type=int, default=None, help="default: the bench's 16")
    parser.add_argument("--work", type=Path, default=Path("runs/trainer-bound"))
    parser.add_argument("--trl-result", type=Path, help="a seed's vs-trl result.json")
    parser.add_argument("--out", type=Path, default=Path("bench/results/trainer_bound.json"))
    args = parser.parse_args(argv)
    trl = None
    if args.trl_result:  # before anything runs: a wrong path fails at once
        if not args.trl_result.is_file():
            parser.error(f"--trl-result {args.trl_result}: no such file")
        trl = json.loads(args.trl_result.read_text())["result"]["frameworks"]["trl"]
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    lock = (work / ".lock").open("w")  # held to exit: a second copy would delete our runs
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        parser.error(f"--work {work}: another trainer_bound run is using it")
    bench = vs_trl.parse_args(["--model", "real", "--dtype", args.dtype, "--work", str(work)]
                              + (["--steps", str(args.steps)] if args.steps else []))  # fmt: skip
    model = vs_trl.ensure_model("real", work, args.seed)["path"]
    spec = vs_trl.run_spec(bench, "real", model, "asyncrl", args.seed)
    flags = [spec["config"], *vs_trl.asyncrl_flags(spec)]
    dump = work / "dump"
    for old in ("job", "alone", "rollout", "dump", "dump0"):  # this bench's own folders
        shutil.rmtree(work / old, ignore_errors=True)
    walls = {"job": run(flags, work / "job", ["--save-debug-rollout-data", str(dump)]),
             "alone": run(flags, work / "alone", ["--load-debug-rollout-data", str(dump)]),
             "rollout": run(flags, work / "rollout",
                            ["--debug-rollout-only", "--save-debug-rollout-data",
                             str(work / "dump0")])}  # fmt: skip
    summary = summarize(rows(work / "job" / "metrics.jsonl"),
                        rows(work / "alone" / "metrics.jsonl"),
                        rows(work / "rollout" / "metrics.jsonl"))  # fmt: skip
    summary |= {"walls": walls, "spec": spec, "commit": vs_trl.commit()}
    if trl is not None:
        summary["against_trl"] = against_trl(summary, trl)
    report(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    if not summary["replay_matches"]:  # then "alone" timed other work than the job's
        raise SystemExit("the trainer alone did not repeat the job's losses: no figures")


def report(s: dict[str, Any]) -> None:
    m, w = s["mean"], s["wall_per_step"]
    print(f"replayed losses repeat the job's: {s['replay_matches']}")
    print(f"trainer step, steps 2-N: in the job {m['job_s']:.2f} s, alone {m['alone_s']:.2f} s; "
          f"engine alone {m['engine_s']:.2f} s ({s['engine_s_per_token'] * 1e3:.2f} ms a token); "
          f"own cores {m['own_cores_s']:.2f} s")  # fmt: skip
    print(f"wall a step (saves included): job {w['job']:.2f} s, trainer alone {w['alone']:.2f} s")
    if t := s.get("against_trl"):
        print(f"over TRL's {t['trl_step_s']:.2f} s step: job {t['job']:.3f}x, own cores "
              f"{t['own_cores']:.3f}x, trainer alone {t['trainer_alone']:.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
