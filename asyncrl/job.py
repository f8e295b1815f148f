"""The controller: one training job (``asyncrl train``) on the local or Ray runtime.

    controller --launch--> buffer, rollout-0..n-1, trainer   (processes or Ray actors)
               <--Hello/Heartbeat/Bye-- every actor           (ControlServer)

``run_job`` turns the validated ``RunConfig`` into actor specs (``role_configs.py``),
launches them under a ``Supervisor``, waits for the trainer's last step, then stops
everyone in order. A dead actor is restarted within ``runtime.max_restarts``
(``runtime/recovery.py``); a death past the budget ends the job with the supervisor's
report (exit code, reason, last log lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl import hardware
from asyncrl.actors.base import ActorSpec
from asyncrl.config import RunConfig
from asyncrl.errors import InputError
from asyncrl.observe.logs import get_logger
from asyncrl.observe.progress import JobProgress
from asyncrl.observe.trackers import TensorBoardTracker, Tracker, WandbTracker, following
from asyncrl.preflight import PreflightError, preflight
from asyncrl.role_configs import (
    FINAL_LINGER_S,
    engine_actor_count,
    extra_roles,
    final_policy_dir,
    job_reward_model,
    last_step,
    role_params,
)
from asyncrl.runtime import machine
from asyncrl.runtime.base import PlacementFailed, open_runtime, place_job
from asyncrl.runtime.chaos import Chaos
from asyncrl.runtime.recovery import RestartHooks, restart_budgets
from asyncrl.runtime.run_dir import claim_run_dir
from asyncrl.runtime.supervisor import ActorDied, Supervisor, signal_reason
from asyncrl.runtime.topology import job_specs
from asyncrl.wire import security
from asyncrl.wire.control import ControlServer

log = get_logger("asyncrl.controller")

ROLE_CLASSES = {
    "buffer": "asyncrl.actors.buffer:BufferActor",
    "rollout": "asyncrl.actors.rollout:RolloutActor",
    "trainer": "asyncrl.actors.trainer:TrainerActor",
    "eval": "asyncrl.actors.eval:EvalActor",
    "engine": "asyncrl.actors.engine:EngineActor",
    "reward": "asyncrl.actors.reward_model:RewardModelActor",
}
#: The trainer's seat in rollout-only mode (``--debug-rollout-only``).
DUMPER_CLASS = "asyncrl.actors.dumper:BatchDumper"
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class JobResult:
    """How a job ended: ``ok``, or the first failure; exit codes; wall seconds; steps."""

    ok: bool
    seconds: float
    steps: int = 0
    error: str = ""
    codes: dict[str, int | None] = field(default_factory=dict)
    restarts: list[str] = field(default_factory=list)  # "actor: cause" per restart survived
    warnings: list[str] = field(default_factory=list)  # what a finished job did not do
    interrupted: str = ""  # the signal (SIGINT: Ctrl-C) that stopped the job early


async def run_job(
    cfg: RunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    chaos: Chaos | None = None,
    checked: bool = False,
) -> JobResult:
    """Run ``cfg`` to its end; never raises for actor failures (see ``JobResult.error``).

    ``preflight`` checks the job first (unless the caller did: ``checked``); a job that
    fails it starts no actor. The run directory is claimed for the job's life
    (``runtime/run_dir.py``: one job at a time; a run in it is continued with ``resume``
    or deleted first with ``overwrite``). ``chaos`` kills actors on its schedule while
    the job runs (``asyncrl chaos``).
    """
    start = time.monotonic()
    if not checked:
        try:
            await asyncio.to_thread(preflight, cfg)
        except PreflightError as exc:
            return JobResult(ok=False, seconds=time.monotonic() - start, error=str(exc))
    with contextlib.ExitStack() as claim:
        try:
            run_dir, buffered = cfg.resolved_output_dir(), not cfg.train.load_rollout_data
            claim.enter_context(
                claim_run_dir(run_dir, resume=resume, overwrite=overwrite, buffered=buffered)
            )
        except InputError as exc:
            return JobResult(ok=False, seconds=time.monotonic() - start, error=str(exc))
        claim.enter_context(_sigterm_interrupts())
        return await _run_claimed(cfg, resume=resume, chaos=chaos, start=start)


async def _run_claimed(
    cfg: RunConfig, *, resume: bool, chaos: Chaos | None, start: float
) -> JobResult:
    run_dir = cfg.resolved_output_dir()
    specs = job_actor_specs(cfg, {}, run_dir, resume=resume)
    log.info("machine", plan=machine.describe(cfg, specs))
    result = JobResult(ok=False, seconds=0.0)
    trackers = await asyncio.to_thread(open_trackers, cfg, run_dir)
    async with (
        following(run_dir, trackers, cfg.train.metrics_interval),
        _curve(cfg),  # the control server is a channel too
        open_runtime(cfg.runtime, run_dir) as runtime,
    ):
        try:
            endpoints = await place_job(runtime, specs)
        except PlacementFailed as exc:
            result.error, result.seconds = str(exc), time.monotonic() - start
            return result
        async with ControlServer(endpoints["control"]) as control:
            engine = cfg.rollout.engine
            hooks = RestartHooks(
                control,
                engine_wait_s=engine.startup_timeout + 60 if engine else 900,
                checkpoint_interval=cfg.train.checkpoint_interval,
            )
            sup = Supervisor(
                runtime,
                control,
                heartbeat_timeout=cfg.runtime.heartbeat_timeout,
                startup_timeout=cfg.runtime.startup_timeout,
                restarts=restart_budgets(cfg),
                before_restart=hooks.before_restart,
                after_restart=hooks.after_restart,
            )
            async with sup:
                async with _chaos_running(chaos, sup):
                    with _interruptible() as interrupt:
                        result.error = await _train(sup, specs, cfg, interrupt)
                    if interrupt.is_set():
                        sup.wind_down()  # its actors may have had the signal too
                        result.interrupted = interrupt.signal
                        result.error = result.error or f"stopped by {interrupt.signal}"
                    # Producers first: what they hold lands in the buffer before it stops.
                    # Then their engines, which serve no one else (and are not restarted
                    # for a rollout actor that is gone).
                    for role in ("rollout", "engine"):
                        names = [s.name for s in specs if s.role == role]
                        await sup.stop(names, cfg.runtime.stop_timeout)
                    if not result.error and cfg.eval.enabled:
                        result.error = await _wait_final_eval(sup, cfg, hooks, result.warnings)
                    # The trainer before the buffer: a failed job's trainer still runs, and
                    # its last acknowledgement would retry a stopped buffer to the timeout.
                    trainers = [s.name for s in specs if s.role == "trainer"]
                    await sup.stop(trainers, cfg.runtime.stop_timeout)
                result.codes = await sup.stop_all(cfg.runtime.stop_timeout)
            result.restarts = [f"{d.name}: {d.reason}" for d in sup.deaths]
    result.steps = last_step(run_dir / "metrics.jsonl")
    trains = cfg.train.num_steps > 0 and not cfg.train.debug_rollout_only
    if trains and 0 < result.steps < cfg.train.num_steps and not result.interrupted:
        result.warnings.append(
            f"trained {result.steps} of the {cfg.train.num_steps} steps asked for: the data "
            "ran out (data.num_epochs), or the trainer was told to stop (its log says which)"
        )
    if not result.error and trains and result.steps == 0:
        result.error = _nothing_trained(run_dir / "metrics" / "buffer.jsonl")
    unclean = {name: code for name, code in result.codes.items() if code != 0}
    if not result.error and unclean:
        result.error = _stopped_uncleanly(unclean)
    result.ok = not result.error
    result.seconds = time.monotonic() - start
    return result


@contextlib.asynccontextmanager
async def _chaos_running(chaos: Chaos | None, sup: Supervisor) -> AsyncIterator[None]:
    """``chaos`` kills actors until the trainer finishes and watches its victims come back
    until the block ends. A plain task, not a TaskGroup, so that the job's own errors
    leave the block unwrapped; it is cancelled and awaited on the way out."""
    if chaos is None:
        yield
        return
    task = asyncio.create_task(chaos.run(sup), name="controller.chaos")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def _curve(cfg: RunConfig) -> AsyncIterator[None]:
    with security.enabled_for(cfg.wire):
        yield


class _Interrupt(asyncio.Event):
    """Set by the first SIGINT or SIGTERM to the controller; ``signal`` names it."""

    signal = ""


@contextlib.contextmanager
def _interruptible() -> Iterator[_Interrupt]:
    """The first Ctrl-C (or SIGTERM) stops the job in order, as its end does: producers,
    engines, then the trainer, which checkpoints, then the buffer; a second one of either
    is a ``KeyboardInterrupt`` at once, and every actor is killed. Main thread only
    (elsewhere signals are not ours)."""
    interrupt = _Interrupt()
    if threading.current_thread() is not threading.main_thread():
        yield interrupt
        return
    loop = asyncio.get_running_loop()

    def first(sig: signal.Signals) -> None:
        interrupt.signal = sig.name
        interrupt.set()
        _stop_handling(loop)  # the next one is a KeyboardInterrupt
        log.warning(
            f"{sig.name}: stopping the job in order; the trainer checkpoints "
            "(press Ctrl-C again to abort at once)"
        )

    for s in _STOP_SIGNALS:
        loop.add_signal_handler(s, first, s)
    try:
        yield interrupt
    finally:
        _stop_handling(loop)


def _stop_handling(loop: asyncio.AbstractEventLoop) -> None:
    """Remove the loop's handlers: SIGINT is Python's ``KeyboardInterrupt`` again, and so is
    SIGTERM (asyncio would restore its default, which orphans the actors)."""
    for s in _STOP_SIGNALS:
        loop.remove_signal_handler(s)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """For the job's life, SIGTERM is a ``KeyboardInterrupt`` as SIGINT is: whatever the
    job is doing, its context managers unwind and the runtime kills the actors, instead
    of the process ending at once and leaving them orphaned. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


