"""EvalActor: evaluates the trainer's weight versions on held-out sets, beside training.

Each due version (every ``eval.interval`` steps, and the final one) is pulled as soon as
it is announced and evaluated on the actor's own engine, a row per set in
``metrics/eval.jsonl``. Being off the training's critical path, it gives up CPU priority
(``eval.nice``), except for the final eval, which runs after training on every core.
A restarted or resumed incarnation goes on from the rows already written: no version's
set is scored twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.actors.base import Actor, ActorSpec
from asyncrl.actors.config import EvalActorConfig, WorkflowConfig
from asyncrl.actors.rollout import (
    build_reward,
    build_tools,
    load_workflow,
    policy_tokenizer,
    reward_model_client,
)
from asyncrl.buffer.sources import PromptSource
from asyncrl.observe.logs import get_logger
from asyncrl.observe.metrics import JsonlMetricsSink
from asyncrl.rollout.base import RolloutContext, Workflow
from asyncrl.rollout.config import EvalSetConfig
from asyncrl.rollout.engines import EngineHost, engine_seed
from asyncrl.rollout.evaluation import evaluate_set
from asyncrl.weights.sync import WeightReceiver
from asyncrl.wire.errors import PeerLost, RemoteError
from asyncrl.wire.messages import Command, Scalar, WeightVersion

if TYPE_CHECKING:
    import torch

    from asyncrl.rollout.rewards import ScoresPairs
    from asyncrl.types import Prompt

log = get_logger("asyncrl.eval")
#: A pull that takes longer lost its trainer (a ROUTER drops replies to no one).
_PULL_TIMEOUT_S = 300.0


def lower_priority(increment: int) -> None:
    """Raise every thread of this process's nice value by ``increment``.

    Linux keeps a nice value per thread and a new thread inherits its creator's, so each
    existing thread is reniced; later ones start at the lower priority.
    """
    if increment <= 0:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process's value
        tids = [0]
    for tid in tids:
        with contextlib.suppress(OSError):  # a thread that just exited
            current = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, current + increment))


def scored_versions(path: Path) -> dict[int, set[str]]:
    """The sets each version has rows for in an ``eval.jsonl``. Lines that do not parse,
    or lack an int ``version`` and a str ``set``, are skipped with a warning: a damaged
    file costs a rescore, never the actor's setup."""
    scored: dict[int, set[str]] = {}
    if not path.is_file():
        return scored
    skipped = 0
    for line in filter(str.strip, path.read_text(encoding="utf-8", errors="replace").splitlines()):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or type(row.get("version")) is not int:
            skipped += 1
        elif isinstance(row.get("set"), str):
            scored.setdefault(row["version"], set()).add(row["set"])
        else:
            skipped += 1
    if skipped:
        log.warning("eval rows skipped: damaged", path=str(path), lines=skipped)
    return scored


