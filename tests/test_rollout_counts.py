"""RolloutActor's tallies (``rollout/tokens`` and friends): what a run of a group generated.
The cluster simulator's APRIL runs found resumed partials counted twice."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.actors.base import ActorSpec
from asyncrl.actors.config import RolloutActorConfig
from asyncrl.actors.rollout import RolloutActor
from asyncrl.rollout.config import EngineConfig, RewardConfig
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
