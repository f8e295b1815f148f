"""Soak: a long CPU run under chaos; restarts, losses, memory growth and throughput.

    python bench/soak.py [--minutes 30] [--every 120] [--seed 0] [--config PATH] [--out PATH]

The job is the arith example (``examples/arith``: the shipped 1M-parameter model, GRPO,
eval every 50 versions) with two rollout actors, each with its own engine actor, and a
trainer checkpoint every 10 steps. ``--every 0`` kills nothing: a memory soak of the
``--config`` job as it is configured (e.g. ``examples/word_problems/config.yaml``, the
real model), with a checkpoint every 10 steps. ``asyncrl.runtime.chaos.Chaos`` SIGKILLs a random
actor of any role every ``--every`` seconds (one at a time: the next kill waits until
the last victim is back) and stops the trainer after ``--minutes``; the supervisor
restarts every victim. A monitor samples each actor's resident memory
(``/proc/PID/status`` VmRSS) and the trainer's version every 5 s.

Reported (and written as JSON):

- restarts, and the audit: ``lost`` (admitted groups in no state of the ledger),
  ``duplicated`` (groups in two trained batches), ``untrained`` (consumed, never
  trained); all must be 0;
- resident-memory slope per actor, MB/min: least squares over each incarnation's samples
  after its first ``--warmup`` minutes (allocators and caches settle first), for the
  longest incarnation with at least 3 minutes left (target < 1 MB/min);
- throughput around each restart: trained samples/s over the ``--window`` seconds before
  the kill and over the same span after the victim was running again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import load_config  # noqa: E402
from asyncrl.job import run_job  # noqa: E402
from asyncrl.runtime.chaos import Chaos, audit_run, chaos_report  # noqa: E402
from asyncrl.runtime.supervisor import ActorDied, Supervisor  # noqa: E402

SAMPLE_S = 5.0


@dataclass
class Sample:
    """One monitor reading: seconds since the actors were up, actor, pid, RSS, version."""

    t: float
    actor: str
    pid: int
    rss_mb: float
    trainer_version: int


class Soak(Chaos):
    """Chaos plus a monitor of every actor's memory and the trainer's progress."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.samples: list[Sample] = []

    async def run(self, sup: Supervisor) -> None:
        async with asyncio.TaskGroup() as tg:
            monitor = tg.create_task(self._monitor(sup), name="soak.monitor")
            try:
                await super().run(sup)
            finally:
                monitor.cancel()

    async def _monitor(self, sup: Supervisor) -> None:
        try:
            await sup.wait_until(lambda _: sup.up)
        except ActorDied:
            return  # the job failed before it was up
        while True:
            t = round(time.monotonic() - self._start, 2)
            version = sup.status["trainer"].version
            for name, handle in list(sup.handles.items()):
                rss = _rss_mb(handle.pid) if handle.exit_code is None else None
                if rss is not None and handle.pid is not None:
                    self.samples.append(Sample(t, name, handle.pid, rss, version))
            await asyncio.sleep(SAMPLE_S)


def _rss_mb(pid: int | None) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        return None
    return None


def fresh_run_dir(run_dir: Path) -> None:
    """The soak measures one fresh job: an earlier run in ``run_dir`` (its logs, metrics,
    audit log and checkpoints) is removed first; a directory that is not a run is refused."""
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return
    if not (run_dir / "logs").is_dir() and not (run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"soak: {run_dir} is not empty and holds no earlier run; pick another")
    shutil.rmtree(run_dir)


def job_flags(run_dir: Path, seed: int, chaos: bool = True) -> list[str]:
    """A job that runs until the soak stops it; under chaos, with engine actors of their
    own to kill and the restart budgets to come back."""
    flags = [
        "--name", "soak", "--output-dir", str(run_dir), "--seed", str(seed),
        "--train.num-steps", "1000000", "--save-interval", "10",
        "--train.keep-checkpoints", "2", "--train.audit-log", "true", "--num-epoch", "1000",
    ]  # fmt: skip
    if chaos:
        flags += [
            "--rollout.num-actors", "2", "--rollout.max-groups", "24",
            "--rollout.engine.serve", "actor", "--update-weight-transport", "disk",
            "--runtime.max-restarts", "1000", "--runtime.buffer-checkpoint-interval", "30",
        ]  # fmt: skip
    return flags


def memory_slopes(samples: list[Sample], warmup_s: float) -> dict[str, dict[str, float]]:
    """Per actor: MB/min over its longest incarnation past ``warmup_s`` (least squares)."""
    by_incarnation: dict[tuple[str, int], list[Sample]] = defaultdict(list)
    for s in samples:
        by_incarnation[(s.actor, s.pid)].append(s)
    out: dict[str, dict[str, float]] = {}
    for (actor, _pid), rows in by_incarnation.items():
        settled = [r for r in rows if r.t - rows[0].t >= warmup_s]
        span = settled[-1].t - settled[0].t if len(settled) > 1 else 0.0
        if span < 180.0 or span <= out.get(actor, {}).get("minutes", 0.0) * 60:
            continue
        t = np.array([r.t for r in settled]) / 60.0
        rss = np.array([r.rss_mb for r in settled])
        slope = float(np.polyfit(t, rss, 1)[0])
        out[actor] = {"mb_per_min": round(slope, 3), "minutes": round(span / 60, 1),
                      "rss_start_mb": round(float(rss[0]), 1),
                      "rss_end_mb": round(float(rss[-1]), 1)}  # fmt: skip
    return out


