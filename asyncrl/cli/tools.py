"""``asyncrl plot``, ``bench``, ``export`` and ``keys``: figures, the benchmark scripts, a
run's policy as an HF folder, a job's CurveZMQ keys."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_plot(sub: argparse._SubParsersAction) -> None:
    plot = sub.add_parser(
        "plot",
        help="draw PNG figures of a training run or a benchmark's results",
        description="Draw reward, eval, throughput, staleness and actor-timeline figures "
        "(PNG) from the metrics files of a run directory; figures whose inputs are missing "
        "are skipped. Given a benchmark's JSON (bench/results/NAME.json), draw that "
        "benchmark's figure. Prints the paths written.",
    )
    plot.add_argument(
        "run_dir",
        type=Path,
        metavar="RUN_DIR",
        help="run directory (holds metrics.jsonl), or a benchmark's results JSON",
    )
    plot.add_argument(
        "--out",
        type=Path,
        metavar="PATH",
        help="output directory (default: RUN_DIR/plots); for a JSON, the PNG (default: "
        "the JSON's path with .png)",
    )
    sub.add_parser(
        "bench",
        help="run a benchmark of bench/ (asyncrl bench --help lists them)",
        description="asyncrl bench NAME [flags]: runs bench/NAME.py of the repository with "
        "the flags given; each prints a side-by-side table and writes JSON to bench/results.",
    )


def add_export(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser(
        "export",
        help="copy a run's trained policy out as a plain HF model folder",
        description="Copy the policy of a trainer checkpoint of RUN_DIR (the newest, or "
        "--step N) to OUT: config, generation config, weights, tokenizer and chat "
        "template, without the optimizer state. AutoModelForCausalLM and AutoTokenizer "
        "load OUT as it is.",
    )
    export.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's output_dir")
    export.add_argument("out", type=Path, metavar="OUT", help="new (or empty) folder")
    export.add_argument("--step", type=int, help="the checkpoint's step (default: newest)")
    export.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run's adapters alone, in peft's layout (the policy folder holds the "
        "merged weights)",
    )


def export(args: argparse.Namespace) -> int:
    from asyncrl.export import ExportError, export_policy

    try:
        out = export_policy(args.run_dir, args.out, args.step, adapter=args.adapter)
    except ExportError as exc:
        print(f"asyncrl export: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def keys(args: argparse.Namespace) -> int:
    from asyncrl.wire import security

    try:
        public, secret = security.generate(args.dir)
    except (FileExistsError, OSError) as exc:
        print(f"asyncrl keys: {exc}", file=sys.stderr)
        return 2
    print(f"{public}\n{secret}  (secret: keep it 0600, on the job's nodes only)")
    return 0


#: The repository's benchmark scripts (an editable install: the package sits beside them).
_BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def _bench_names() -> list[str]:
    """``NAME`` for every ``bench/NAME.py`` with a ``main`` (``_`` written ``-``)."""
    if not _BENCH_DIR.is_dir():
        return []
    scripts = (p for p in sorted(_BENCH_DIR.glob("*.py")) if "def main(" in p.read_text())
    return [p.stem.replace("_", "-") for p in scripts]


def bench(argv: list[str]) -> int:
    names = _bench_names()
    if not argv or argv[0] in ("-h", "--help"):
        usage = "usage: asyncrl bench NAME [--<flag> VALUE ...]   (NAME --help: its flags)"
        print(f"{usage}\nbenchmarks: {', '.join(names) or f'none: no {_BENCH_DIR}'}")
        return 0 if argv else 2
    if argv[0] not in names:
        where = f"one of {', '.join(names)}" if names else f"none found: no {_BENCH_DIR}"
        print(f"asyncrl bench: no benchmark {argv[0]!r} ({where})", file=sys.stderr)
        return 2
    import subprocess

    script = _BENCH_DIR / f"{argv[0].replace('-', '_')}.py"
    # From the repository root: the scripts name the examples by relative path.
    return subprocess.call([sys.executable, str(script), *argv[1:]], cwd=_BENCH_DIR.parent)


def _plot_bench(path: Path, out: Path | None) -> int:
    """Draw ``bench/<stem>.py``'s figure from its results JSON ``path``."""
    import importlib.util

    script = _BENCH_DIR / f"{path.stem}.py"
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"asyncrl plot: {path}: {exc}", file=sys.stderr)
        return 2
    if not script.is_file():
        print(f"asyncrl plot: {path} names no benchmark ({script} is missing)", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    sys.path.insert(0, str(_BENCH_DIR.parent))  # the scripts import bench.overlap and asyncrl
    spec.loader.exec_module(module)
    if not hasattr(module, "plot_json"):
        print(f"asyncrl plot: {script.name} draws no figure from JSON", file=sys.stderr)
        return 2
    target = out or path.with_suffix(".png")
    try:
        module.plot_json(payload, target)
    except (KeyError, TypeError, ValueError) as exc:
        print(f"asyncrl plot: {path} is not {script.name}'s results: {exc!r}", file=sys.stderr)
        return 2
    print(target)
    return 0


def plot(args: argparse.Namespace) -> int:
    if args.run_dir.suffix == ".json" and args.run_dir.is_file():
        return _plot_bench(args.run_dir, args.out)
    if not (args.run_dir / "metrics.jsonl").is_file():
        print(
            f"asyncrl plot: {args.run_dir} is not a run directory (no metrics.jsonl)",
            file=sys.stderr,
        )
        return 2
    from asyncrl.observe.logs import configure_logging
    from asyncrl.observe.plots import plot_run

    configure_logging(actor="plot")  # skipped lines are warned about on stderr
    for path in plot_run(args.run_dir, args.out or args.run_dir / "plots"):
        print(path)
    return 0
