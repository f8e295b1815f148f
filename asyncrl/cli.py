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
``asyncrl --help`` answers at once. A bad config is refused here, before any process
starts (exit code 2).

Size: one parser and one short function per subcommand, each found by its name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

_TRAIN_OPTIONS = ("--help", "--help-all", "--preset", "--dry-run", "--resume", "--overwrite",
                  "--resume-from-step")  # fmt: skip
_EVAL_OPTIONS = ("--help", "--help-all", "--preset", "--model", "--out")
_CHAOS_OPTIONS = ("--help", "--help-all", "--preset", "--kill", "--every", "--duration",
                  "--stop-when-back", "--chaos-seed", "--report", "--overwrite")  # fmt: skip
_KEYS_HELP = (
    "Every config key is also a flag: rollout.num_actors is --rollout.num-actors (slime's "
    "names work too, e.g. --rollout-batch-size). Flags win over the YAML file, which wins "
    "over the preset. --help shows the everyday keys; --help-all shows all of them; "
    "docs/config.md lists each with its default."
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
        description=f"Run a training job. {_KEYS_HELP}",
    )
    _add_job_source(train)
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
    _add_help_all(train)
    add_arguments(train, show=show or (lambda spec: True))
    _add_chaos(sub, show)
    _add_sft(sub, argv)
    _add_eval(sub, argv)
    _add_serve(sub)
    _add_plot(sub)
    _add_export(sub)
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


def _add_job_source(parser: argparse.ArgumentParser) -> None:
    """Where a job's config comes from: a YAML file and a preset (flags come on top)."""
    parser.add_argument("config", nargs="?", help="YAML config file")
    parser.add_argument("--preset", help="start from a named preset (e.g. debug_cpu)")


def _add_help_all(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--help-all", action="help", help="show every config key, not only the everyday ones"
    )


def _add_chaos(sub: argparse._SubParsersAction, show: Any) -> None:
    from asyncrl.config import add_arguments

    chaos = sub.add_parser(
        "chaos",
        allow_abbrev=False,
        help="run a training job while killing its actors, then audit it",
        description="Run a training job (the same config and flags as train) while "
        "SIGKILLing its actors on a schedule; the supervisor restarts them. Afterwards the "
        "run is audited: no prompt lost, no group trained twice, the step count right. "
        f"Exit code 0 only when the job and the audit pass. {_KEYS_HELP}",
    )
    _add_job_source(chaos)
    chaos.add_argument(
        "--kill",
        action="append",
        default=[],
        metavar="TARGET@WHEN[:SIGNAL]",
        help="TARGET: an actor (buffer, rollout-1), a role (rollout) or random; WHEN: 30s "
        "after start or step20 (trainer version); SIGNAL: SIGKILL (default), SIGTERM, "
        "SIGINT or SIGSTOP (local runtime); repeat for more kills",
    )
    chaos.add_argument(
        "--every", type=_positive_seconds, help="also kill a random actor every S seconds"
    )
    chaos.add_argument(
        "--duration",
        type=_positive_seconds,
        help="stop the job after S seconds (its audit still runs)",
    )
    chaos.add_argument(
        "--stop-when-back",
        action="store_true",
        help="stop the job once the last --kill's victim is running again (not with --every)",
    )
    chaos.add_argument("--chaos-seed", type=int, default=0, help="seed of the random choices")
    chaos.add_argument(
        "--report", type=Path, help="where to write the JSON report (RUN_DIR/chaos.json)"
    )
    chaos.add_argument(
        "--overwrite", action="store_true", help="delete the run in output_dir first"
    )
    _add_help_all(chaos)
    add_arguments(chaos, show=show or (lambda spec: True))


def _positive_seconds(raw: str) -> float:
    value = float(raw)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {raw}")
    return value


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {raw}")
    return value