class EvalActor(Actor):
    """Evaluates due weight versions; see the module docstring."""

    Config = EvalActorConfig
    config: EvalActorConfig

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        self.evaluated = 0
        self.preempted = 0
        self.baseline: list[EvalSet] = []  # the sets whose version 0 setup left to score
        self.final_sets: list[EvalSet] | None = None  # the final version's unscored (all)
        self._last: dict[str, float] = {}
        self.metrics: JsonlMetricsSink | None = None

    async def setup(self) -> None:
        config = self.config
        self.cfg = config.eval
        lower_priority(self.cfg.nice)  # before the engine's threads start: they inherit it
        self.num_steps = config.num_steps
        self.next_due = 0 if self.cfg.at_start else self.cfg.interval
        self._pending: tuple[WeightVersion, dict[str, torch.Tensor] | None] | None = None
        self._ready = asyncio.Event()
        self._final_due = asyncio.Event()  # the final version is pending
        self._final_lost = False
        seed = engine_seed(config.engine.seed, self.name, self.spec.incarnation.restarted)
        self.host = await self.hold(EngineHost(config.engine, seed=seed))
        # The engine's, or the policy's from disk for remote engines (as rollout actors do).
        tokenizer = await asyncio.to_thread(policy_tokenizer, config.tokenizer, self.host)
        rm = await reward_model_client(self.spec.endpoints, self.hold, self.name)
        self.sets = [
            await open_eval_set(s, config, self.host, tokenizer, self.hold, rm)
            for s in self.cfg.sets
        ]
        ep = self.spec.endpoints
        frame = self.max_frame_bytes
        # shared=False: it pulls ipc versions too, so the trainer's drain sees it done.
        rx = WeightReceiver(
            ep["trainer.weights"],
            ep["trainer.weights_snapshot"],
            max_frame_bytes=frame,
            puller=self.name,
            shared=False,
        )
        self.receiver = await self.hold(rx)
        self.metrics = self.open_metrics(config.metrics_path, flush_every=0)
        self._schedule_from(scored_versions(Path(config.metrics_path)))

    def _schedule_from(self, scored: dict[int, set[str]]) -> None:
        """Start past the versions the job's rows have (a resumed job, a restarted actor),
        and with the baseline's sets still missing. Version 0 is scored from the embedded
        engine's own initial weights where they are the trainer's version 0
        (``baseline_from_engine``), not from its announcement: a trainer that publishes
        version 1 before this actor subscribes would replace it."""
        interval = self.cfg.interval
        if scored:
            self.next_due = max(self.next_due, (max(scored) // interval + 1) * interval)
        if self.config.num_steps > 0:  # an incarnation that died after its final rows
            final = {n for v, names in scored.items() if v >= self.config.num_steps for n in names}
            self.final_sets = [s for s in self.sets if s.cfg.name not in final]
        missing = {s.cfg.name for s in self.sets} - scored.get(0, set())
        engine = self.host.engine is not None and self.host.version == 0
        if self.cfg.at_start and self.config.baseline_from_engine and engine and missing:
            self.baseline = [s for s in self.sets if s.cfg.name in missing]
            self.next_due = max(self.next_due, interval)  # before _follow starts

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            follow = tg.create_task(self._follow(), name=f"{self.name}.follow")
            if self.baseline:
                await self._evaluate(0, self.baseline)
            await self._evaluate_loop()
            follow.cancel()

    # -- weights ---------------------------------------------------------------------------
    def _is_final(self, version: int) -> bool:
        return self.num_steps > 0 and version >= self.num_steps

    def _due(self, version: int) -> bool:
        """``version >= next_due`` (the next multiple of ``eval.interval`` after the version
        last evaluated), or it is the final version."""
        return version >= self.next_due or self._is_final(version)

    async def _follow(self) -> None:
        """Pull each due version as soon as it is announced, into memory (the trainer keeps
        only its newest few, and exits after the last). A newer one replaces a pulled one
        not yet started, so a slow eval falls back to the newest due version, not a queue."""
        seen = -1
        while True:
            msg = await self.receiver.next_version(after=seen)
            seen = msg.version
            if not self._due(msg.version):
                continue
            try:  # pull now: the trainer may drop it (or exit) before we get to it
                async with asyncio.timeout(_PULL_TIMEOUT_S):
                    tensors = await self.receiver.fetch(msg) if self.host.engine else None
            except (PeerLost, RemoteError, TimeoutError) as exc:
                log.warning("weights not pulled", version=msg.version, error=str(exc))
                if self._is_final(msg.version):  # the trainer is gone: nothing more comes
                    self._final_from_disk(msg.version)
                continue
            if not self._due(msg.version):  # an evaluation started meanwhile moved next_due
                continue
            self._offer(msg, tensors)

    def _offer(self, msg: WeightVersion, tensors: dict[str, torch.Tensor] | None) -> None:
        self._pending = (msg, tensors)
        self._ready.set()
        if self._is_final(msg.version):
            self._final_due.set()

    async def _load(self, msg: WeightVersion, tensors: dict[str, torch.Tensor] | None) -> None:
        if tensors is not None:
            await self.host.load_tensors(tensors, msg.version)
        elif not await self.host.load(msg, self.receiver):
            raise RuntimeError(f"weight version {msg.version} is gone before it was evaluated")

    async def on_command(self, cmd: Command) -> dict[str, Scalar]:
        """``evaluate_final``: evaluate the final version from a checkpoint path."""
        if cmd.kind == "evaluate_final":
            return {"queued": self._queue_final(int(cmd.args["version"]), str(cmd.args["path"]))}
        return await super().on_command(cmd)

    def _final_from_disk(self, version: int) -> None:
        """The trainer exited before this incarnation pulled the final version (it may
        have been pulled by one that died): evaluate the trainer's final checkpoint, which
        it writes before it exits, or end without it if there is none."""
        path = self.config.final_checkpoint
        if path and Path(path).is_dir() and self._queue_final(version, str(path)):
            log.warning("evaluating the final version from its checkpoint", path=path)
            return
        self._final_lost = True  # an intermediate eval still running may finish
        self._ready.set()

    def _queue_final(self, version: int, path: str) -> bool:
        """Evaluate the final ``version`` from HF weights at ``path`` (a restarted eval
        actor missed its announcement: the trainer has exited)."""
        if not self._is_final(version) or (
            self._pending and self._is_final(self._pending[0].version)
        ):
            return False
        self._offer(WeightVersion(version=version, transport="disk", location=path), None)
        return True

    # -- evaluation ------------------------------------------------------------------------
    async def _evaluate_loop(self) -> None:
        """Load the newest pulled version and run every set (``rollout/evaluation.py``);
        the final version ends the actor."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self._pending is None and self._final_lost:
                log.warning("the final version could not be pulled; eval ends without it")
                return
            assert self._pending is not None
            msg, tensors = self._pending
            self._pending = None
            # At once, so the versions announced while this one is evaluated are not due.
            self.next_due = (msg.version // self.cfg.interval + 1) * self.cfg.interval
            if self._is_final(msg.version) and self.final_sets == []:
                await self._pull_only(msg, tensors)
                return
            await self._load(msg, tensors)
            if self._is_final(msg.version):
                await self._take_the_cores()
                await self._evaluate(msg.version, self.final_sets)
                log.info("evaluated the final version", version=msg.version)
                return
            if msg.version == 0:  # the baseline every gain is read against: the final waits
                await self._evaluate(0)
                continue
            await self._evaluate_unless_final(msg.version)

    async def _pull_only(self, msg: WeightVersion, tensors: dict[str, torch.Tensor] | None) -> None:
        """The final version's rows are written already (an incarnation that died after
        them, a finished job resumed): it is pulled, which the trainer waits for before
        it exits, and not scored again."""
        if tensors is None and msg.transport != "disk":  # a remote engine pulls as it loads
            await self._load(msg, tensors)
        log.info("the final version is scored already", version=msg.version)

    async def _evaluate_unless_final(self, version: int) -> None:
        """Evaluate an intermediate ``version``, cancelled as soon as the final one is due
        (a restarted actor may still be scoring an old version when training ends)."""
        async with asyncio.TaskGroup() as tg:
            evaluation = tg.create_task(self._evaluate(version), name=f"{self.name}.v{version}")
            final = tg.create_task(self._final_due.wait(), name=f"{self.name}.final_due")
            await asyncio.wait((evaluation, final), return_when=asyncio.FIRST_COMPLETED)
            final.cancel()
            if not evaluation.done():
                evaluation.cancel()
                self.preempted += 1
                log.warning("eval cancelled: the final version is due", version=version)

    async def _take_the_cores(self) -> None:
        """The final version comes after the last step: the trainer and the rollouts are
        ending, and the job waits on this eval alone, so it takes every core."""
        threads = self.cfg.final_threads or os.cpu_count() or 1
        set_threads = getattr(self.host.engine, "set_threads", None)
        if set_threads is not None:  # an embedded torch engine (not a remote server)
            await set_threads(threads)
            log.info("final eval threads", threads=threads)

    async def _evaluate(self, version: int, sets: list[EvalSet] | None = None) -> None:
        for s in self.sets if sets is None else sets:
            failures: Counter[str] = Counter()
            row = await s.evaluate(self.cfg.max_concurrency, f"eval-v{version}", failures)
            assert self.metrics is not None
            self.metrics.write({"version": version, "set": s.cfg.name, **row})
            self._last = {f"eval/{s.cfg.name}/{k}": v for k, v in row.items()}
            log.info(
                "eval",
                version=version,
                set=s.cfg.name,
                pass1=row["pass@1"],
                seconds=round(row["seconds"], 2),
            )
            if failures:
                log.warning(
                    "eval samples failed",
                    set=s.cfg.name,
                    failed=row["failed"],
                    most_common=failures.most_common(1)[0][0][:300],
                )
        self.evaluated += 1

    def stats(self) -> dict[str, float]:
        return {
            "eval/versions": float(self.evaluated),
            "eval/preempted": float(self.preempted),
            **self._last,
        }


@dataclass(slots=True)
class EvalSet:
    """A set ready to run: its prompts, workflow context and the reward that counts."""

    cfg: EvalSetConfig
    prompts: list[Prompt]
    ctx: RolloutContext
    workflow: Workflow
    correct: float

    async def evaluate(
        self, max_concurrency: int, tag: str, failures: Counter[str] | None = None
    ) -> dict[str, float]:
        """This set's metrics row (``rollout/evaluation.py``)."""
        return await evaluate_set(
            self.ctx,
            self.workflow,
            self.prompts,
            self.cfg,
            correct=self.correct,
            max_concurrency=max_concurrency,
            tag=tag,
            failures=failures,
        )


async def open_eval_set(
    cfg: EvalSetConfig,
    config: WorkflowConfig,
    host: EngineHost,
    tokenizer: Any,
    hold: Callable[[Any], Awaitable[Any]],
    reward_model: ScoresPairs | None = None,
) -> EvalSet:
    """``cfg``'s set, read and ready on ``host``'s engines, with the workflow settings of
    ``config`` as its defaults; ``hold`` enters the resources it keeps open (its reward
    scorer, a workflow's proxy) until the caller's exit; ``reward_model`` scores a
    ``model`` reward (the reward actor's client in a job). The eval actor and ``asyncrl
    eval`` (``offline_eval.py``) both open their sets here."""
    # The training rollout's tools: a tool-use policy is evaluated with its tools.
    tools = await asyncio.to_thread(build_tools, config.tool_use)
    reward_cfg = cfg.reward or config.reward
    score = await hold(contextlib.aclosing(build_reward(reward_cfg, reward_model)))
    source = PromptSource.Config(
        path=cfg.path,
        input_key=cfg.input_key,
        label_key=cfg.label_key,
        metadata_key=cfg.metadata_key,
        apply_chat_template=bool(cfg.apply_chat_template),
        default_tools=tools.schemas() if tools else None,
        shuffle=False,
        name=cfg.name,
    )
    opened = await asyncio.to_thread(PromptSource.open, source, tokenizer)
    ctx = RolloutContext(
        engine=host.generator,  # type: ignore[arg-type]
        score=score,
        sampling=cfg.sampling or config.sampling,
        tokenizer=tokenizer,
        version=lambda: host.version,
        tools=tools,
    )
    workflow = load_workflow(config.workflow, config.tool_use, config.agent)
    if hasattr(workflow, "resources"):  # e.g. the agent workflow's OpenAI proxy
        await hold(workflow.resources(ctx))
    return EvalSet(cfg, opened.take(opened.num_rows), ctx, workflow, reward_cfg.correct)
