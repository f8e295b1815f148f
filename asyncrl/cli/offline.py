"""``asyncrl sft`` and ``asyncrl eval``: supervised fine-tuning, and a model folder scored
on eval sets, in this process."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.cli.args import KEYS_HELP, add_help_all, add_job_source


def add_sft(sub: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    sft = sub.add_parser(
        "sft",
        allow_abbrev=False,
        help="supervised fine-tuning on chat or prompt/response rows",
        description="Supervised fine-tuning with the torch trainer. Rows are chat "
        "({'messages': [...]}, loss on assistant turns) or {'prompt', 'response'} pairs.",
    )
    sft.add_argument("config", nargs="?", help="YAML config file")
    sft.add_argument("--model", help="HF model directory (same as --hf-checkpoint)")
    if argv[:1] == ["sft"]:  # the trainer's flags need torch: only when asked for
        from asyncrl.config import add_arguments
        from asyncrl.trainers.sft import job_model

        add_arguments(sft, job_model())


def add_eval(sub: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    from asyncrl.config import add_arguments, everyday

    ev = sub.add_parser(
        "eval",
        allow_abbrev=False,
        help="score a model folder on eval sets (the eval actor's pass@k)",
        description="Score a model folder on held-out sets with the eval actor's code: "
        "the config's rollout sampling, reward and workflow, and its eval.sets (or "
        f"--eval-sets). {KEYS_HELP}",
    )
    add_job_source(ev)
    ev.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="an HF model folder, or a checkpoint folder with one in policy/",
    )
    ev.add_argument("--out", type=Path, metavar="FILE", help="append the rows here (JSON lines)")
    add_help_all(ev)
    add_arguments(ev, show=(lambda spec: True) if "--help-all" in argv else everyday)


def sft(args: argparse.Namespace) -> int:
    from asyncrl.buffer.sources import DataError
    from asyncrl.config import ConfigError, load_config, overrides_from_namespace
    from asyncrl.trainers.sft import job_model

    overrides = overrides_from_namespace(args)
    if args.model:
        overrides.setdefault("--hf-checkpoint", args.model)
    try:
        cfg = load_config(args.config, overrides, model=job_model())
    except ConfigError as exc:
        print(f"asyncrl sft: config error:\n{exc}", file=sys.stderr)
        return 2
    try:
        return _run_sft(cfg)
    except DataError as exc:
        print(f"asyncrl sft: data error: {exc}", file=sys.stderr)
        return 2


def evaluate(args: argparse.Namespace) -> int:
    """Exit 2 when refused before anything starts (a missing or model-less ``--model``, no
    sets, a set file that cannot be read); 1, after every set has run, when a set's samples
    all failed (with the most common reason)."""
    from rich.console import Console

    from asyncrl.config import ConfigError, load_config, overrides_from_namespace
    from asyncrl.errors import InputError
    from asyncrl.offline_eval import EvalFailed, evaluate_model, resolve_model, table
    from asyncrl.preflight import preflight_eval

    try:
        model = resolve_model(args.model)
        cfg = load_config(args.config, overrides_from_namespace(args), preset=args.preset)
        preflight_eval(cfg, str(model))
        rows = asyncio.run(evaluate_model(cfg, model, args.out))
    except (ConfigError, InputError) as exc:  # PreflightError is an InputError
        print(f"asyncrl eval: config error:\n{exc}", file=sys.stderr)
        return 2
    except EvalFailed as exc:
        print(f"asyncrl eval: {exc}", file=sys.stderr)
        return 1
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(f"{model}:", table(rows))
    for r in rows:  # a set's group_by breakdown
        groups = {k: v for k, v in r.items() if k.startswith("pass@1/")}
        if groups:
            console.print(f"{r['set']}: " + ", ".join(f"{k} {v:.4f}" for k, v in groups.items()))
    return 0


def _run_sft(cfg: Any) -> int:
    from rich.console import Console
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from asyncrl.config import dump_resolved
    from asyncrl.observe.logs import configure_logging
    from asyncrl.policies.config import PolicyConfig
    from asyncrl.trainers.backends import create_trainer
    from asyncrl.trainers.sft import load_examples, run_sft

    hf_logging.disable_progress_bar()
    out = Path(cfg.output_dir)
    configure_logging(actor="sft", file=out / "logs" / "sft.jsonl")
    dump_resolved(cfg, out / "config.json")
    tokenizer = AutoTokenizer.from_pretrained(cfg.trainer.model_path)
    examples = load_examples(cfg, tokenizer)
    trainer = create_trainer(cfg.trainer, PolicyConfig())
    console = Console(width=None if sys.stdout.isatty() else 120)
    try:
        with console.status(f"sft: {len(examples)} examples x {cfg.epochs} epochs"):
            results = run_sft(cfg, trainer, examples)
    finally:
        close = getattr(trainer, "close", None)  # a multi-process trainer's other ranks
        if close is not None:
            close()
    first, last = results[0].metrics["loss"], results[-1].metrics["loss"]
    console.print(
        f"sft: {len(results)} steps, loss {first:.4f} -> {last:.4f}; "
        f"model in {out / 'model'}, metrics in {out / 'metrics.jsonl'}"
    )
    return 0
