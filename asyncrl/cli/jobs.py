"""``asyncrl train`` and ``asyncrl chaos``: a job's config checked before launch, the job
run over ``api.run_training``, and what happened said in one line (or a chaos report)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from asyncrl.cli.args import KEYS_HELP, add_help_all, add_job_source


def add_chaos(sub: argparse._SubParsersAction, show: Any) -> None:
    from asyncrl.config import add_arguments

    chaos = sub.add_parser(
        "chaos",
        allow_abbrev=False,
        help="run a training job while killing its actors, then audit it",
        description="Run a training job (the same config and flags as train) while "
        "SIGKILLing its actors on a schedule; the supervisor restarts them. Afterwards the "
        "run is audited: no prompt lost, no group trained twice, the step count right. "
        f"Exit code 0 only when the job and the audit pass. {KEYS_HELP}",
    )
    add_job_source(chaos)
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
    add_help_all(chaos)
    add_arguments(chaos, show=show or (lambda spec: True))


def _positive_seconds(raw: str) -> float:
    value = float(raw)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {raw}")
    return value


def train(args: argparse.Namespace) -> int:
    cfg = _training_config(args, "train")
    if cfg is None:
        return 2
    if args.dry_run:
        return _dry_run(cfg)
    return _run_training(
        cfg, resume=args.resume, overwrite=args.overwrite, from_step=args.resume_from_step
    )


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
    from asyncrl.api import prestart
    from asyncrl.preflight import PreflightError, preflight

    prestart(cfg)  # the zygote imports while the checks run
    try:
        preflight(cfg)  # data, models, chat templates, lengths, user code: before launch
    except PreflightError as exc:
        print(f"asyncrl {command}: config error:\n{exc}", file=sys.stderr)
        return None
    return cfg


def chaos(args: argparse.Namespace) -> int:
    from asyncrl.runtime.chaos import KillAt

    try:
        kills = [KillAt.parse(k) for k in args.kill]
    except ValueError as exc:
        print(f"asyncrl chaos: config error:\n{exc}", file=sys.stderr)
        return 2
    if not kills and not args.every:
        print(
            "asyncrl chaos: config error:\nnothing to kill: give --kill or --every", file=sys.stderr
        )
        return 2
    if args.stop_when_back and args.every:
        print(
            "asyncrl chaos: config error:\n--every kills until the job ends; "
            "--stop-when-back ends it after the --kill list: give one",
            file=sys.stderr,
        )
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


def job_result(job: Coroutine[Any, Any, Any]) -> Any:
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
        job = run_training(
            cfg, resume=resume, overwrite=overwrite, checked=True, resume_from_step=from_step
        )
        result = job_result(job)
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
    chaos = Chaos(
        kills,
        every=args.every,
        duration=args.duration,
        seed=args.chaos_seed,
        roles=roles,
        stop_when_back=args.stop_when_back,
    )
    result = job_result(run_training(cfg, overwrite=args.overwrite, checked=True, chaos=chaos))
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
    if not (run_dir / "config.json").exists():  # a run's record of its start stays its own
        dump_resolved(cfg, run_dir / "config.json")  # (--resume compares against it)
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
