"""Start-up of a training job: from ``asyncrl train`` to the first trained step, per actor.

Runs ``asyncrl train CONFIG --train.num-steps 1 --eval.interval 0`` (default: the
real-model example; ``--eval`` keeps its eval actor) in a fresh process ``--repeats``
times, into ``runs/startup-bench/``, and reads every actor's JSON log and the first
step's metrics there. All times are seconds since the command was launched:

- ``actors up``: the controller has every actor's Hello (spawned, imports done);
- per actor, ``starting``: its first ``actor starting`` line (the process is spawned, its
  imports are done and its spec is read); ``running``: ``actor running`` (``setup()``
  done: models loaded, engines up, channels open);
- ``first step``: the trainer's first ``step`` line, and of it the seconds the trainer
  waited for its first batch and trained on it; ``exit``: the command returned.

Beside it, in fresh interpreters, the import time of each actor class's module and of the
CLI, the median of ``--repeats``. ``--repo DIR`` measures another checkout the same way,
in the same run, alternated (a before/after: ``git worktree add /tmp/before COMMIT``);
``--exec`` measures this checkout again with every actor exec'd (``--runtime.fork-server
false``) instead of forked from the zygote.

    .venv/bin/python bench/startup.py [--repeats 2] [--repo /tmp/before] [--exec]

prints a table and writes ``bench/results/startup.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODULES = {
    "cli": "asyncrl.cli",
    "trainer": "asyncrl.actors.trainer",
    "rollout": "asyncrl.actors.rollout",
    "buffer": "asyncrl.actors.buffer",
}


def import_seconds(repo: Path, module: str) -> float:
    """Wall seconds of ``import module`` in a fresh interpreter run from ``repo``."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=repo, check=True,
                         capture_output=True, text=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def stamp(line: dict[str, Any]) -> float:
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()


def milestones(run_dir: Path, launched: float) -> dict[str, float]:
    """Seconds since launch of each actor's start and setup, and of the first step."""
    out: dict[str, float] = {}
    for path in sorted((run_dir / "logs").glob("*.jsonl")):
        actor = path.stem
        for raw in path.read_text().splitlines():
            line = json.loads(raw)
            event, at = line.get("event"), stamp(line) - launched
            if actor == "controller" and event == "actors up":
                out.setdefault("actors up", at)
            elif event == "actor starting":
                out.setdefault(f"{actor} starting", at)
            elif event == "actor running":
                out.setdefault(f"{actor} running", at)
            elif event == "step" and "trainer" in actor:
                out.setdefault("first step", at)
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    out["first step: waited for data (s)"] = first["time/wait_data"]
    out["first step: trained (s)"] = first["time/step"]
    return out


def job(repo: Path, args: argparse.Namespace, run_dir: Path, extra: list[str]) -> dict[str, float]:
    """One ``asyncrl train`` of one step from ``repo`` (with ``extra`` flags); its milestones."""
    cmd = [sys.executable, "-c", "import sys; from asyncrl.cli import main; sys.exit(main())",
           "train", str(ROOT / args.config), "--train.num-steps", "1",
           "--output-dir", str(run_dir), "--overwrite"]  # fmt: skip
    cmd += ([] if args.eval else ["--eval.interval", "0"]) + extra
    env = {**os.environ, "PYTHONPATH": str(repo)}
    launched = time.time()
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    ended = time.time() - launched
    if done.returncode != 0:
        raise SystemExit(f"asyncrl train failed in {repo}:\n{done.stderr[-3000:]}")
    return milestones(run_dir, launched) | {"exit": ended}


def summarize(jobs: list[dict[str, float]], imports: dict[str, float]) -> dict[str, Any]:
    """Medians of each milestone over the repeats, in the order they happen."""
    keys = {k for j in jobs for k in j}
    med = {k: statistics.median(j[k] for j in jobs if k in j) for k in keys}
    return {"job": dict(sorted(med.items(), key=lambda kv: kv[1])), "runs": jobs,
            "imports": imports}  # fmt: skip


Variant = tuple[Path, list[str]]  # a checkout and the flags it runs with


def measure(repos: dict[str, Variant], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each variant's jobs in rounds (a slow spell hits all alike), then its imports."""
    jobs: dict[str, list[dict[str, float]]] = {name: [] for name in repos}
    for k in range(args.repeats):
        for name, (repo, extra) in repos.items():
            run_dir = ROOT / "runs" / "startup-bench" / f"{name}{k}"
            jobs[name].append(job(repo, args, run_dir, extra))
    out = {}
    for name, (repo, _) in repos.items():
        imports = {m: statistics.median(import_seconds(repo, mod) for _ in range(args.repeats))
                   for m, mod in MODULES.items()}  # fmt: skip
        out[name] = summarize(jobs[name], imports)
    return out


def report(results: dict[str, dict]) -> None:
    names = list(results)
    keys = list(dict.fromkeys(k for r in results.values() for k in r["job"]))
    print(f"{'seconds since launch':28}" + "".join(f"{n:>14}" for n in names))
    for key in keys:
        cells = [results[n]["job"].get(key) for n in names]
        print(f"{key:28}" + "".join(f"{c:14.1f}" if c is not None else f"{'-':>14}"
                                    for c in cells))  # fmt: skip
    print(f"{'import (s)':28}")
    for name in MODULES:
        print(f"  {name:26}" + "".join(f"{results[n]['imports'][name]:14.2f}" for n in names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/word_problems/config.yaml")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--eval", action="store_true", help="keep the config's eval actor")
    ap.add_argument("--repo", type=Path, help="also measure this checkout (before)")
    ap.add_argument("--exec", action="store_true", help="also run with every actor exec'd")
    ap.add_argument("--out", default="bench/results/startup.json")
    args = ap.parse_args()
    repos: dict[str, Variant] = {"now": (ROOT, [])}
    if args.exec:
        repos["exec"] = (ROOT, ["--runtime.fork-server", "false"])
    if args.repo:
        repos["before"] = (args.repo.resolve(), [])
    results = measure(repos, args)
    report(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results},
                                         indent=2, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
