"""The ``asyncrl`` command.

    asyncrl train CONFIG.yaml [--preset NAME] [--dry-run] [--<config flag> VALUE ...]
    asyncrl chaos CONFIG.yaml --kill TARGET@WHEN ... [--every S] [--<config flag> VALUE ...]
    asyncrl sft [CONFIG.yaml] --model DIR --data FILE.jsonl [--<config flag> VALUE ...]
    asyncrl eval [CONFIG.yaml] --model DIR [--eval-sets JSON] [--out FILE.jsonl] [...]
    asyncrl serve --model DIR [--host 127.0.0.1] [--port 30000] [--device cpu] ...
    asyncrl plot RUN_DIR [--out DIR]           (or a benchmark's JSON: its figure)
    asyncrl bench NAME [--<script flag> VALUE ...]   (bench/NAME.py: vs-trl, overlap, ...)
    asyncrl keys DIR
    asyncrl version

Thin on purpose: nothing heavy is imported before the arguments are parsed, so
``asyncrl --help`` answers at once. A bad config is refused before any process starts
(exit code 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.cli import jobs, offline, serve, tools
from asyncrl.cli.args import KEYS_HELP, add_help_all, add_job_source

_TRAIN_OPTIONS = (
    "--help",
    "--help-all",
    "--preset",
    "--dry-run",
    "--resume",
    "--overwrite",
    "--resume-from-step",
)


_EVAL_OPTIONS = ("--help", "--help-all", "--preset", "--model", "--out")


_CHAOS_OPTIONS = (
    "--help",
    "--help-all",
    "--preset",
    "--kill",
    "--every",
    "--duration",
    "--stop-when-back",
    "--chaos-seed",
    "--report",
    "--overwrite",
)


def _parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    from asyncrl.config import add_arguments, everyday

    show = None if "--help-all" in argv else everyday
    parser = argparse.ArgumentParser(prog="asyncrl", description="Asynchronous RL post-training.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        allow_abbrev=False,
        help="run a training job",
        description=f"Run a training job. {KEYS_HELP}",
    )
    add_job_source(train)
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="start every actor, prove every channel, stop cleanly",
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in output_dir from its checkpoints (trainer, buffer, data)",
    )
    train.add_argument(
        "--resume-from-step",
        type=int,
        metavar="N",
        help="continue the run in output_dir from step N, an earlier trainer checkpoint, "
        "with the buffer's state at that step; what came after is moved aside, not deleted",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run in output_dir first (its checkpoints, metrics and logs); "
        "without it (or --resume) a directory that holds a run is refused",
    )
    add_help_all(train)
    add_arguments(train, show=show or (lambda spec: True))
    jobs.add_chaos(sub, show)
    offline.add_sft(sub, argv)
    offline.add_eval(sub, argv)
    serve.add_serve(sub)
    tools.add_plot(sub)
    tools.add_export(sub)
    keys = sub.add_parser(
        "keys",
        help="make a CurveZMQ job certificate (--wire.curve-keys DIR)",
        description="Write a new CurveZMQ key pair for a job into DIR: job.key (public) "
        "and job.key_secret (mode 0600). With --wire.curve-keys DIR every channel of the "
        "job is encrypted and admits only processes that hold the secret key.",
    )
    keys.add_argument("dir", type=Path, metavar="DIR", help="folder to create (or empty)")
    sub.add_parser("version", help="print the asyncrl version")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return tools.bench(argv[1:])
    argv, unknown = _read_flags(argv)
    if unknown:
        print(f"asyncrl {argv[0]}: config error:\n{unknown}", file=sys.stderr)
        return 2
    args = _parser(argv).parse_args(argv)
    if args.command == "sft":
        return offline.sft(args)
    if args.command == "eval":
        return offline.evaluate(args)
    if args.command == "version":
        from asyncrl import __version__

        print(__version__)
        return 0
    if args.command == "serve":
        return serve.serve(args)
    if args.command == "plot":
        return tools.plot(args)
    if args.command == "export":
        return tools.export(args)
    if args.command == "keys":
        return tools.keys(args)
    if args.command == "chaos":
        return jobs.chaos(args)
    return jobs.train(args)


def train_config(argv: Sequence[str]) -> Any:
    """The ``RunConfig`` that ``asyncrl train *argv`` would run, its flags read as that
    command reads them (normalised, SGLang's names mapped, unknown options refused), not
    preflighted; ``ConfigError`` says why there is none (argparse's errors and a help
    flag included, which the command would answer by exiting)."""
    import contextlib
    import io

    from asyncrl.config import ConfigError, load_config, overrides_from_namespace

    tokens, unknown = _read_flags(["train", *argv])
    if asked := [t for t in tokens if t in ("-h", "--help", "--help-all")]:
        raise ConfigError(f"{asked[0]} asks for help, not a run")
    if unknown:
        raise ConfigError(unknown)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = _parser(tokens).parse_args(tokens)
    except SystemExit:  # argparse's usage line, then its error: the error alone
        lines = said.getvalue().strip().splitlines() or ["the command line does not parse"]
        raise ConfigError(lines[-1]) from None
    return load_config(args.config, overrides_from_namespace(args), preset=args.preset)


def _read_flags(argv: list[str]) -> tuple[list[str], str]:
    """``argv`` as the parser takes it (``--a.b_c`` is ``--a.b-c``; for ``train``,
    ``chaos`` and ``eval`` SGLang's names mapped), and its unknown options ("" if none)."""
    from asyncrl.config import normal_flag

    argv = [normal_flag(token) for token in argv]
    command = argv[0] if argv[:1] in (["train"], ["chaos"], ["eval"]) else None
    if command is None:
        return argv, ""
    argv = _sglang_flags(argv)
    options = {"chaos": _CHAOS_OPTIONS, "eval": _EVAL_OPTIONS}.get(command, _TRAIN_OPTIONS)
    return argv, _unknown_options(argv[1:], options)


def _sglang_flags(argv: list[str]) -> list[str]:
    """Turn ``--sglang-X [V]`` (or ``--vllm-X [V]``) into ``--X [V]`` of the launched
    servers' command line (``rollout.engine.server_args``), as slime does; a value is the
    next token unless it is an option or a config file (``--sglang-X=V`` is never
    ambiguous). Given any, they replace the file's ``server_args``."""
    rest, server_args, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        prefix = next((p for p in ("--sglang-", "--vllm-") if token.startswith(p)), None)
        if prefix is None:
            rest.append(token)
            i += 1
            continue
        server_args.append("--" + token.removeprefix(prefix))
        nxt = argv[i + 1] if i + 1 < len(argv) else "--"
        # A switch is followed by an option, or by the config file (asyncrl train CONFIG).
        has_value = "=" not in token and not nxt.startswith("--") and not _is_config(nxt)
        if has_value:
            server_args.append(argv[i + 1])
        i += 2 if has_value else 1
    if server_args:
        rest += ["--rollout.engine.server-args", json.dumps(server_args)]
    return rest


def _is_config(token: str) -> bool:
    return token.endswith((".yaml", ".yml", ".json"))


def _unknown_options(tokens: list[str], options: Sequence[str] = _TRAIN_OPTIONS) -> str:
    """Unknown ``--options``, each with a did-you-mean (argparse would eat their values)."""
    import difflib

    from asyncrl.config import flag_table

    known = [*options, *flag_table()]
    problems = []
    for token in tokens:
        flag = token.partition("=")[0]
        if flag.startswith("--") and flag not in known:
            match = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            problems.append(
                f"unknown option {flag}" + (f" (did you mean {match[0]}?)" if match else "")
            )
    return "\n".join(problems)