async def _unless(interrupt: asyncio.Event, work: Coroutine[Any, Any, None]) -> None:
    """Await ``work``, or cancel it once ``interrupt`` is set; its error is raised here."""
    task = asyncio.create_task(work, name="controller.work")
    stop = asyncio.create_task(interrupt.wait(), name="controller.interrupt")
    try:
        await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, stop):
            t.cancel()
        await asyncio.gather(task, stop, return_exceptions=True)
    error = None if task.cancelled() else task.exception()
    if error is not None:
        raise error


async def _train(
    sup: Supervisor, specs: list[ActorSpec], cfg: RunConfig, interrupt: asyncio.Event
) -> str:
    """Launch ``specs`` and wait for the trainer's last step (or ``interrupt``), with a
    progress bar; the failure that ended it early, or ''."""
    samples_per_step = cfg.buffer.groups_per_step * cfg.buffer.num_samples_per_prompt
    progress = JobProgress(cfg.train.num_steps, samples_per_step)
    async with asyncio.TaskGroup() as tg:
        bar = tg.create_task(progress.run(sup.status), name="controller.progress")
        try:
            await _unless(interrupt, sup.launch(specs))  # a start-up may take minutes
            await _unless(interrupt, sup.wait_until(lambda st: st["trainer"].state == "finished"))
        except ActorDied as exc:
            return str(exc)
        except Exception as exc:  # an actor that could not be started (placement, Ray)
            return f"{type(exc).__name__}: {exc}"
        finally:
            bar.cancel()
    return ""


