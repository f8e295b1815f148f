"""The BufferActor in its own process, driven over real sockets by a fake-free producer and
trainer in the test process: admission, batches, versions, requeue, checkpoint and resume."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from asyncrl.actors.base import ActorSpec
from asyncrl.runtime.local import LocalRuntime
from asyncrl.runtime.supervisor import Supervisor
from asyncrl.runtime.topology import allocate_endpoints
from asyncrl.types import (
    BatchReply,
    BatchRequest,
    BufferEvent,
    Group,
    Sample,
    SampleStatus,
    WorkItem,
    WorkReply,
    WorkRequest,
)
from asyncrl.wire.codec import Codec
from asyncrl.wire.control import ControlServer
from asyncrl.wire.messages import Command, WeightVersion
from asyncrl.wire.pubsub import Publisher, Subscriber
from asyncrl.wire.reliable import ReliableSender
from asyncrl.wire.rpc import RpcClient

NUM_PROMPTS, B, N = 12, 2, 2


def write_prompts(path: Path) -> Path:
    rows = [{"prompt": f"{i}+{i}=", "label": str(2 * i)} for i in range(NUM_PROMPTS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def buffer_spec(
    tmp_path: Path, endpoints: dict[str, str], name: str = "buffer", **params: object
) -> ActorSpec:
    return ActorSpec(
        name=name,
        role="buffer",
        cls="asyncrl.actors.buffer:BufferActor",
        endpoints=endpoints,
        heartbeat_interval=0.2,
        drain_timeout=5.0,
        log_file=str(tmp_path / "buffer.jsonl"),
        params={
            "buffer": {"groups_per_step": B, "num_samples_per_prompt": N, "max_staleness": 1},
            "source": {"path": str(tmp_path / "prompts.jsonl"), "seed": 3},
            "metrics_path": str(tmp_path / "metrics.jsonl"),
            "metrics_interval": 0.2,
            "checkpoint_interval": 60.0,
            **params,
        },
    )


def finish(item: WorkItem, version: int) -> Group:
    """What a rollout actor returns: every sample completed, rewards that differ."""
    samples = []
    for j in range(item.num_samples):
        s = Sample.for_prompt(item.prompt, group_id=item.group_uid, index=j, version=item.version)
        s.append_response([5, 6, 7], [-0.1, -0.2, -0.3], version)
        s.status, s.reward, s.temperature = SampleStatus.COMPLETED, float(j), 1.0
        samples.append(s)
    return Group(uid=item.group_uid, prompt_uid=item.prompt.uid, samples=samples)


class Peers:
    """The test process's side: producer and trainer channels to the buffer."""

    def __init__(self, ep: dict[str, str]) -> None:
        self.work = RpcClient(ep["buffer.work"], Codec(WorkRequest), Codec(WorkReply))
        self.batches = RpcClient(ep["buffer.batches"], Codec(BatchRequest), Codec(BatchReply))
        self.results = ReliableSender(ep["buffer.results"], Codec(Group))
        self.weights = Publisher(
            ep["trainer.weights"], ep["trainer.weights_snapshot"], Codec(WeightVersion)
        )
        self.events = Subscriber(
            ep["buffer.events"], ep["buffer.events_snapshot"], Codec(BufferEvent), ["events"]
        )
        self.channels = [self.weights, self.work, self.batches, self.results, self.events]

    async def __aenter__(self) -> Peers:
        for ch in self.channels:
            await ch.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for ch in reversed(self.channels):
            await ch.__aexit__(None, None, None)

    async def ask(
        self, n: int, actor: str = "rollout-0", wait: float = 0.3, **fields: object
    ) -> WorkReply:
        return await self.work.call(WorkRequest(actor=actor, max_items=n, wait=wait, **fields))

    async def batch(self, wait: float = 5.0) -> BatchReply:
        return await self.batches.call(BatchRequest(trainer="trainer", wait=wait))

    def publish_version(self, v: int) -> None:
        self.weights.publish("weights", WeightVersion(version=v, transport="disk", location="-"))


@pytest.fixture
async def supervisor(tmp_path: Path) -> AsyncIterator[Supervisor]:
    write_prompts(tmp_path / "prompts.jsonl")
    async with ControlServer("tcp://127.0.0.1:0") as hub, LocalRuntime(tmp_path) as runtime:
        async with Supervisor(runtime, hub, heartbeat_timeout=5.0, startup_timeout=60) as sup:
            yield sup
            await sup.stop_all(grace=10)


