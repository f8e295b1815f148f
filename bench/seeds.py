"""One config trained on several seeds, one after another: each seed's held-out curve,
and the mean +- standard error across seeds.

    asyncrl bench seeds CONFIG --seeds 0 1 2 3 4 --target-gain 0.2 [--root DIR] [-- FLAGS]

Seed ``S`` runs ``asyncrl train CONFIG --seed S --output-dir ROOT/seed_S --overwrite
FLAGS`` as a child process, timed from launch (the job's seed seeds the engines, the
prompt order and the trainer). A seed whose ``sweep.json`` records a finished run of the
same command, config file and data files (every file the resolved config names) is read,
not trained again, so an interrupted sweep goes on where it stopped; the commit each seed
trained at is kept and printed. A seed kept under other settings stops the sweep before
anything runs, unless ``--fresh`` (replace it); one sweep at a time holds ``--root``.
Flags the config refuses (read as ``asyncrl train`` reads them) stop it before then too.
Per seed: the eval set's ``--metric`` at each version, the gain (last version minus
version 0), wall seconds, trained samples/s after the first step, and the share of the
machine's CPU its host took over the run (``cpu_steal``, on a VM: seeds timed one after
another compare alike only where it stayed small).
Across seeds, per version: mean, standard error ``stdev / sqrt(n)``, min and max; and how
many seeds gained ``--target-gain`` or more. Writes ``ROOT/seeds.json`` and
``ROOT/seeds.png`` (each seed's curve and the mean). Exits 1 when a seed failed, with its
reason; the others are still reported.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl import hardware  # noqa: E402


def command(args: argparse.Namespace, seed: int) -> list[str]:
    """``asyncrl train`` for one seed."""
    out = args.root / f"seed_{seed}"
    return [sys.executable, "-m", "asyncrl.cli", "train", str(args.config), "--seed", str(seed),
            "--output-dir", str(out), "--overwrite", *args.flags]  # fmt: skip


def ident(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """What a seed's run depends on besides the code: its command line, the config file,
    and the data files (``data_files``)."""
    return {"command": command(args, seed)[1:], "config_sha256": sha256(args.config),
            "data_sha256": args.data}  # fmt: skip


def data_files(config: Path, flags: list[str]) -> dict[str, str]:
    """sha256 of every file the config, read as ``asyncrl train`` reads it with ``flags``,
    names (datasets, eval sets: a slice's ``@[a:b]`` dropped), by path as written;
    ``ConfigError`` where it does not load (every seed's job would fail alike)."""
    from asyncrl.cli import train_config

    with contextlib.chdir(ROOT):  # where each seed's job reads it from
        resolved = train_config([str(config), *flags]).model_dump(mode="json")
    found: dict[str, str] = {}

    def walk(value: Any) -> None:
        if isinstance(value, dict | list):
            for item in value.values() if isinstance(value, dict) else value:
                walk(item)
        elif isinstance(value, str) and value and len(value) < 4096:
            path = ROOT / value.split("@[", 1)[0]  # jobs run from the checkout
            if path.is_file() and path != config:
                found[value] = sha256(path)

    walk(resolved)
    return found


def kept_record(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """A seed's ``sweep.json`` ({} where missing or damaged)."""
    return read_json(args.root / f"seed_{seed}" / "sweep.json")


#: Parts of ``ident`` added since records were first kept: a record without one is taken
#: as it was kept.
ADDED_LATER = ("data_sha256",)


def differences(record: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """The parts of ``ident`` in which a kept run differs (one not recorded differs, but
    for ``ADDED_LATER``)."""
    return [k for k, v in want.items()
            if record.get(k, v if k in ADDED_LATER else None) != v]  # fmt: skip


def refuse_other_runs(args: argparse.Namespace) -> None:
    """Stop before anything runs where a seed's folder holds a finished run of another
    command, config or data: replacing it takes ``--fresh``."""
    held = []
    for seed in args.seeds:
        record = kept_record(args, seed)
        if record.get("rc") == 0 and (differ := differences(record, ident(args, seed))):
            held.append(f"seed_{seed}: other {', '.join(differ)}")
    if held and not args.fresh:
        raise SystemExit(f"{args.root} holds runs of other settings:\n  " + "\n  ".join(held)
                         + "\nPass --fresh to train them again (replacing them), or --root "
                         "DIR for a new sweep.")  # fmt: skip


def train(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Run (or reuse) one seed's job; its ``sweep.json`` record."""
    out = args.root / f"seed_{seed}"
    cmd = command(args, seed)
    record_path = out / "sweep.json"
    want = ident(args, seed)
    record = kept_record(args, seed)
    if record.get("rc") == 0 and not differences(record, want):
        print(f"seed {seed}: reusing {out} ({record['wall_s']:.0f} s, trained at "
              f"{record.get('commit')})", flush=True)  # fmt: skip
        return record
    record_path.unlink(missing_ok=True)  # the folder is about to hold another run
    print(f"seed {seed}: $ asyncrl {' '.join(cmd[3:])}", flush=True)
    start, cpu0 = time.time(), hardware.cpu_times()
    log = args.root / f"seed_{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # The job stops when the sweep dies (a kill -9 of it included).
    tied = [sys.executable, "-m", "asyncrl.runtime.tether", "--tie", str(os.getpid()), *cmd]
    with log.open("w") as sink:
        rc = run_to_end(tied, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
    record = {"seed": seed, **want, "commit": commit(), "rc": rc, "start": start,
              "wall_s": time.time() - start,
              "cpu": hardware.cpu_shares(cpu0, hardware.cpu_times())}  # fmt: skip
    if rc:
        record["reason"] = log.read_text().strip().splitlines()[-5:]
    if out.is_dir():
        write_json(record_path, record)
    if rc == 0 and not args.keep_checkpoints:
        # A real model's checkpoint with its optimizer is 1.6 GB: five seeds of two
        # checkpoints filled this workspace once. The curves need only the metrics.
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return record


def run_to_end(command: list[str], **popen: Any) -> int:
    """Run ``command``; its exit status. On Ctrl-C (which the terminal sends the child too)
    wait for it to stop in order, where ``subprocess.run`` would SIGKILL it after 0.25 s."""
    child = subprocess.Popen(command, **popen)
    try:
        return child.wait()
    except KeyboardInterrupt:
        child.wait()
        raise


def write_json(path: Path, body: Any) -> None:
    """``body`` into ``path`` through a ``.part`` file and a rename: a kill leaves the old
    file or the new one, never half of one."""
    part = path.with_name(f"{path.name}.part")
    part.write_text(json.dumps(body, indent=2, default=str) + "\n")
    part.replace(path)


def read_json(path: Path) -> dict[str, Any]:
    """``path``'s JSON object, or {} where it is missing or damaged (said)."""
    if not path.is_file():
        return {}
    try:
        body = json.loads(path.read_text())
    except ValueError:
        print(f"{path}: damaged, read as absent", flush=True)
        return {}
    return body if isinstance(body, dict) else {}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def commit() -> str:
    """This tree's commit, ``+`` when it has uncommitted changes to tracked files."""

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return head + ("+" if git("status", "--porcelain", "--untracked-files=no").strip() else "")


def read_seed(
    record: dict[str, Any],
    out: Path,
    eval_set: str | None,
    metric: str,
    threshold: float | None = None,
) -> dict:
    """One seed's figures from its run folder: the curve, the trainer's throughput
    (trained samples and loss tokens a second after the first step), and the wall
    seconds from launch to the end of the step of the first version at ``threshold``."""
    from asyncrl.api import open_run

    run = open_run(out)
    sets = sorted({r["set"] for r in run.evals})
    if eval_set is None and len(sets) > 1:
        raise SystemExit(f"{out}: eval sets {sets}: name one with --set")
    if eval_set is not None and eval_set not in sets:
        raise SystemExit(f"{out}: no eval set {eval_set!r} (its sets: {sets})")
    rows = [r for r in run.evals if eval_set in (None, r["set"])]
    if missing := [r["version"] for r in rows if metric not in r]:
        raise SystemExit(f"{out}: no {metric!r} in the eval rows of versions {missing}")
    curve = {int(r["version"]): float(r[metric]) for r in rows}
    config = json.loads((out / "config.json").read_text())
    groups, n = config["buffer"]["groups_per_step"], config["buffer"]["num_samples_per_prompt"]
    steps = [r for r in run.metrics if "num_tokens" in r]
    trained = sum((groups - int(r.get("batch/dropped_groups", 0))) * n for r in steps[1:])
    tokens = sum(float(r["num_tokens"]) for r in steps[1:])
    span = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else 0.0
    versions = sorted(curve)
    ends = {int(r["step"]): float(r["time"]) - record["start"] for r in steps}
    reached = next((v for v in versions if threshold is not None and curve[v] >= threshold), None)
    if reached and reached not in ends:  # its step's row is gone: unknown, not "at launch"
        raise SystemExit(f"{out}: version {reached} reached the threshold but its step has no "
                         "row in metrics.jsonl")  # fmt: skip
    return {"seed": record["seed"], "commit": record.get("commit"),
            "wall_s": record["wall_s"], "steps": len(steps),
            "cpu_steal": (record.get("cpu") or {}).get("steal"),
            "samples/s": trained / span if span > 0 else None,
            "tokens/s": tokens / span if span > 0 else None,
            "time_to_threshold_s": None if reached is None else ends.get(reached, 0.0),  # v0: 0
            "curve": {v: curve[v] for v in versions},
            "gain": curve[versions[-1]] - curve[0] if 0 in curve else None}  # fmt: skip


def mean_se(values: list[float]) -> dict[str, Any]:
    """Mean, standard error of the mean (stdev / sqrt(n); None for one value: unknown),
    min, max, n."""
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return {"mean": statistics.fmean(values), "se": se, "min": min(values),
            "max": max(values), "n": len(values)}  # fmt: skip


def summarize(seeds: list[dict[str, Any]], target_gain: float | None) -> dict[str, Any]:
    """Across seeds: per version (those every seed has) and for gain, wall and speed."""
    common = set.intersection(*(set(s["curve"]) for s in seeds)) if seeds else set()
    out: dict[str, Any] = {
        "versions": {v: mean_se([s["curve"][v] for s in seeds]) for v in sorted(common)},
    }
    for key in ("gain", "wall_s", "samples/s", "tokens/s", "time_to_threshold_s", "cpu_steal"):
        values = [s[key] for s in seeds if s.get(key) is not None]
        out[key] = mean_se(values) if values else None
    if out["time_to_threshold_s"] is not None:  # a mean over the seeds that got there
        out["time_to_threshold_s"]["of"] = len(seeds)
    if target_gain is not None:
        met = [s["seed"] for s in seeds if s["gain"] is not None and s["gain"] >= target_gain]
        out["target"] = {"gain": target_gain, "met": len(met), "of": len(seeds), "seeds": met}
    return out


def print_report(seeds: list[dict[str, Any]], summary: dict[str, Any], metric: str) -> None:
    versions = list(summary["versions"])
    cols = (("gain", "+.1%"), ("wall_s", ".0f"), ("samples/s", ".2f"), ("tokens/s", ".1f"),
            ("time_to_threshold_s", ".0f"), ("cpu_steal", ".1%"))  # fmt: skip
    heads = ("gain", "wall s", "samples/s", "tokens/s", "to thr. s", "steal")
    print(f"\n{metric} per weight version" + "".join(f"{'v' + str(v):>9}" for v in versions)
          + "".join(f"{h:>11}" for h in heads))  # fmt: skip
    for s in seeds:
        cells = ["-" if s.get(k) is None else format(s[k], f) for k, f in cols]
        print(f"{'seed ' + str(s['seed']):<22}"
              + "".join(f"{s['curve'].get(v, math.nan):>9.1%}" for v in versions)
              + "".join(f"{c:>11}" for c in cells))  # fmt: skip
    cells = [f"{m['mean']:>6.1%}{pm(m['se'], 100)}" for m in summary["versions"].values()]
    print(f"{'mean +- s.e.':<22}" + "".join(f"{c:>9}" for c in cells))
    gain = summary["gain"]
    if gain:
        print(f"gain: {gain['mean']:+.1%}{pm(gain['se'], 100, ' points')} (min "
              f"{gain['min']:+.1%}, max {gain['max']:+.1%}) over {gain['n']} seeds")  # fmt: skip
    for key, f in cols[1:]:
        if stats := summary[key]:
            over = f"{stats['n']} of {stats['of']}" if "of" in stats else str(stats["n"])
            scale = 100 if f.endswith("%") else 1  # a share's s.e. in points
            print(f"{key}: {stats['mean']:{f}}{pm(stats['se'], scale)} over {over} seeds")
    if len(commits := sorted({str(s["commit"]) for s in seeds})) > 1:
        print(f"note: the seeds trained at {len(commits)} commits: {', '.join(commits)}")
    if "target" in summary:
        t = summary["target"]
        print(f"{t['met']} of {t['of']} seeds gained {t['gain']:.0%} or more")


def pm(se: float | None, scale: float = 1.0, unit: str = "") -> str:
    """``+-se`` (times ``scale``), or ``(n=1)`` where one value leaves it unknown."""
    return " (n=1)" if se is None else f"+-{se * scale:.1f}{unit}"


def plot(seeds: list[dict[str, Any]], summary: dict[str, Any], path: Path, title: str) -> None:
    """Each seed's curve (thin) and the mean with its +- s.e. band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in seeds:
        ax.plot(list(s["curve"]), list(s["curve"].values()), lw=1, alpha=0.6, marker=".",
                label=f"seed {s['seed']}")  # fmt: skip
    versions = list(summary["versions"])
    mean = [m["mean"] for m in summary["versions"].values()]
    se = [m["se"] or 0.0 for m in summary["versions"].values()]
    ax.plot(versions, mean, color="k", lw=2, label="mean")
    ax.fill_between(
        versions,
        [m - e for m, e in zip(mean, se, strict=True)],
        [m + e for m, e in zip(mean, se, strict=True)],
        color="k",
        alpha=0.15,
    )
    ax.set(title=title, xlabel="weight version", ylabel="held-out pass@1")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_json(payload: dict[str, Any], path: Path) -> None:
    """``asyncrl plot ROOT/seeds.json``: the figure again from the JSON."""
    seeds = [s | {"curve": {int(v): a for v, a in s["curve"].items()}} for s in payload["seeds"]]
    summary = payload["summary"] | {
        "versions": {int(v): m for v, m in payload["summary"]["versions"].items()}
    }
    plot(seeds, summary, path, Path(payload["config"]).parent.name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Flags after -- go to every seed's asyncrl train (e.g. -- "
        "--rollout.reward.truncated 0); --seed and --output-dir are the sweep's.",
    )
    ap.add_argument("config", type=Path)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--root", type=Path, default=None, help="default: runs/seeds/<config's dir>")
    ap.add_argument("--set", dest="eval_set", default=None, help="eval set (default: every row)")
    ap.add_argument("--metric", default="pass@1")
    ap.add_argument("--target-gain", type=float, default=None, help="e.g. 0.2: 20 points")
    ap.add_argument("--fresh", action="store_true",
                    help="forget the seeds' finished runs kept in --root and train them again "
                    "(without it, one kept under other settings is refused; an interrupted "
                    "--fresh sweep goes on without it)")  # fmt: skip
    ap.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep each seed's checkpoints (default: removed once it finished)",
    )
    ap.add_argument("--threshold", type=float, default=None,
                    help="time each seed to this accuracy (seconds from launch to the end "
                    "of the first version's step that reaches it)")  # fmt: skip
    args = ap.parse_args(argv)
    if not args.config.is_file():
        ap.error(f"{args.config}: no such config")
    if taken := [f for f in flags if f.split("=")[0] in ("--seed", "--output-dir")]:
        ap.error(f"{taken}: the sweep sets each seed's seed and folder; drop them after --")
    if len(set(args.seeds)) != len(args.seeds):
        ap.error(f"--seeds {args.seeds}: a seed is named twice")
    args.flags = flags
    args.root = (args.root or Path("runs/seeds") / args.config.resolve().parent.name).resolve()
    args.config = args.config.resolve()
    from asyncrl.config import ConfigError

    try:
        args.data = data_files(args.config, flags)
    except ConfigError as exc:  # before anything runs: each seed's job would refuse it
        ap.error(f"{args.config} with {' '.join(flags) or 'no flags'}:\n{exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    lock = (args.root / ".lock").open("w")  # held to exit: a second sweep would clobber ours
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"--root {args.root}: another sweep is using it") from None
    if args.fresh:  # replaced now, so an interrupted --fresh sweep goes on without it
        for seed in args.seeds:
            (args.root / f"seed_{seed}" / "sweep.json").unlink(missing_ok=True)
    refuse_other_runs(args)
    records = [train(args, seed) for seed in args.seeds]
    failed = [r for r in records if r["rc"]]
    seeds = [read_seed(r, args.root / f"seed_{r['seed']}", args.eval_set, args.metric,
                       args.threshold) for r in records if not r["rc"]]  # fmt: skip
    summary = summarize(seeds, args.target_gain)
    print_report(seeds, summary, args.metric)
    payload = {"config": str(args.config), "flags": args.flags, "metric": args.metric,
               "seeds": seeds, "summary": summary, "failed": failed}  # fmt: skip
    write_json(args.root / "seeds.json", payload)
    if seeds and summary["versions"]:
        plot(seeds, summary, args.root / "seeds.png", args.config.parent.name)
    print(f"wrote {args.root / 'seeds.json'}")
    for r in failed:
        print(f"seed {r['seed']} FAILED (rc {r['rc']}): {' | '.join(r.get('reason', []))}")
    return 1 if failed or not seeds else 0


if __name__ == "__main__":
    sys.exit(main())