async def _wait_final_eval(
    sup: Supervisor, cfg: RunConfig, hooks: RestartHooks, warnings: list[str]
) -> str:
    """Let the eval actor finish the final version (bounded by ``eval.final_timeout``: past
    it, a warning); a restarted eval actor, which may have missed its announcement, is
    pointed at the trainer's final checkpoint."""
    steps, run_dir = cfg.train.num_steps, cfg.resolved_output_dir()
    reached = await asyncio.to_thread(last_step, run_dir / "metrics.jsonl")
    if steps <= 0 or reached < steps:
        return ""  # no known final version (or stopped before it): what it evaluated stands
    final = final_policy_dir(run_dir, steps)
    # A plain task, not a TaskGroup: an ActorDied from the wait must reach the except
    # below as itself, not wrapped in an ExceptionGroup.
    feed = asyncio.create_task(hooks.feed_final(sup, steps, final), name="controller.final")
    try:
        async with asyncio.timeout(cfg.eval.final_timeout):
            await sup.wait_until(lambda st: st["eval"].state == "finished")
    except TimeoutError:
        log.warning("the final evaluation did not finish", timeout=cfg.eval.final_timeout)
        warnings.append(
            f"the final version's evaluation did not finish within "
            f"eval.final_timeout ({cfg.eval.final_timeout:.0f} s): "
            "metrics/eval.jsonl has no row for it"
        )
    except ActorDied as exc:
        return str(exc)
    finally:
        feed.cancel()
        await asyncio.gather(feed, return_exceptions=True)
    return ""