async def wait_version(peers: Peers, supervisor: Supervisor, v: int, name: str) -> None:
    """Publish ``v`` until the buffer's heartbeat shows it (a SUB may join late)."""
    while supervisor.status[name].stats.get("buffer.version", -1) < v:
        peers.publish_version(v)
        await asyncio.sleep(0.1)


async def train_step(
    peers: Peers, supervisor: Supervisor, version: int, name: str = "buffer"
) -> list[str]:
    reply = await peers.batch()
    assert reply.batch is not None and reply.batch.step == version
    assert all(g.staleness(version) <= 1 for g in reply.batch.groups)
    await wait_version(peers, supervisor, version + 1, name)
    return [g.uid for g in reply.batch.groups]


async def test_buffer_actor_admits_serves_and_accounts_for_every_prompt(
    supervisor: Supervisor, tmp_path: Path
):
    ep = allocate_endpoints()
    await supervisor.launch([buffer_spec(tmp_path, ep)])
    consumed: list[str] = []
    async with asyncio.timeout(90), Peers(ep) as peers:
        first = await peers.ask(100)
        # Rule (1) at v = 0: (eta + 0 + 1) * B = 4 groups, however many are asked for.
        assert len(first.items) == (1 + 0 + 1) * B and first.version == 0
        assert (await peers.ask(100)).items == []  # no room until the trainer steps
        for item in first.items:
            await peers.results.send(finish(item, version=0))
        await peers.results.send(finish(first.items[0], version=0))  # a duplicate result
        await peers.results.join()
        version = 0
        while len(consumed) < NUM_PROMPTS:
            consumed += await train_step(peers, supervisor, version)
            version += 1
            reply = await peers.ask(100)
            assert len(reply.items) <= B  # one step freed B slots
            for item in reply.items:
                await peers.results.send(finish(item, version=version))
            await peers.results.join()
        assert (await peers.ask(100)).exhausted
        rest = await peers.batch(wait=0.5)
        assert rest.batch is None and rest.exhausted
        stats = (await supervisor.control.command("buffer", Command(kind="stats"))).data
    assert sorted(consumed) == sorted({f"prompts:{i}@0" for i in range(NUM_PROMPTS)})
    assert stats["buffer.consumed"] == NUM_PROMPTS and stats["buffer.admitted"] == NUM_PROMPTS
    assert stats["buffer.duplicates"] == 1 and stats["buffer.staleness_max"] <= 1
    await asyncio.sleep(0.5)  # one more metrics interval after the last batch
    await supervisor.stop_all(grace=10)  # closing the sink writes what it buffered
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["buffer.consumed"] == NUM_PROMPTS
    assert sum(last["buffer.staleness_samples"].values()) == NUM_PROMPTS * N
    assert sum(last["buffer.staleness_tokens"].values()) == NUM_PROMPTS * N * 3


async def test_requeue_and_resume_from_a_checkpoint_lose_and_repeat_nothing(
    supervisor: Supervisor, tmp_path: Path
):
    ep = allocate_endpoints()
    await supervisor.launch([buffer_spec(tmp_path, ep)])
    async with asyncio.timeout(90), Peers(ep) as peers:
        held = (await peers.ask(3, actor="rollout-dead")).items
        done = (await peers.ask(1, actor="rollout-1")).items
        requeued = await supervisor.control.command(
            "buffer", Command(kind="requeue", args={"actor": "rollout-dead"})
        )
        assert requeued.data["requeued"] == 3
        again = (await peers.ask(10, actor="rollout-1")).items
        assert sorted(i.group_uid for i in again) == sorted(i.group_uid for i in held)
        assert all(i.attempt == 2 for i in again)
        for item in [*done, again[0]]:
            await peers.results.send(finish(item, version=0))
        await peers.results.join()
        ckpt = tmp_path / "buffer.ckpt"
        await supervisor.control.command(
            "buffer", Command(kind="checkpoint", args={"path": str(ckpt)})
        )
    await supervisor.stop_all(grace=10)

    # A new buffer process resumes: the two groups still in flight come back first.
    await supervisor.launch(
        [buffer_spec(tmp_path, ep, "buffer-2", checkpoint=str(ckpt), resume=True)]
    )
    async with asyncio.timeout(90), Peers(ep) as peers:
        resumed = (await peers.ask(10)).items
        assert {i.group_uid for i in resumed} == {i.group_uid for i in again[1:]}
        for item in resumed:
            await peers.results.send(finish(item, version=0))
        await peers.results.join()
        seen = [g for v in range(2) for g in await train_step(peers, supervisor, v, "buffer-2")]
        stats = (await supervisor.control.command("buffer-2", Command(kind="stats"))).data
    expected = {i.group_uid for i in [*held, *done]}
    assert set(seen) == expected and len(seen) == len(expected)
    assert stats["buffer.admitted"] == 4 and stats["buffer.consumed"] == 4