def _port(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0 to 65535, got {raw}")
    return value


def _add_sft(sub: argparse._SubParsersAction, argv: Sequence[str]) -> None:
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


def _add_eval(sub: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    from asyncrl.config import add_arguments, everyday

    ev = sub.add_parser(
        "eval",
        allow_abbrev=False,
        help="score a model folder on eval sets (the eval actor's pass@k)",
        description="Score a model folder on held-out sets with the eval actor's code: "
        "the config's rollout sampling, reward and workflow, and its eval.sets (or "
        f"--eval-sets). {_KEYS_HELP}",
    )
    _add_job_source(ev)
    ev.add_argument(
        "--model", required=True, metavar="DIR",
        help="an HF model folder, or a checkpoint folder with one in policy/",
    )  # fmt: skip
    ev.add_argument("--out", type=Path, metavar="FILE", help="append the rows here (JSON lines)")
    _add_help_all(ev)
    add_arguments(ev, show=(lambda spec: True) if "--help-all" in argv else everyday)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve a model over SGLang's HTTP API",
        description="Serve a Hugging Face model directory with the embedded torch engine behind "
        "an SGLang-compatible HTTP API (/generate, weight updates, OpenAI routes).",
    )
    serve.add_argument("--model", required=True, help="Hugging Face model directory")
    serve.add_argument("--host", default="127.0.0.1", help="loopback address to listen on")
    serve.add_argument("--port", type=_port, default=30000, help="port (0: pick a free one)")
    _add_engine_flags(serve)
    serve.add_argument(
        "--weight-version", type=int, default=0, help="initial weight version (optimizer steps)"
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        help="parse /v1/chat/completions replies into tool_calls: hermes or qwen25 (the "
        "<tool_call> JSON format), llama3 (Llama 3.x JSON calls after <|python_tag|>), or "
        "module:Class (as SGLang's --tool-call-parser)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("ASYNCRL_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health (as SGLang's "
        "--api-key; default: $ASYNCRL_API_KEY); needed to listen beyond loopback",
    )
    serve.add_argument(
        "--max-body-mb",
        type=_positive_float,
        default=8.0,
        help="refuse (413) a /generate or /v1 request body over this many MB before reading "
        "it all; a prompt past the model's context is refused before it is tokenized",
    )


#: ``asyncrl serve``'s engine flags: ``EngineConfig`` fields (``rollout.engine``'s keys)
#: under SGLang's ``launch_server`` names first, then their own.
SERVE_ENGINE_FLAGS: dict[str, tuple[str, ...]] = {
    "device": ("--device",),
    "dtype": ("--dtype",),
    "max_running": ("--max-running-requests", "--max-running"),
    "max_total_tokens": ("--max-total-tokens",),
    "mem_fraction": ("--mem-fraction-static", "--mem-fraction"),
    "packed_weights": ("--packed-weights",),
    "lean_forward": ("--lean-forward",),
    "seed": ("--random-seed", "--seed"),
}


def _add_engine_flags(serve: argparse.ArgumentParser) -> None:
    """One flag per ``SERVE_ENGINE_FLAGS`` field, typed, checked and described by it."""
    from asyncrl.config import metavar
    from asyncrl.engines.config import EngineConfig

    for name, flags in SERVE_ENGINE_FLAGS.items():
        field = EngineConfig.model_fields[name]
        note = " (serve: null draws it from the OS)" if name == "seed" else ""
        text = f"{field.description}{note} (default: {field.default})"
        serve.add_argument(*flags, dest=name, type=_field_value(field), default=field.default,
                           help=text, metavar=metavar(field.annotation))  # fmt: skip
    for name in ("packed_weights", "lean_forward"):  # the switches of earlier releases
        flag = "--no-" + name.replace("_", "-")
        serve.add_argument(flag, dest=name, action="store_false", help=argparse.SUPPRESS)


def _field_value(field: Any) -> Callable[[str], Any]:
    """A flag's text as ``field``'s value, or argparse's error with pydantic's reason."""
    import types
    from typing import Annotated, get_args

    from pydantic import TypeAdapter, ValidationError

    adapter = TypeAdapter(Annotated[field.annotation, field])
    nullable = types.NoneType in get_args(field.annotation)

    def parse(raw: str) -> Any:
        if nullable and raw.lower() in ("null", "none"):
            return None
        try:
            return adapter.validate_python(raw)
        except ValidationError as exc:
            reason = exc.errors()[0]["msg"]
            raise argparse.ArgumentTypeError(f"{reason}, got {raw}") from None

    return parse


def _add_plot(sub: argparse._SubParsersAction) -> None:
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


def _add_export(sub: argparse._SubParsersAction) -> None:
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    from asyncrl.config import normal_flag

    argv = [normal_flag(token) for token in argv]  # --a.b_c is --a.b-c
    command = argv[0] if argv[:1] in (["train"], ["chaos"], ["eval"]) else None
    if command:
        argv = _sglang_flags(argv)
    parser = _parser(argv)
    options = {"chaos": _CHAOS_OPTIONS, "eval": _EVAL_OPTIONS}.get(command or "", _TRAIN_OPTIONS)
    if command and (unknown := _unknown_options(argv[1:], options)):
        print(f"asyncrl {command}: config error:\n{unknown}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command == "sft":
        return _sft(args)
    if args.command == "eval":
        return _eval(args)
    if args.command == "version":
        from asyncrl import __version__

        print(__version__)
        return 0
    if args.command == "serve":
        return _serve(args)
    if args.command == "plot":
        return _plot(args)
    if args.command == "export":
        return _export(args)
    if args.command == "keys":
        return _keys(args)
    if args.command == "chaos":
        return _chaos(args)
    return _train(args)


def _export(args: argparse.Namespace) -> int:
    from asyncrl.export import ExportError, export_policy

    try:
        out = export_policy(args.run_dir, args.out, args.step, adapter=args.adapter)
    except ExportError as exc:
        print(f"asyncrl export: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


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


def _train(args: argparse.Namespace) -> int:
    cfg = _training_config(args, "train")
    if cfg is None:
        return 2
    if args.dry_run:
        return _dry_run(cfg)
    return _run_training(cfg, resume=args.resume, overwrite=args.overwrite,
                         from_step=args.resume_from_step)  # fmt: skip


def _training_config(args: argparse.Namespace, command: str) -> Any:
    """The job's config, checked before launch; None (after printing why) when refused."""
    from asyncrl.config import ConfigError, load_config, overrides_from_namespace

    try:
        cfg = load_config(args.config, overrides_from_namespace(args), preset=args.preset)
    except ConfigError as exc:
        print(f"asyncrl {command}: config error:\n{exc}", file=sys.stderr)
        return None
    if not getattr(args, "dry_run", False):
        missing = [
            f
            for f, v in (("--hf-checkpoint", cfg.trainer), ("--prompt-data", cfg.data))
            if v is None
        ]
        if missing:
            print(
                f"asyncrl {command}: config error:\nto train, set {' and '.join(missing)}",
                file=sys.stderr,
            )
            return None
    from asyncrl.preflight import PreflightError, preflight

    try:
        preflight(cfg)  # data, models, chat templates, lengths, user code: before launch
    except PreflightError as exc:
        print(f"asyncrl {command}: config error:\n{exc}", file=sys.stderr)
        return None
    return cfg


def _chaos(args: argparse.Namespace) -> int:
    from asyncrl.runtime.chaos import KillAt

    try:
        kills = [KillAt.parse(k) for k in args.kill]
    except ValueError as exc:
        print(f"asyncrl chaos: config error:\n{exc}", file=sys.stderr)
        return 2
    if not kills and not args.every:
        print("asyncrl chaos: config error:\nnothing to kill: give --kill or --every",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.stop_when_back and args.every:
        print("asyncrl chaos: config error:\n--every kills until the job ends; "
              "--stop-when-back ends it after the --kill list: give one",
              file=sys.stderr)  # fmt: skip
        return 2
    cfg = _training_config(args, "chaos")
    if cfg is None:
        return 2
    cfg.train.audit_log = True  # what the audit checks exactly-once training against
    from asyncrl.job import job_actor_specs
    from asyncrl.runtime.chaos import check_targets
    from asyncrl.runtime.recovery import restart_budgets

    specs = job_actor_specs(cfg, {}, cfg.resolved_output_dir(), resume=False)
    try:
        roles = {s.name: s.role for s in specs}
        check_targets(kills, roles, restart_budgets(cfg), cfg.runtime.type)
    except ValueError as exc:
        print(f"asyncrl chaos: config error:\n{exc}", file=sys.stderr)
        return 2
    return _run_chaos(cfg, kills, args)


def _job(job: Coroutine[Any, Any, Any]) -> Any:
    """``job``'s ``JobResult``, or the exit code after saying why there is none: 2 when
    the run folder is another job's or holds a run; 1 when the disk refused the
    controller a write (full, a quota, ``ulimit -f``)."""
    from asyncrl.errors import InputError, disk_refused

    try:
        return asyncio.run(job)
    except InputError as exc:  # the run folder: another job's, or a run without --resume
        print(f"asyncrl: {exc}", file=sys.stderr)
        return 2
    except (OSError, ExceptionGroup) as exc:
        group = isinstance(exc, ExceptionGroup)
        if not (exc.split(disk_refused)[1] is None if group else disk_refused(exc)):
            raise
        first: BaseException = exc
        while isinstance(first, ExceptionGroup):
            first = first.exceptions[0]
        print(f"asyncrl: the disk refused a write: {first}", file=sys.stderr)
        return 1


def _run_training(
    cfg: Any, *, resume: bool, overwrite: bool = False, from_step: int | None = None
) -> int:
    """``asyncrl train``: ``api.run_training`` (checked already), then what happened."""
    from rich.console import Console

    from asyncrl.api import run_training

    run_dir = cfg.resolved_output_dir()
    console = Console(width=None if sys.stdout.isatty() else 140)
    try:
        job = run_training(cfg, resume=resume, overwrite=overwrite, checked=True,
                           resume_from_step=from_step)  # fmt: skip
        result = _job(job)
    except KeyboardInterrupt:  # before the job could stop in order, or a second Ctrl-C
        console.print(
            "[red]train aborted[/red] (Ctrl-C, or a second stop signal): actors were killed "
            "without a final checkpoint; --resume continues from the last one in "
            f"{run_dir / 'checkpoints'}"
        )
        return 130
    if isinstance(result, int):
        return result
    for restart in result.restarts:
        console.print(f"[yellow]restarted after a crash[/yellow]: {restart}")
    for warning in result.warnings if result.ok else []:
        console.print(f"[yellow]warning[/yellow]: {warning}")
    if result.ok:
        console.print(
            f"[green]train ok[/green]: {result.steps} steps in {result.seconds:.0f}s; "
            f"metrics in {run_dir / 'metrics.jsonl'}, checkpoints in {run_dir / 'checkpoints'}"
        )
        return 0
    if result.interrupted and not result.error.removeprefix(f"stopped by {result.interrupted}"):
        console.print(
            f"[yellow]train stopped[/yellow] by {result.interrupted} after {result.steps} "
            f"steps; continue it with --resume (checkpoints in {run_dir / 'checkpoints'})"
        )
        return 130
    console.print(f"[red]train failed[/red]: {result.error or result.codes}")
    return 1


def _run_chaos(cfg: Any, kills: list[Any], args: argparse.Namespace) -> int:
    from rich.console import Console

    from asyncrl.api import run_training
    from asyncrl.runtime.chaos import Chaos, audit_run, chaos_report, print_report
    from asyncrl.runtime.recovery import restart_budgets

    roles = tuple(role for role, n in restart_budgets(cfg).items() if n > 0)
    chaos = Chaos(kills, every=args.every, duration=args.duration, seed=args.chaos_seed,
                  roles=roles, stop_when_back=args.stop_when_back)  # fmt: skip
    result = _job(run_training(cfg, overwrite=args.overwrite, checked=True, chaos=chaos))
    if isinstance(result, int):
        return result
    run_dir = cfg.resolved_output_dir()
    # A job stopped early (--duration, --stop-when-back) ends wherever the trainer was.
    stopped = args.duration or args.stop_when_back
    audit = audit_run(run_dir, 0 if stopped else cfg.train.num_steps)
    report = chaos_report(result, chaos, audit)
    path = args.report or run_dir / "chaos.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    console = Console(width=None if sys.stdout.isatty() else 140)
    print_report(console, report)
    console.print(f"report in {path}")
    return 0 if result.ok and audit.ok else 1


def _sft(args: argparse.Namespace) -> int:
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


def _eval(args: argparse.Namespace) -> int:
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


def _dry_run(cfg: object) -> int:
    from rich.console import Console
    from rich.table import Table

    from asyncrl.config import RunConfig, dump_resolved
    from asyncrl.observe.logs import configure_logging
    from asyncrl.runtime.dryrun import dry_run

    assert isinstance(cfg, RunConfig)
    run_dir = cfg.resolved_output_dir()
    configure_logging(
        level=cfg.log.level,
        fmt=cfg.log.format,
        file=run_dir / "logs" / "controller.jsonl",
        actor="controller",
    )
    dump_resolved(cfg, run_dir / "config.json")
    result = asyncio.run(dry_run(cfg))
    table = Table(title=f"dry run: {len(result.rows)} actors in {result.seconds:.1f}s")
    for col in result.rows[0] if result.rows else []:
        left = col in ("actor", "role", "bye")
        table.add_column(col, justify="left" if left else "right", no_wrap=not left)
    for row in result.rows:
        table.add_row(*(str(v) for v in row.values()))
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(table)
    if result.ok:
        console.print(
            f"[green]dry run ok[/green]: every channel carried its traffic; "
            f"logs in {run_dir / 'logs'}"
        )
        return 0
    console.print(f"[red]dry run failed[/red]: {result.error or 'an actor exited uncleanly'}")
    return 1


def _serve(args: argparse.Namespace) -> int:
    import ipaddress

    host = "127.0.0.1" if args.host == "localhost" else args.host
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not args.api_key:
        # The API can load weights from any path and abort anyone's work: no open access.
        print(
            f"asyncrl serve: refusing to listen on {args.host} without --api-key: the API "
            "can load weights from any path and abort any work",
            file=sys.stderr,
        )
        return 2
    if not Path(args.model).is_dir():
        print(f"asyncrl serve: --model {args.model} is not a model directory", file=sys.stderr)
        return 2
    import uvloop

    from asyncrl.engines.config import EngineConfig
    from asyncrl.engines.server.app import EngineServer, serve_until_signalled
    from asyncrl.engines.torch.engine import TorchEngine
    from asyncrl.observe.logs import configure_logging

    configure_logging(actor="serve")
    fields = {name: getattr(args, name) for name in SERVE_ENGINE_FLAGS}
    cfg = EngineConfig(type="torch", model_path=args.model, **fields)
    engine = TorchEngine.from_config(cfg, seed=cfg.seed, version=args.weight_version)
    server_args = {"host": host, "port": args.port, "dtype": args.dtype,
                   "tool_call_parser": args.tool_call_parser}  # fmt: skip
    parser = None
    if args.tool_call_parser:
        from asyncrl.rollout.workflows import tool_call_parser

        parser = tool_call_parser(args.tool_call_parser)
    limit = int(args.max_body_mb * 2**20)
    server = EngineServer(engine, server_args=server_args, api_key=args.api_key,
                          tool_call_parser=parser, max_body_bytes=limit)  # fmt: skip
    uvloop.run(serve_until_signalled(server, host, args.port))
    return 0


def _keys(args: argparse.Namespace) -> int:
    from asyncrl.wire import security

    try:
        public, secret = security.generate(args.dir)
    except (FileExistsError, OSError) as exc:
        print(f"asyncrl keys: {exc}", file=sys.stderr)
        return 2
    print(f"{public}\n{secret}  (secret: keep it 0600, on the job's nodes only)")
    return 0


#: The repository's benchmark scripts (an editable install: the package sits beside them).
_BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def _bench_names() -> list[str]:
    """``NAME`` for every ``bench/NAME.py`` with a ``main`` (``_`` written ``-``)."""
    if not _BENCH_DIR.is_dir():
        return []
    scripts = (p for p in sorted(_BENCH_DIR.glob("*.py")) if "def main(" in p.read_text())
    return [p.stem.replace("_", "-") for p in scripts]


def _bench(argv: list[str]) -> int:
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


def _plot(args: argparse.Namespace) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