def open_trackers(cfg: RunConfig, run_dir: Path) -> list[Tracker]:
    """TensorBoard and W&B, as ``cfg.log`` asks; the controller forwards metrics to them."""
    trackers: list[Tracker] = []
    if cfg.log.use_tensorboard:
        trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
    if cfg.log.use_wandb:
        wandb = WandbTracker(
            project=cfg.log.wandb_project,
            name=cfg.name,
            directory=run_dir,
            config=cfg.model_dump(mode="json"),
            mode=cfg.log.wandb_mode,
            group=cfg.log.wandb_group,
        )
        trackers.append(wandb)
    return trackers


def _stopped_uncleanly(codes: dict[str, int | None]) -> str:
    """The job ran to its end, but these actors had to be killed at the stop (hung, or
    stopped by SIGSTOP): what they would have written last (a final checkpoint, metrics)
    may be missing, though --resume recovers from the journal and earlier checkpoints."""

    def how(code: int | None) -> str:
        if code is None:
            return "never exited"
        if code < 0:  # the supervisor's last resort: it ignored the stop and SIGTERM
            return f"{signal_reason(code)} (hung, or paused by SIGSTOP)"
        return f"exited with code {code} while stopping"

    said = ", ".join(f"{name} {how(code)}" for name, code in codes.items())
    return f"the job ran to its end but did not stop cleanly: {said}; see RUN_DIR/logs"


def _nothing_trained(buffer_metrics: Path) -> str:
    """Why a job that ran to its end trained no step, from the buffer's last counts."""
    rows = buffer_metrics.read_text().splitlines() if buffer_metrics.exists() else []
    row: dict[str, Any] = {}
    for line in reversed(rows):  # the last complete row (a kill may cut the last one)
        try:
            row = json.loads(line)
            break
        except ValueError:
            continue

    def ended(kind: str) -> str:
        counts = {
            k.removeprefix(f"buffer.{kind}."): v
            for k, v in row.items()
            if k.startswith(f"buffer.{kind}.")
        }
        top = sorted(counts.items(), key=lambda kv: -kv[1])[:3]
        return f"{int(sum(counts.values()))} {kind}" + (f" ({top})" if top else "")

    return (
        "the job trained nothing: the data ran out before one batch was ready; of "
        f"{int(row.get('buffer.admitted', 0))} groups admitted, {ended('failed')}, "
        f"{ended('filtered')} (see {buffer_metrics})"
    )