async def test_async_april_cuts_the_groups_a_jump_in_version_made_too_stale(
    supervisor: Supervisor, tmp_path: Path
):
    ep = allocate_endpoints()
    april = {"groups_per_step": B, "num_samples_per_prompt": N, "max_staleness": 1,
             "over_provision": 1.0}  # fmt: skip
    await supervisor.launch([buffer_spec(tmp_path, ep, buffer=april)])
    events = Subscriber(ep["buffer.events"], ep["buffer.events_snapshot"], Codec(BufferEvent),
                        ["events", "cancel"])  # fmt: skip
    async with asyncio.timeout(90), Peers(ep) as peers, events:
        items = (await peers.ask(100)).items
        # Rule (1) at v = 0 with alpha = 1: (1 + 0 + 1) * B + B groups.
        assert len(items) == 3 * B
        tail = items[-2:]  # the long answers: still generating
        for item in items[:-2]:
            await peers.results.send(finish(item, version=0))
        await peers.results.join()
        # A step's worth is done and more: asynchronous APRIL aborts nothing for it.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(events.receive(), 0.5)
        await wait_version(peers, supervisor, 3, "buffer")  # 3 - 0 > the backstop of 2
        event = (await asyncio.wait_for(events.receive(), 10)).msg
        assert (event.kind, event.version) == ("cancel", 3)
        assert event.groups == sorted(i.group_uid for i in tail)
        for item in tail:  # the producer aborted them; their partials come back
            await peers.results.send(finish(item, version=2))
        await peers.results.join()
        stats = (await supervisor.control.command("buffer", Command(kind="stats"))).data
    # The two cut in flight and the four stored at v = 0: all past the backstop, none
    # lost, and told apart: APRIL's cuts from the backstop's drops.
    assert stats["buffer.filtered.cut"] == len(tail) and stats["buffer.duplicates"] == 0
    assert stats["buffer.filtered.stale"] == 3 * B - len(tail)
    assert stats["buffer.in_flight"] == 0 and stats["buffer.admitted"] == 3 * B


async def test_a_batch_is_held_until_acknowledged_and_served_again_to_a_restarted_trainer(
    supervisor: Supervisor, tmp_path: Path
):
    ep = allocate_endpoints()
    await supervisor.launch([buffer_spec(tmp_path, ep)])
    async with asyncio.timeout(90), Peers(ep) as peers:
        for item in (await peers.ask(100)).items:
            await peers.results.send(finish(item, version=0))
        await peers.results.join()
        taken = (await peers.batch()).batch
        assert taken is not None
        # The trainer died before its step: the new one resyncs and gets the same batch.
        again = await peers.batches.call(BatchRequest(trainer="trainer", resync=True))
        assert again.batch is not None and again.batch.batch_id == taken.batch_id
        assert [g.uid for g in again.batch.groups] == [g.uid for g in taken.groups]
        stats = (await supervisor.control.command("buffer", Command(kind="stats"))).data
        assert stats["unacked_batches"] == 1
        # Acknowledged: a resync now gets the next batch, never the finished one.
        ack = BatchRequest(trainer="trainer", ack=[taken.batch_id], resync=True, wait=5.0)
        following = (await peers.batches.call(ack)).batch
        assert following is not None and following.batch_id != taken.batch_id
        await peers.batches.call(BatchRequest(trainer="t", ack=[following.batch_id], take=False))
        stats = (await supervisor.control.command("buffer", Command(kind="stats"))).data
        assert stats["unacked_batches"] == 0