def throughput_around(
    samples: list[Sample], kills: list[dict[str, Any]], window: float, per_step: int
) -> list[dict[str, Any]]:
    """Trained samples/s in ``window`` s before each kill and after its victim was back."""
    series = sorted({(s.t, s.trainer_version) for s in samples if s.actor == "trainer"})
    out = []
    for k in kills:
        before = _rate(series, k["at_s"] - window, k["at_s"])
        back = k["back_s"]
        after = _rate(series, back, back + window) if back is not None else None
        row = {"victim": k["actor"], "at_s": k["at_s"], "down_s": None, "before": before,
               "after": after}  # fmt: skip
        if back is not None:
            row["down_s"] = round(back - k["at_s"], 1)
        for key in ("before", "after"):
            if row[key] is not None:
                row[key] = round(row[key] * per_step, 1)
        out.append(row)
    return out


def _rate(series: list[tuple[float, int]], t0: float, t1: float) -> float | None:
    """Versions per second between ``t0`` and ``t1`` (None without samples spanning it)."""
    inside = [(t, v) for t, v in series if t0 <= t <= t1]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 0.5 * (t1 - t0):
        return None
    (ta, va), (tb, vb) = inside[0], inside[-1]
    return (vb - va) / (tb - ta)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--every", type=float, default=120.0,
                        help="seconds between kills; 0: none, a memory soak")  # fmt: skip
    parser.add_argument("--config", default="examples/arith/config.yaml")
    parser.add_argument("--warmup", type=float, default=5.0, help="minutes before slopes count")
    parser.add_argument(
        "--analyse", type=Path, help="recompute the memory and throughput figures of a report"
    )
    parser.add_argument("--window", type=float, default=60.0, help="throughput window, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "soak")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    args = parser.parse_args()
    if args.analyse is not None:
        return analyse(args)

    import os

    fresh_run_dir(args.run_dir)
    os.chdir(ROOT)  # the example's config names its files relative to the repository
    chaos = args.every > 0
    cfg = load_config(args.config, overrides=job_flags(args.run_dir, args.seed, chaos))
    from asyncrl.runtime.recovery import restart_budgets

    roles = tuple(r for r, n in restart_budgets(cfg).items() if n > 0)
    every = args.every if chaos else None
    soak = Soak([], every=every, duration=args.minutes * 60, seed=args.seed, roles=roles)
    start = time.monotonic()
    result = asyncio.run(run_job(cfg, chaos=soak))
    audit = audit_run(args.run_dir, 0)
    report = chaos_report(result, soak, audit)
    per_step = cfg.buffer.groups_per_step * cfg.buffer.num_samples_per_prompt
    report["memory"] = memory_slopes(soak.samples, args.warmup * 60)
    report["throughput"] = throughput_around(soak.samples, report["kills"], args.window, per_step)
    report["minutes"] = round((time.monotonic() - start) / 60, 1)
    report["samples_per_step"] = per_step
    report["warmup_min"] = args.warmup
    report["samples"] = [asdict(s) for s in soak.samples]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print_summary(report)
    print(f"written to {args.out}")
    return 0 if report["ok"] else 1


def analyse(args: argparse.Namespace) -> int:
    """Recompute a saved report's figures (another ``--warmup`` or ``--window``)."""
    report = json.loads(args.analyse.read_text())
    samples = [Sample(**s) for s in report["samples"]]
    per_step = report.get("samples_per_step", 256)
    report["memory"] = memory_slopes(samples, args.warmup * 60)
    report["throughput"] = throughput_around(samples, report["kills"], args.window, per_step)
    print_summary(report)
    return 0


def print_summary(report: dict[str, Any]) -> None:
    a = report["audit"]
    print(f"\nsoak: {report['minutes']} min, {len(report['kills'])} kills, "
          f"{len(report['restarts'])} restarts, job ok={report['job']['ok']}")  # fmt: skip
    print(f"audit: admitted {a['admitted']}, consumed {a['consumed']}, lost {a['lost']}, "
          f"duplicated {a['duplicated']}, untrained {a['untrained']}, "
          f"final version {a['final_version']}; problems: {a['problems'] or 'none'}")  # fmt: skip
    print("\nresident memory, MB/min (the longest incarnation, after its warm-up):")
    for actor, m in sorted(report["memory"].items()):
        print(f"  {actor:10s} {m['mb_per_min']:+7.3f} over {m['minutes']:5.1f} min "
              f"({m['rss_start_mb']:.0f} -> {m['rss_end_mb']:.0f} MB)")  # fmt: skip
    print("\ntrained samples/s around each restart:")
    for row in report["throughput"]:
        print(f"  {row['victim']:10s} at {row['at_s']:7.1f}s down {row['down_s']}s: "
              f"before {row['before']} after {row['after']}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