def job_actor_specs(
    cfg: RunConfig, endpoints: dict[str, str], run_dir: Path, *, resume: bool
) -> list[ActorSpec]:
    """The actor specs of ``cfg``: buffer, rollout actors and trainer (``BatchDumper`` in its
    seat with ``--debug-rollout-only``; no buffer, rollout or engine actors with
    ``--load-debug-rollout-data``), and the eval, engine and reward actors it has."""
    common = {
        "heartbeat_interval": cfg.runtime.heartbeat_interval,
        "drain_timeout": cfg.runtime.stop_timeout,
        "log_level": cfg.log.level,
        "log_format": cfg.log.format,
    }
    train_only = cfg.train.load_rollout_data is not None
    classes = dict(ROLE_CLASSES)
    if cfg.train.debug_rollout_only:
        classes["trainer"] = DUMPER_CLASS
    specs = job_specs(
        classes=classes,
        num_rollout_actors=0 if train_only else cfg.rollout.num_actors,
        endpoints=endpoints,
        run_dir=run_dir,
        wire=cfg.wire.model_dump(mode="json"),
        common=common,
        params=role_params(cfg, run_dir, resume=resume),
        extra_roles=extra_roles(cfg),
        num_engine_actors=0 if train_only else engine_actor_count(cfg),
    )
    if train_only:  # the batches come from files: no buffer, no engines
        specs = [s for s in specs if s.role != "buffer"]
    threads = cfg.runtime.threads or _threads_per_torch_process(cfg)
    for spec in specs:
        spec.threads = _trainer_threads(cfg, threads) if spec.role == "trainer" else threads
        if spec.role == "trainer" and cfg.eval.enabled:
            spec.drain_timeout += FINAL_LINGER_S  # its drain waits for the final pull
        if spec.role == "reward" and (model := job_reward_model(cfg)) and model.threads:
            spec.threads = model.threads
    _lend_trainer_cores(cfg, specs, run_dir)
    return specs


def _lend_trainer_cores(cfg: RunConfig, specs: list[ActorSpec], run_dir: Path) -> None:
    """``runtime.lend_trainer_cores``: the trainer marks its steps in ``run_dir`` and each
    process hosting an embedded CPU engine runs on ``(cores - reward model's) // hosts``
    threads while the mark is clear (``cores.py``), where ``cfg.lends_trainer_cores()``."""
    if not cfg.lends_trainer_cores():
        return
    host_role = "engine" if engine_actor_count(cfg) else "rollout"
    trainer = next((s for s in specs if s.role == "trainer"), None)
    hosts = [s for s in specs if s.role == host_role]
    if trainer is None or not hosts:
        return
    # A reward model scores while the trainer waits: its cores are not lent. The eval
    # actor's are, as it runs now and then.
    scoring = sum(s.threads or 0 for s in specs if s.role == "reward")
    idle = (hardware.usable_cores() - scoring) // len(hosts)
    lent = [s for s in hosts if s.threads is not None and idle > s.threads]
    mark = str(run_dir / "trainer.busy")
    for spec in lent:
        spec.busy_mark, spec.idle_trainer_threads = mark, idle
    trainer.busy_mark = mark if lent else None


def _trainer_threads(cfg: RunConfig, shared: int) -> int:
    """``runtime.trainer_threads``; unset, a local job's cores shared by its trainer
    ranks (each rank takes this), unless ``runtime.threads`` is set (then that). Idle
    OpenMP threads sleep, so the trainer takes the cores the engines leave idle."""
    if cfg.runtime.trainer_threads is not None:
        return cfg.runtime.trainer_threads
    if cfg.runtime.threads is not None or cfg.runtime.type != "local":
        return shared
    ranks = cfg.trainer.num_ranks if cfg.trainer else 1
    return max(1, hardware.usable_cores() // ranks)


def _threads_per_torch_process(cfg: RunConfig) -> int:
    """The cores shared among the processes that run torch (trainer, embedded engines,
    eval), at least one each."""
    embedded = cfg.rollout.engine is None or cfg.rollout.engine.type == "torch"
    engines = 0 if cfg.train.load_rollout_data or not embedded else cfg.rollout.num_actors
    trainer = 0 if cfg.train.debug_rollout_only else 1
    busy = trainer + engines + int(cfg.eval.enabled) + int(job_reward_model(cfg) is not None)
    return max(1, hardware.usable_cores() // max(busy, 1))