async def test_asking_again_after_a_lost_reply_gets_the_same_work_even_behind_a_new_version(
    supervisor: Supervisor, tmp_path: Path
):
    ep = allocate_endpoints()
    await supervisor.launch([buffer_spec(tmp_path, ep)])
    async with asyncio.timeout(60), Peers(ep) as peers:
        first = await peers.ask(1, request="inc-1", version=0)
        assert len(first.items) == 1
        for item in (await peers.ask(100, actor="rollout-1")).items:
            await peers.results.send(finish(item, version=0))
        await peers.results.join()
        await train_step(peers, supervisor, 0)  # the buffer is at version 1 now
        # rollout-0's reply was lost; it asks again with the same id and its old version.
        again = await peers.ask(1, request="inc-1", version=0)
        assert [i.group_uid for i in again.items] == [i.group_uid for i in first.items]
        fresh = await peers.ask(3, request="inc-2", version=0)
        assert fresh.items == []  # a new request from engines behind the version: none


async def test_a_producer_whose_engines_lag_behind_the_version_gets_no_work(
    supervisor: Supervisor, tmp_path: Path
):
    ep = allocate_endpoints()
    await supervisor.launch([buffer_spec(tmp_path, ep)])
    async with asyncio.timeout(60), Peers(ep) as peers:
        for item in (await peers.ask(100)).items:
            await peers.results.send(finish(item, version=0))
        await peers.results.join()
        await train_step(peers, supervisor, 0)  # the buffer is at version 1 now
        behind = WorkRequest(actor="rollout-0", max_items=4, wait=0.2, version=0)
        reply = await peers.work.call(behind)
        assert reply.items == [] and reply.version == 1
        current = WorkRequest(actor="rollout-0", max_items=4, wait=0.2, version=1)
        assert len((await peers.work.call(current)).items) == B  # one step freed B slots


async def test_a_request_that_waited_across_a_new_version_gets_no_work_for_old_engines(
    supervisor: Supervisor, tmp_path: Path
):
    ep = allocate_endpoints()
    await supervisor.launch([buffer_spec(tmp_path, ep)])
    async with asyncio.timeout(60), Peers(ep) as peers:
        for item in (await peers.ask(100, version=0)).items:
            await peers.results.send(finish(item, version=0))
        await peers.results.join()
        # No room at version 0: this request waits, and the trainer steps meanwhile.
        pending = asyncio.create_task(peers.ask(100, wait=20.0, version=0))
        await asyncio.sleep(0.3)
        await train_step(peers, supervisor, 0)
        reply = await pending
        # Work admitted at version 1 must not go to engines that still serve version 0.
        assert reply.items == [] and reply.version == 1


async def test_colocated_the_batch_waits_until_every_engine_sleeps(
    supervisor: Supervisor, tmp_path: Path
):
    ep = allocate_endpoints()
    sync = {"groups_per_step": B, "num_samples_per_prompt": N, "max_staleness": 0}
    actors = ["rollout-0", "rollout-1"]
    spec = buffer_spec(tmp_path, ep, buffer=sync, colocate=True, rollout_actors=actors)
    await supervisor.launch([spec])
    async with asyncio.timeout(60), Peers(ep) as peers:
        first = (await peers.ask(100, actor="rollout-0")).items
        second = (await peers.ask(100, actor="rollout-1")).items
        assert len(first) == len(second) == B // 2  # the step's groups are shared out
        for item in first + second:
            await peers.results.send(finish(item, version=0))
        await peers.results.join()
        await peers.ask(100, actor="rollout-0", wait=0.1, asleep=True)
        # rollout-1 has not said its engines sleep: they may still hold memory.
        assert (await peers.batch(wait=0.5)).batch is None
        idle = await peers.ask(100, actor="rollout-1")  # nothing left before the next step
        assert idle.items == [] and idle.sleep
        # The batch is complete: an awake actor's waiting request returns at once, to sleep.
        woken = await asyncio.wait_for(peers.ask(100, actor="rollout-0", wait=30.0), 10)
        assert woken.items == [] and woken.sleep
        assert (await peers.batch(wait=0.5)).batch is None  # both engines still awake
        await peers.ask(100, actor="rollout-1", wait=0.1, asleep=True)
        assert (await peers.batch(wait=0.5)).batch is None  # rollout-0 still awake
        await peers.ask(100, actor="rollout-0", wait=0.1, asleep=True)
        served = (await peers.batch(wait=5.0)).batch
        assert served is not None and len(served.groups) == B
