"""RolloutActor: work from the buffer, workflows against engines, groups back (docs/design.md s.2).

Under one TaskGroup: the work loop asks the buffer for as many groups as it has free
slots (``max_groups``) and runs each in a task, its unfinished samples concurrently; the
weights loop loads each new version into the engines (``EngineHost.load``); the events
loop aborts requests when the buffer says so (APRIL). A sample whose workflow or reward
raises fails alone, with the reason. Colocated, the engines sleep while the trainer steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.actors.base import Actor, ActorSpec
from asyncrl.actors.config import RolloutActorConfig
from asyncrl.actors.engine import engine_url
from asyncrl.engines.config import EngineConfig
from asyncrl.engines.sglang_wire import EngineUnavailable
from asyncrl.observe.logs import get_logger
from asyncrl.observe.metrics import JsonlMetricsSink
from asyncrl.rollout.base import RolloutContext, Workflow
from asyncrl.rollout.config import RewardConfig, ToolUseConfig
from asyncrl.rollout.engines import EngineHost, engine_seed
from asyncrl.types import BufferEvent, Group, Sample, SampleStatus, WorkItem, WorkReply, WorkRequest
from asyncrl.weights.sync import WeightReceiver
from asyncrl.wire.codec import Codec
from asyncrl.wire.errors import PeerLost
from asyncrl.wire.messages import Command, Scalar, WeightVersion
from asyncrl.wire.pubsub import Subscriber
from asyncrl.wire.reliable import ReliableSender
from asyncrl.wire.rpc import RpcClient

log = get_logger("asyncrl.rollout")
_WAIT_S = 1.0
_TERMINAL = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED, SampleStatus.FAILED)


class RolloutActor(Actor):
    """Runs workflows for the buffer's work items; see the module docstring."""

    Config = RolloutActorConfig
    config: RolloutActorConfig

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        self.counts = dict.fromkeys(
            ("groups", "samples", "failed", "aborted", "tokens", "sleeps"), 0
        )
        self.busy_s = 0.0
        self._rewards: list[float] = []  # scored since the last metrics row
        self._in_flight = 0
        self._held: set[str] = set()  # uids of the groups running here
        self._started = time.monotonic()
        self._busy: list[list[float]] = []  # [start, end] unix seconds with groups running
        self._busy_since: float | None = None
        self.metrics: JsonlMetricsSink | None = None
        self._temperature = 1.0  # of the sampling params, set in setup

    async def setup(self) -> None:
        cfg = self.config
        self.max_groups = cfg.max_groups
        self._free = self.max_groups
        self._slot_freed = asyncio.Event()
        self._behind = 0  # the buffer's version at our last request
        self._loaded = asyncio.Event()
        self.colocate = cfg.colocate
        self._asleep = False  # colocated: the engines released their memory
        self._aborts = 0  # abort-alls so far (APRIL, drain): see RolloutContext.aborts
        # Work request ids: unique to this incarnation, so the buffer can tell a retry
        # (same id: the reply was lost) from a new request.
        self._incarnation = os.urandom(4).hex()
        self._requests = itertools.count(1)
        engine = cfg.engine
        self.own_engine = engine.serve == "actor"
        wait = engine.startup_timeout if self.own_engine else None
        key = cfg.engine_api_key if self.own_engine else None
        spill = Path(cfg.spill_dir) / self.name if cfg.spill_dir else None
        seed = engine_seed(engine.seed, self.name, self.spec.incarnation.restarted)
        host = EngineHost(
            self._engine_config(engine),
            wait_ready_s=wait,
            api_key=key,
            spill_dir=spill,
            seed=seed,
            threads=self.lent_threads(),
        )
        self.host = await self.hold(host)
        tools = await asyncio.to_thread(build_tools, cfg.tool_use)
        self.workflow = load_workflow(cfg.workflow, cfg.tool_use, cfg.agent)
        rm = await reward_model_client(self.spec.endpoints, self.hold, self.name)
        self.score = await self.hold(contextlib.aclosing(build_reward(cfg.reward, rm)))
        self.ctx = RolloutContext(
            engine=self.host.generator,  # type: ignore[arg-type]
            score=self.score,
            sampling=cfg.sampling,
            tokenizer=await asyncio.to_thread(policy_tokenizer, cfg.tokenizer, self.host),
            version=lambda: self.host.version,
            aborts=lambda: self._aborts,
            tools=tools,
        )
        self._temperature = self.ctx.sampling.logprob_temperature
        if hasattr(self.workflow, "resources"):  # e.g. the agent workflow's OpenAI proxy
            await self.hold(self.workflow.resources(self.ctx))
        await self._open_channels()
        if cfg.metrics_dir:
            self.metrics = self.open_metrics(Path(cfg.metrics_dir) / f"{self.name}.jsonl")

    def _engine_config(self, cfg: EngineConfig) -> EngineConfig:
        """The engines to use; ``serve: actor``: this actor's engine actor, over HTTP."""
        if cfg.serve != "actor":
            return cfg
        engine = self.name.replace("rollout-", "engine-", 1)
        url = engine_url(self.spec.endpoints[f"{engine}.http"])
        return EngineConfig(type="sglang", urls=[url], on_update=cfg.on_update)

    async def _open_channels(self) -> None:
        ep, frame = self.spec.endpoints, self.max_frame_bytes
        self.work = await self.open(
            RpcClient(
                ep["buffer.work"], Codec(WorkRequest), Codec(WorkReply, max_frame_bytes=frame)
            ),
            "work",
        )
        wire = self.wire
        sender = ReliableSender(
            ep["buffer.results"],
            Codec(Group, max_frame_bytes=frame),
            hwm=wire.hwm,
            window=wire.window,
            batch_bytes=wire.batch_bytes,
            redeliver_after=wire.redeliver_after,
        )
        self.results = await self.open(sender, "results")
        self.events = await self.open(
            Subscriber(
                ep["buffer.events"],
                ep["buffer.events_snapshot"],
                Codec(BufferEvent),
                ["events", "cancel"],
            ),
            "events",
        )
        group = await self._join_weight_group()
        receiver = WeightReceiver(
            ep["trainer.weights"],
            ep["trainer.weights_snapshot"],
            max_frame_bytes=frame,
            group=group,
        )
        self.receiver = await self.hold(receiver)

    async def _join_weight_group(self) -> Any:
        """The dist transport's group membership (rank: rollout-i is i + 1); the group
        forms in the background once the trainer names it (``weights/group.py``). An
        embedded engine receives in this process; engines behind the SGLang API join
        themselves, at our asking (``rollout/server_group.py``)."""
        cfg = self.config.weight_group
        if cfg is None:
            return None
        rank = cfg.rank if cfg.rank is not None else 1 + int(self.name.rpartition("-")[2])
        address = cfg.address or self.spec.endpoints["trainer.group"]
        if self.host.engine is None:
            from asyncrl.rollout.server_group import ServerGroup

            assert self.host.client is not None
            group = ServerGroup(cfg, rank=rank, address=address, client=self.host.client)
            await group.check()
            self.host.server_group = await self.hold(contextlib.aclosing(group))
            return group
        from asyncrl.weights.group import GroupMembership

        membership = GroupMembership(cfg, rank=rank, address=address)
        self.close_later(membership.close)
        return membership

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            loops = [
                tg.create_task(self._weights_loop(), name=f"{self.name}.weights"),
                tg.create_task(self._events_loop(), name=f"{self.name}.events"),
                tg.create_task(self._metrics_loop(), name=f"{self.name}.metrics"),
            ]
            await self._work_loop(tg)
            for task in loops:
                task.cancel()

    # -- work ----------------------------------------------------------------------------
    async def _work_loop(self, tg: asyncio.TaskGroup) -> None:
        while not self.stopping:
            while self._free == 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
            if self._behind > self.host.version or self.host.torn:
                # The buffer waits for our new weights, or our engine aborts every request
                # until a complete version is loaded: ask for no work meanwhile.
                await self._wait_loaded()
            req = WorkRequest(
                actor=self.name,
                max_items=self._free,
                wait=_WAIT_S,
                version=self.host.version,
                asleep=self._asleep,
                request=f"{self._incarnation}-{next(self._requests)}",
            )
            reply = await self._ask(req)
            if reply is None:
                return  # stopping, and the buffer went first: nothing was handed to us
            self._free -= len(reply.items)
            self._behind = reply.version
            for item in reply.items:
                tg.create_task(self._run_group(item), name=f"{self.name}.{item.group_uid}")
            if reply.exhausted and not reply.items:
                await asyncio.sleep(_WAIT_S)  # the data is used up; the controller stops us
            elif reply.sleep and not reply.items:
                await self._make_room_for_training()

    async def _ask(self, req: WorkRequest) -> WorkReply | None:
        """The buffer's reply to ``req``. A reset connection (the buffer restarted) sends
        the same request again: a handout whose reply was lost comes back, never twice."""
        while True:
            try:
                return await self.work.call(req)
            except PeerLost as exc:
                if self.stopping:
                    return None
                log.warning("buffer lost; asking again", error=str(exc))
                await asyncio.sleep(_WAIT_S)

    async def _make_room_for_training(self) -> None:
        """Colocated: once nothing runs here, put the engines to sleep for the train step
        (the buffer hands the trainer its batch only once every actor sleeps); while
        groups still run (aborted APRIL extras), wait for one to end instead of asking the
        buffer again at once."""
        if self._in_flight:
            self._slot_freed.clear()  # no await since the check: no finish is missed
            await self._slot_freed.wait()
        elif not self._asleep:
            start = time.monotonic()
            await self.host.sleep()
            self._asleep = True
            self.counts["sleeps"] += 1
            log.debug("engines asleep", seconds=time.monotonic() - start)

    async def _run_group(self, item: WorkItem) -> None:
        start = time.monotonic()
        self._in_flight += 1
        self._held.add(item.group_uid)
        if self._in_flight == 1:
            self._busy_since = time.time()
        try:
            samples = _samples_of(item)
            # Generated by earlier runs (a finished sample's branches too).
            resumed = sum(x.response_length for s in samples for x in (s, *s.branches))
            todo = [s for s in samples if s.status not in _TERMINAL]
            async with asyncio.TaskGroup() as tg:
                for s in todo:
                    tg.create_task(self._run_sample(s), name=f"{self.name}.{s.uid}")
            group = Group(uid=item.group_uid, prompt_uid=item.prompt.uid, samples=samples)
            await self.results.send(group)
            self._count(group, resumed)
        finally:
            self._in_flight -= 1
            self._held.discard(item.group_uid)
            if self._in_flight == 0 and self._busy_since is not None:
                self._busy.append([self._busy_since, time.time()])
                self._busy_since = None
            self.busy_s += time.monotonic() - start
            self._free += 1
            self._slot_freed.set()

    async def _run_sample(self, sample: Sample) -> None:
        """The workflow on one sample; user code may raise: the sample fails, not us."""
        sample.attempts += 1
        # What the trainer needs to recompute the engine's log-probs (a workflow that
        # samples at another temperature sets its own).
        sample.temperature = self._temperature
        try:
            result = await self.workflow(self.ctx, sample)
        except EngineUnavailable as exc:
            if self.own_engine:
                # Our engine actor is down: fail this actor, so the supervisor requeues
                # its work (none of it is lost as failed) and restarts it beside the
                # restarted engine, which it then brings to the current weights.
                raise
            sample.status, sample.error = SampleStatus.FAILED, f"{type(exc).__name__}: {exc}"
            log.warning("sample failed", uid=sample.uid, error=sample.error)
            return
        except Exception as exc:  # the workflow, the engine call or the reward raised
            sample.status, sample.error = SampleStatus.FAILED, f"{type(exc).__name__}: {exc}"
            log.warning("sample failed", uid=sample.uid, error=sample.error)
            return
        try:
            attach_branches(sample, result)
        except TypeError as exc:  # the workflow broke the contract: its sample fails
            sample.status, sample.error = SampleStatus.FAILED, f"workflow: {exc}"
            log.warning("sample failed", uid=sample.uid, error=sample.error)

    async def _wait_loaded(self) -> None:
        """Until the weights loop loads a new version (or a request's wait passes)."""
        self._loaded.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._loaded.wait(), _WAIT_S)

    def _count(self, group: Group, resumed: int) -> None:
        """Tally a returned group; ``tokens`` counts only what this run generated (a resumed
        partial's earlier tokens were counted by the run that generated them)."""
        self.counts["groups"] += 1
        self.counts["tokens"] += (
            sum(x.response_length for s in group.samples for x in (s, *s.branches)) - resumed
        )
        for s in group.samples:
            self.counts["samples"] += 1
            self.counts["failed"] += s.status is SampleStatus.FAILED
            self.counts["aborted"] += s.status is SampleStatus.ABORTED
            reward = s.reward.get("score") if isinstance(s.reward, dict) else s.reward
            if isinstance(reward, int | float):  # every scored sample: before any filter
                self._rewards.append(float(reward))

    # -- weights and events ---------------------------------------------------------------
    async def _weights_loop(self) -> None:
        while True:
            msg = await self.receiver.next_version(after=self.host.version, held=self.host.lineage)
            start = time.monotonic()
            if self._asleep:  # colocated: the train step is over, the engines come back
                await self.host.wake()
                self._asleep = False
            if await self._load(msg):
                log.info("weights loaded", version=msg.version, seconds=time.monotonic() - start)

    async def _load(self, msg: WeightVersion) -> bool:
        """Load ``msg`` into the engines; False when it is gone (wait for the next)."""
        if not await self.host.load(msg, self.receiver):
            return False
        self._loaded.set()
        return True

    async def on_command(self, cmd: Command) -> dict[str, Scalar]:
        """``engine_restarted``: bring the restarted engine actor back to our weights."""
        if cmd.kind == "engine_restarted":
            return {"reloaded": await self._reload_engine()}
        return await super().on_command(cmd)

    async def _reload_engine(self) -> int:
        """Our engine actor came back with its initial weights: ``EngineHost.reload``
        (once it answers) loads ours again if it serves older ones."""
        await self.host.wait_ready(self.host.wait_ready_s or 120.0)
        version = await self.host.reload(self.receiver)
        if version:
            self._loaded.set()
        return version

    async def _metrics_loop(self) -> None:
        """Every ``metrics_interval`` s: the counters and the busy intervals since the last
        row (an interval still open is cut at now and continues in the next row)."""
        interval = self.config.metrics_interval
        while self.metrics is not None:
            await asyncio.sleep(interval)
            self._write_metrics()

    def _write_metrics(self) -> None:
        if self.metrics is None:
            return
        now = time.time()
        busy, self._busy = self._busy, []
        if self._busy_since is not None:
            busy.append([self._busy_since, now])
            self._busy_since = now
        rewards, self._rewards = self._rewards, []
        mean = {"rollout/reward_mean": sum(rewards) / len(rewards)} if rewards else {}
        row = {"actor": self.name, **self.stats(), **mean, "version": self.host.version}
        self.metrics.write({**row, "busy": busy, "time": now})

    async def _events_loop(self) -> None:
        while True:
            event = (await self.events.receive()).msg
            if self.host.client is None:
                continue
            if event.kind == "abort":
                await self._abort_all()
            elif event.kind == "cancel":
                await self._cancel(event.groups)

    async def _abort_all(self) -> None:
        # Counted first: a multi-turn episode between two engine calls (running its tools)
        # has no request to abort, and sees the count change before its next turn.
        self._aborts += 1
        await self.host.client.abort(abort_all=True)

    async def _cancel(self, groups: list[str]) -> None:
        """Abort the requests of the ``groups`` running here (rids start ``<uid>/``)."""
        for uid in sorted(self._held.intersection(groups)):
            await self.host.abort_prefix(f"{uid}/")

    async def drain(self) -> None:
        """Abort what is in flight and deliver it: partial groups resume elsewhere."""
        if self.host.client is not None:
            await self._abort_all()
        while self._in_flight:
            self._slot_freed.clear()
            await self._slot_freed.wait()
        await self.results.join()
        self._write_metrics()

    def stats(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rates = {"rollout/busy_frac": min(1.0, self.busy_s / elapsed / max(self.max_groups, 1))}
        return {
            **{f"rollout/{k}": float(v) for k, v in self.counts.items()},
            **{k: float(v) for k, v in getattr(getattr(self, "score", None), "stats", {}).items()},
            "rollout/in_flight": float(self._in_flight),
            **rates,
            **self._weight_counts(),
            **self._engine_counts(),
        }

    def _engine_counts(self) -> dict[str, float]:
        """An embedded torch engine's steps, and those run on threads the trainer lent."""
        stats = getattr(getattr(getattr(self, "host", None), "engine", None), "stats", None)
        if not isinstance(stats, dict) or "lent_thread_steps" not in stats:
            return {}
        return {f"engine/{k}": float(stats[k]) for k in ("steps", "lent_thread_steps")}

    def _weight_counts(self) -> dict[str, float]:
        """dist, ipc: versions taken by broadcast, from shared memory, and by pull (the
        group forming or failed, a version dropped, another host)."""
        receiver = getattr(self, "receiver", None)
        if receiver is None or not any(receiver.counts.values()):
            return {}
        return {f"rollout/weights_{k}": float(v) for k, v in receiver.counts.items()}


def attach_branches(sample: Sample, result: object) -> None:
    """Check what a workflow returned for ``sample`` and keep its branches there.

    A workflow returns the sample, or a list holding it (the root, whose reward is the
    trajectory's) and its branches, each a finished sample with prompt and response
    tokens. A branch takes the root's group, index and admission, the uid
    ``<root uid>/b<k>``, and the root's temperature unless it set its own. An aborted
    root keeps no branches: its next run makes them again. ``TypeError`` says what is wrong."""
    if result is sample:
        return
    if not isinstance(result, list) or not any(x is sample for x in result):
        raise TypeError(
            "a workflow must return the sample it was given, or a list that holds it and "
            f"its branches; got {type(result).__name__}"
        )
    branches = [x for x in result if x is not sample]
    for k, b in enumerate(branches):
        if not isinstance(b, Sample):
            raise TypeError(f"branch {k} is a {type(b).__name__}, not a Sample")
    if not sample.is_done:  # an abort cut the trajectory: its rerun branches again
        return
    for k, b in enumerate(branches):
        if b.status not in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
            raise TypeError(
                f"branch {k} is {b.status} ({b.error or 'no reason'}): a branch must be finished"
            )
        if not b.response_length or not len(b.prompt_tokens):
            raise TypeError(f"branch {k} has no prompt or no response tokens")
        if b.branches:
            raise TypeError(f"branch {k} has branches of its own: give them to the root")
    sample.branches = [
        msgspec.structs.replace(
            b,
            uid=f"{sample.uid}/b{k}",
            group_id=sample.group_id,
            index=sample.index,
            prompt_id=sample.prompt_id,
            admitted_at_version=sample.admitted_at_version,
            temperature=_branch_temperature(b, sample),
        )
        for k, b in enumerate(branches)
    ]


def _branch_temperature(branch: Sample, root: Sample) -> float | None:
    """A branch that sets no temperature was sampled as its root was (the rollout's
    sampling); one that sets one keeps it, 1.0 included (``Sample.temperature``)."""
    return root.temperature if branch.temperature is None else branch.temperature


def _samples_of(item: WorkItem) -> list[Sample]:
    """The group's samples: the partial ones to resume, or fresh ones."""
    if item.partial is not None:
        return list(item.partial.samples)
    return [
        Sample.for_prompt(item.prompt, group_id=item.group_uid, index=i, version=item.version)
        for i in range(item.num_samples)
    ]


def build_tools(cfg: ToolUseConfig | None) -> Any:
    """The tool registry of ``cfg`` (None without tool use)."""
    from asyncrl.rollout.tools.build import build_registry

    return build_registry(cfg) if cfg is not None else None


def load_workflow(path: str | None, tool_use: Any = None, agent: Any = None) -> Workflow:
    """The workflow at ``path`` (default: single-turn, or the tool-use or agent one)."""
    from asyncrl.rollout.workflows import load_workflow as load

    return load(path, tool_use, agent)


def build_reward(config: RewardConfig, reward_model: Any = None) -> Any:
    """The reward scorer of ``config``; ``reward_model`` scores its ``model`` reward."""
    from asyncrl.rollout.rewards import build_reward as build

    return build(config, reward_model)


async def reward_model_client(
    endpoints: dict[str, str], hold: Callable[[Any], Awaitable[Any]], name: str
) -> Any:
    """A client of the job's reward actor (``reward.score``), open until the caller's exit
    (``hold``); None in a job without one."""
    if "reward.score" not in endpoints:
        return None
    from asyncrl.rollout.reward_model import REPLY_CODEC, REQUEST_CODEC, RewardModelClient

    # A fresh identity each incarnation: replies owed to a dead one never reach this one.
    rpc = RpcClient(endpoints["reward.score"], REQUEST_CODEC, REPLY_CODEC, name=f"{name}.rm")
    return RewardModelClient(await hold(rpc))


def policy_tokenizer(path: str | None, host: EngineHost) -> Any:
    """The embedded engine's tokenizer, else the one at ``path`` (the policy's), else the
    engine model's."""
    path = path or host.config.model_path
    if host.engine is not None and host.engine.tokenizer is not None:
        return host.engine.tokenizer
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
