"""RolloutActor's tallies (``rollout/tokens`` and friends): what a run of a group generated.
The cluster simulator's APRIL runs found resumed partials counted twice."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.actors.base import ActorSpec
from asyncrl.actors.config import RolloutActorConfig
from asyncrl.actors.rollout import RolloutActor
from asyncrl.engines.config import EngineConfig
from asyncrl.rollout.config import RewardConfig
from asyncrl.types import Group, Prompt, Sample, SampleStatus, WorkItem


class _Sent:
    def __init__(self) -> None:
        self.groups: list[Group] = []

    async def send(self, group: Group) -> None:
        self.groups.append(group)


async def _three_more_tokens(ctx: Any, sample: Sample) -> Sample:
    sample.append_response([7, 7, 7], [-0.1] * 3, 1)
    sample.status = SampleStatus.COMPLETED
    return sample


def _actor() -> RolloutActor:
    config = RolloutActorConfig(
        engine=EngineConfig(model_path="unused"),
        sampling={},
        reward=RewardConfig(),
        max_groups=2,
        metrics_interval=5.0,
    )
    spec = ActorSpec(name="rollout-0", role="rollout", cls="x:y", params=config.model_dump())
    actor = RolloutActor(spec)
    actor.results, actor.workflow, actor.ctx = _Sent(), _three_more_tokens, None  # type: ignore[assignment]
    actor.own_engine, actor._free, actor._slot_freed = False, 2, asyncio.Event()
    return actor


async def test_a_resumed_partial_counts_only_the_tokens_this_run_generated():
    actor = _actor()
    prompt = Prompt(uid="p:0@0", prompt_id="p:0", prompt="1+1=")
    partial = [Sample.for_prompt(prompt, group_id="g", index=i, version=0) for i in range(2)]
    for sample in partial:  # an APRIL extra aborted after 5 tokens
        sample.append_response([1, 2, 3, 4, 5], [-0.1] * 5, 0)
        sample.status = SampleStatus.ABORTED
    resumed = Group(uid="g", prompt_uid=prompt.uid, samples=partial)
    await actor._run_group(WorkItem(group_uid="g", prompt=prompt, num_samples=2, version=1,
                                    attempt=2, partial=resumed))  # fmt: skip
    assert actor.counts["tokens"] == 2 * 3  # not 2 * 8: the first 5 were counted when made
    await actor._run_group(WorkItem(group_uid="h", prompt=prompt, num_samples=2, version=1))
    assert actor.counts["tokens"] == 2 * 3 + 2 * 3 and actor.counts["samples"] == 4
    assert [len(s.response_tokens) for g in actor.results.groups for s in g.samples] == [8, 8, 3, 3]


class _Client:
    """An engine host that records the prefixes it cancels; a cancel releases the
    requests waiting on it."""

    def __init__(self) -> None:
        self.aborted: list[str | None] = []
        self.released = asyncio.Event()

    async def abort_prefix(self, prefix: str) -> None:
        self.aborted.append(prefix)
        self.released.set()


async def test_a_cancel_aborts_the_requests_of_the_groups_running_here_and_no_others():
    actor, client = _actor(), _Client()
    actor.host = client  # type: ignore[assignment]
    rids: list[str] = []
    both_running = asyncio.Event()

    async def until_aborted(ctx: Any, sample: Sample) -> Sample:
        rids.append(f"{sample.uid}#{sample.attempts}#")  # as single_turn names its request
        if len(rids) == 2:
            both_running.set()
        await client.released.wait()
        sample.status = SampleStatus.ABORTED
        return sample

    actor.workflow = until_aborted  # type: ignore[assignment]
    prompt = Prompt(uid="p:0@0", prompt_id="p:0", prompt="1+1=")
    item = WorkItem(group_uid="g", prompt=prompt, num_samples=2, version=0)
    running = asyncio.create_task(actor._run_group(item))
    await both_running.wait()
    # The buffer's event lists every group cut and not back yet, wherever it runs.
    await actor._cancel(["elsewhere", "g"])
    await running
    assert client.aborted == ["g/"] and all(rid.startswith("g/") for rid in rids)
    (group,) = actor.results.groups
    assert all(s.status is SampleStatus.ABORTED for s in group.samples)
    await actor._cancel(["g"])  # its result is sent: nothing left to abort
    assert client.aborted == ["g/"]
