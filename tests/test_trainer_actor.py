"""The TrainerActor in its own process with a BufferActor, a producer in the test process
and a weight subscriber in a third process: it trains, acknowledges, publishes versions a
subscriber loads exactly, checkpoints, finishes, and resumes from its checkpoint."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from asyncrl.actors.base import ActorSpec
from asyncrl.actors.config import PublishConfig, TrainerActorConfig
from asyncrl.actors.trainer import TrainerActor
from asyncrl.cores import BusyMark
from asyncrl.errors import CheckpointUnreadable
from asyncrl.policies.config import PolicyConfig
from asyncrl.runtime.local import LocalRuntime
from asyncrl.runtime.supervisor import Supervisor
from asyncrl.runtime.topology import allocate_endpoints
from asyncrl.trainers.base import StepResult, UntrainableBatch
from asyncrl.trainers.config import TrainerConfig
from asyncrl.trainers.torch_trainer import TorchTrainer
from asyncrl.types import BatchReply, Group, TrainBatch, WorkReply, WorkRequest
from asyncrl.wire.codec import Codec
from asyncrl.wire.control import ControlServer
from asyncrl.wire.messages import Command
from asyncrl.wire.reliable import ReliableSender
from asyncrl.wire.rpc import RpcClient
from tests.polling import until
from tests.test_buffer_actor import B, buffer_spec, finish, write_prompts
from tests.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow


def trainer_spec(tmp_path: Path, ep: dict[str, str], name: str, num_steps: int) -> ActorSpec:
    return ActorSpec(
        name=name,
        role="trainer",
        cls="asyncrl.actors.trainer:TrainerActor",
        endpoints=ep,
        heartbeat_interval=0.2,
        drain_timeout=150.0,
        log_file=str(tmp_path / f"{name}.jsonl"),
        params=trainer_config(
            trainer=TrainerConfig(model_path=str(tmp_path / "model"), lr=1e-2, seed=0),
            # The subscriber process may join after the last step: wait for its pull.
            publish=PublishConfig(
                transport="pull", keep=2, final_pullers=("subscriber",), linger_s=120
            ),
            num_steps=num_steps,
            checkpoint_dir=str(tmp_path / "ckpt"),
            checkpoint_interval=1,
            async_save=True,  # written while the next step trains, as beside a GPU
            metrics_path=str(tmp_path / f"{name}.metrics.jsonl"),
        ).model_dump(mode="json"),
    )


def trainer_config(**fields: object) -> TrainerActorConfig:
    """A trainer actor's settings: ``fields`` over a decoupled-PPO job's."""
    base: dict[str, object] = {
        "trainer": TrainerConfig(model_path="unused"),
        "algo": PolicyConfig(off_policy_correction="decoupled"),
        "publish": PublishConfig(transport="pull", keep=2),
        "num_steps": 0,
        "checkpoint_interval": 0,
        "keep_checkpoints": None,
    }
    return TrainerActorConfig.model_validate(base | fields)


async def produce_until(supervisor: Supervisor, ep: dict[str, str], trainer: str) -> int:
    """Play the rollout actors: finish every work item until ``trainer`` has finished."""
    work = RpcClient(ep["buffer.work"], Codec(WorkRequest), Codec(WorkReply))
    results = ReliableSender(ep["buffer.results"], Codec(Group))
    sent = 0
    async with work, results:
        while supervisor.status[trainer].state != "finished":
            if supervisor.failure is not None:
                raise supervisor.failure
            reply = await work.call(WorkRequest(actor="rollout-0", max_items=4, wait=0.2))
            for item in reply.items:
                await results.send(finish(item, version=reply.version))
                sent += 1
            await results.join()
    return sent


def subscribe(ep: dict[str, str], version: int, model: Path, out: Path) -> subprocess.Popen:
    args = [ep["trainer.weights"], ep["trainer.weights_snapshot"], str(version), str(model)]
    cmd = [sys.executable, "-m", "tests.weight_subscriber", *args, str(out)]
    return subprocess.Popen(cmd, cwd=Path(__file__).parents[1])


@pytest.fixture
async def supervisor(tmp_path: Path):
    write_prompts(tmp_path / "prompts.jsonl")
    build_tiny_model(tmp_path / "model")
    async with ControlServer("tcp://127.0.0.1:0") as hub, LocalRuntime(tmp_path) as runtime:
        async with Supervisor(runtime, hub, heartbeat_timeout=20.0, startup_timeout=120) as sup:
            yield sup
            await sup.stop_all(grace=10)


def trained_weights(tmp_path: Path, step: int) -> dict[str, torch.Tensor]:
    """The weights of the checkpoint after ``step``, through a fresh trainer."""
    cfg = TorchTrainer.Config(model_path=str(tmp_path / "model"))
    trainer = TorchTrainer(cfg, PolicyConfig())
    trainer.load_checkpoint(tmp_path / "ckpt" / f"step_{step:06d}")
    assert trainer.version == step
    return trainer.export_weights()


async def test_the_trainer_actor_trains_publishes_acknowledges_and_resumes(
    supervisor: Supervisor, tmp_path: Path
):
    ep = allocate_endpoints()
    tokenizer = str(tmp_path / "model")
    await supervisor.launch([buffer_spec(tmp_path, ep, tokenizer=tokenizer)])
    sub = subscribe(ep, 2, tmp_path / "model", tmp_path / "sub.safetensors")
    await supervisor.launch([trainer_spec(tmp_path, ep, "trainer", num_steps=2)])
    async with asyncio.timeout(180):
        await produce_until(supervisor, ep, "trainer")
        assert await asyncio.to_thread(sub.wait, 120) == 0
        stats = (await supervisor.control.command("buffer", Command(kind="stats"))).data
    # Every batch the trainer stepped on was acknowledged before it exited.
    assert stats["buffer.consumed"] == 2 * B and stats["unacked_batches"] == 0
    assert stats["buffer.version"] == 2
    # The subscriber process loaded exactly the weights of step 2.
    got = load_file(tmp_path / "sub.safetensors")
    with safe_open(tmp_path / "sub.safetensors", "pt") as f:
        assert f.metadata()["version"] == "2"
    expected = trained_weights(tmp_path, 2)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in got)
    initial = load_file(tmp_path / "model" / "model.safetensors")
    assert any(not torch.equal(got[k], initial[k]) for k in got)  # training moved them
    rows = [json.loads(x) for x in (tmp_path / "trainer.metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    keys = ("loss", "grad_norm", "clip_frac", "entropy", "staleness/mean", "tokens_per_s")
    for key in (*keys, "time/wait_data", "time/publish"):
        assert all(torch.isfinite(torch.tensor(r[key])) for r in rows), key

    # A new trainer process resumes from the newest checkpoint and takes step 3.
    resumed = trainer_spec(tmp_path, ep, "trainer-2", num_steps=3)
    resumed.params["resume"] = True
    resumed.params["publish"]["final_pullers"] = []  # nobody subscribes this time
    TrainerActorConfig.model_validate(resumed.params)  # still a valid config
    await supervisor.launch([resumed])
    async with asyncio.timeout(180):
        await produce_until(supervisor, ep, "trainer-2")
        stats = (await supervisor.control.command("buffer", Command(kind="stats"))).data
    assert stats["buffer.version"] == 3 and stats["buffer.consumed"] == 3 * B
    rows = (tmp_path / "trainer-2.metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [3]
    assert (tmp_path / "ckpt" / "step_000003" / "trainer.json").exists()


def test_a_restart_loads_its_own_jobs_newest_checkpoint_and_pruning_keeps_its_newest(tmp_path):
    from asyncrl.actors.trainer import _newest_checkpoint, _prune_checkpoints, _save_atomically

    class Saver:
        def __init__(self) -> None:
            self.saves = 0

        def save_checkpoint(self, path: Path) -> None:
            path.mkdir(parents=True)
            self.saves += 1

    saver = Saver()
    for step, job in [(5, "old-job"), (10, "this"), (20, "this"), (30, "old-job")]:
        _save_atomically(saver.save_checkpoint, tmp_path / f"step_{step:06d}", job)
    (tmp_path / "step_000040.tmp").mkdir()  # a save that was cut off
    (tmp_path / "step_50").mkdir()  # not a name asyncrl writes: never read, never pruned
    assert _newest_checkpoint(str(tmp_path)).name == "step_000030"
    assert _newest_checkpoint(str(tmp_path), job="this").name == "step_000020"
    _save_atomically(saver.save_checkpoint, tmp_path / "step_000020", "this")  # kept as is
    assert saver.saves == 4
    # The old job's step 30 is newer, yet neither counts nor goes: pruning it in, this
    # job's newest checkpoint would be removed as soon as it was written. Its step 5,
    # below this job's first, is this run's past: counted, so resumes do not pile up.
    _prune_checkpoints(tmp_path, keep=2, job="this")
    names = ["step_000010", "step_000020", "step_000030", "step_000040.tmp", "step_50"]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == names
    _prune_checkpoints(tmp_path, keep=1, job="this")
    assert sorted(p.name for p in tmp_path.glob("step_*")) == names[1:]
    _prune_checkpoints(tmp_path, keep=1)  # no job: the newest of all
    assert sorted(p.name for p in tmp_path.glob("step_*")) == names[2:]


class SlowTrainer:
    """A trainer whose step takes 0.5 s and which records the order of its calls."""

    def __init__(self) -> None:
        self.version = 0
        self.calls: list[str] = []
        self.stepping = threading.Event()

    def train_step(self, batch: TrainBatch) -> StepResult:
        self.calls.append("step begins")
        self.stepping.set()
        time.sleep(0.5)
        self.version += 1
        self.calls.append("step ends")
        return StepResult(self.version)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return {}

    def save_checkpoint(self, path: Path) -> None:
        self.calls.append(f"checkpoint of version {self.version}")
        path.mkdir(parents=True)


class OneBatch:
    """One batch, then none (a buffer that waits for more rollouts)."""

    def __init__(self) -> None:
        self.given = False

    async def next(self, version: int, durable: int = -1, last_batch: int = -1) -> BatchReply:
        if self.given:
            await asyncio.sleep(3600)
        self.given = True
        return BatchReply(TrainBatch(batch_id=0, step=0, groups=[]))

    def done(self, batch_id: int) -> None: ...

    async def close(self, version: int, durable: int = -1) -> None: ...


class NoSubscribers:
    transport = "pull"

    def __init__(self) -> None:
        self.published: list[int] = []

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.published.append(version)

    async def wait_fetched(self, want: list[str]) -> None: ...


async def test_a_stop_during_a_step_checkpoints_after_the_step(tmp_path):
    # A stop drains (a checkpoint) while run() is still inside a step in its worker thread:
    # the checkpoint must wait for the step, or it would hold half of one.
    params = trainer_config(checkpoint_dir=str(tmp_path / "ckpt")).model_dump(mode="json")
    actor = TrainerActor(ActorSpec(name="trainer", role="trainer", cls="", params=params))
    trainer, weights = SlowTrainer(), NoSubscribers()
    actor.trainer, actor.batches, actor.weights = trainer, OneBatch(), weights  # type: ignore[assignment]
    actor.durable, actor.num_steps, actor.audit, actor.dump = -1, 0, None, None
    actor.metrics = actor.open_metrics(tmp_path / "metrics.jsonl", flush_every=0)
    running = asyncio.create_task(actor._run_until_stopped())
    await asyncio.to_thread(trainer.stepping.wait, 10)
    actor.request_stop("test")
    await running
    assert trainer.calls == ["step begins", "step ends", "checkpoint of version 1"]
    assert (tmp_path / "ckpt" / "step_000001").is_dir()
    # The step's bookkeeping finished before the stop: its version was announced and
    # has its metrics row (the soak once ended with a checkpointed step and no row).
    assert weights.published == [0, 1]
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1]


class Lingering(NoSubscribers):
    """The drain waits 0.5 s for the final pull, as it does for an eval actor."""

    async def wait_fetched(self, want: list[str]) -> None:
        await asyncio.sleep(0.5)


class BatchAfterStop(OneBatch):
    """The batch arrives after a stop was asked for (a long-poll answered during drain)."""

    def __init__(self, actor: TrainerActor) -> None:
        super().__init__()
        self.actor, self.acked = actor, list[int]()

    async def next(self, version: int, durable: int = -1, last_batch: int = -1) -> BatchReply:
        self.actor.request_stop("test")
        await asyncio.sleep(0.1)  # the drain's checkpoint goes first; it lingers after
        return await super().next(version, durable)

    def done(self, batch_id: int) -> None:
        self.acked.append(batch_id)


async def test_a_batch_that_arrives_during_a_stop_is_left_to_the_buffer(tmp_path):
    # Training it would step past the drain's checkpoint; unacknowledged, the buffer keeps
    # it and serves it again to the next trainer, so nothing is lost or trained twice.
    params = trainer_config(checkpoint_dir=str(tmp_path / "ckpt")).model_dump(mode="json")
    actor = TrainerActor(ActorSpec(name="trainer", role="trainer", cls="", params=params))
    trainer, batches = SlowTrainer(), BatchAfterStop(actor)
    actor.trainer, actor.batches, actor.weights = trainer, batches, Lingering()  # type: ignore[assignment]
    actor.durable, actor.num_steps, actor.audit, actor.metrics, actor.dump = -1, 0, None, None, None
    await actor._run_until_stopped()
    assert trainer.calls == ["checkpoint of version 0"] and batches.acked == []


class LateBatch(OneBatch):
    """Two empty replies (the buffer had nothing ready in time), then the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.empty = 2

    async def next(self, version: int, durable: int = -1, last_batch: int = -1) -> BatchReply:
        if self.empty:
            self.empty -= 1
            await asyncio.sleep(0.2)
            return BatchReply(None)
        return await super().next(version, durable)


async def test_the_wait_for_data_counts_every_request_until_the_batch(tmp_path):
    # time/wait_data is the generation phase of a synchronous run (bench/overlap.py's G):
    # the empty replies before the batch are waiting too.
    params = trainer_config().model_dump(mode="json")
    actor = TrainerActor(ActorSpec(name="trainer", role="trainer", cls="", params=params))
    trainer = SlowTrainer()
    actor.trainer, actor.batches, actor.weights = trainer, LateBatch(), NoSubscribers()  # type: ignore[assignment]
    actor.durable, actor.num_steps, actor.audit, actor.metrics, actor.dump = -1, 1, None, None, None
    await actor._run_until_stopped()
    # Two 0.2 s empty replies: counting only the last request would give ~0, only one
    # empty reply ~0.2. The loop's timers may fire a clock tick early, so not ">= 0.4".
    assert trainer.version == 1 and actor._last["time/wait_data"] >= 0.3


class MarkReadingTrainer(SlowTrainer):
    """Reads the trainer's busy mark from inside its step, as an engine would."""

    def __init__(self, mark: Path) -> None:
        super().__init__()
        self.mark, self.seen = mark, []

    def train_step(self, batch: TrainBatch) -> StepResult:
        self.seen.append(self.mark.read_bytes())
        return super().train_step(batch)


async def test_the_trainer_marks_its_steps_busy_and_lends_its_cores_while_it_waits(tmp_path):
    path = tmp_path / "trainer.busy"
    params = trainer_config().model_dump(mode="json")
    spec = ActorSpec(name="trainer", role="trainer", cls="", params=params, busy_mark=str(path))
    actor = TrainerActor(spec)
    actor.mark = BusyMark(path)
    trainer = MarkReadingTrainer(path)
    batches = LateBatch()
    actor.trainer, actor.batches, actor.weights = trainer, batches, NoSubscribers()  # type: ignore[assignment]
    actor.durable, actor.num_steps, actor.audit, actor.metrics, actor.dump = -1, 1, None, None, None
    assert path.read_bytes() == b"\x00"  # waiting for the first batch: the cores are lent
    await actor._run_until_stopped()
    assert trainer.seen == [b"\x01"] and path.read_bytes() == b"\x00"


class Batches(OneBatch):
    """``n`` batches, then none."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    async def next(self, version: int, durable: int = -1, last_batch: int = -1) -> BatchReply:
        self.left -= 1
        self.given = self.left < 0
        return await super().next(version, durable)


class SkipsOdd(SlowTrainer):
    """Skips the odd batches (no group to learn from: the version stays), trains the even
    ones; its checkpoints hold its version."""

    def train_step(self, batch: TrainBatch) -> StepResult:
        if batch.batch_id % 2:
            raise UntrainableBatch("every group's advantage is zero")
        return super().train_step(batch)

    def save_checkpoint(self, path: Path) -> None:
        super().save_checkpoint(path)
        (path / "version").write_text(str(self.version))

    def load_checkpoint(self, path: Path) -> None:
        self.version = int((path / "version").read_text())


class Numbered(Batches):
    """Batches 1..n, then none; records the ``last_batch`` each request reports."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.ids, self.reported = iter(range(1, n + 1)), list[int]()

    async def next(self, version: int, durable: int = -1, last_batch: int = -1) -> BatchReply:
        self.reported.append(last_batch)
        await super().next(version, durable)  # waits for good after the n-th
        return BatchReply(TrainBatch(batch_id=next(self.ids), step=version, groups=[]))


async def test_a_checkpoint_records_the_batch_that_made_its_version(tmp_path):
    """A skipped batch makes no version, so a version undercounts the batches behind it;
    the batch that made it is what the buffer checks a resync against (a buffer state
    that lost records would otherwise pass, and serve consumed groups again). A skip
    after it is not counted: the buffer serves it again to a restart from this version,
    however often, and it is skipped again."""
    ckpt = tmp_path / "ckpt"
    params = trainer_config(checkpoint_dir=str(ckpt), job="job-1")
    spec = ActorSpec(name="trainer", role="trainer", cls="", params=params.model_dump(mode="json"))
    actor, batches = TrainerActor(spec), Numbered(3)
    actor.trainer, actor.batches, actor.weights = SkipsOdd(), batches, NoSubscribers()  # type: ignore[assignment]
    actor.durable, actor.num_steps, actor.audit, actor.metrics, actor.dump = -1, 0, None, None, None
    running = asyncio.create_task(actor._run_until_stopped())
    await until(lambda: len(batches.reported) == 4)  # 1 skipped, 2 trained, 3 skipped
    actor.request_stop("test")
    await running
    assert batches.reported == [0, 0, 2, 2] and actor.skipped == 2
    step = ckpt / "step_000001"  # the stop's checkpoint, after the skip of batch 3
    assert (step / "version").read_text() == "1" and (step / "last_batch").read_text() == "2\n"
    resumed = TrainerActor(
        ActorSpec(
            name="trainer",
            role="trainer",
            cls="",
            params=trainer_config(resume_from=str(step)).model_dump(mode="json"),
        )
    )
    resumed.trainer = SkipsOdd()  # type: ignore[assignment]
    resumed._resume()
    assert (resumed.trainer.version, resumed.last_batch) == (1, 2)
    (step / "last_batch").write_text("2\x00\x00")  # damaged: refused, not read as unknown
    with pytest.raises(CheckpointUnreadable, match=r"last_batch.*not a batch id"):
        resumed._resume()
    (step / "last_batch").unlink()  # written before it was recorded: unknown
    resumed._resume()
    assert resumed.last_batch == -1


class CopyingTrainer(SlowTrainer):
    """A ``SlowTrainer`` whose checkpoints are copied aside: each copy holds the version
    it was taken at and is written when ``release`` is set (or fails with ``error``)."""

    def __init__(self, error: Exception | None = None) -> None:
        super().__init__()
        self.release, self.error = threading.Event(), error
        self.copy_done = threading.Event()  # the copy itself takes until this is set
        self.copy_done.set()

    def snapshot_checkpoint(self):
        version = self.version
        self.calls.append(f"copy of version {version}")
        assert self.copy_done.wait(30)

        def write(path: Path) -> None:
            assert self.release.wait(30)
            if self.error is not None:
                raise self.error
            path.mkdir(parents=True)
            (path / "version").write_text(str(version))
            self.calls.append(f"copy of version {version} written")

        return write


def background_actor(
    tmp_path: Path, trainer: SlowTrainer, batches: OneBatch, interval: int = 1
) -> TrainerActor:
    params = trainer_config(
        checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval=interval, async_save=True
    )
    spec = ActorSpec(name="trainer", role="trainer", cls="", params=params.model_dump(mode="json"))
    actor = TrainerActor(spec)
    actor.trainer, actor.batches, actor.weights = trainer, batches, NoSubscribers()  # type: ignore[assignment]
    actor.durable, actor.num_steps, actor.audit, actor.metrics, actor.dump = 0, 0, None, None, None
    return actor


async def test_a_checkpoint_is_written_while_the_next_step_trains_and_durable_waits_for_it(
    tmp_path,
):
    trainer = CopyingTrainer()
    actor = background_actor(tmp_path, trainer, Batches(2))
    running = asyncio.create_task(actor._run_until_stopped())
    await until(lambda: trainer.calls.count("step ends") == 2)  # step 1's copy unwritten
    assert trainer.calls[:4] == ["step begins", "step ends", "copy of version 1", "step begins"]
    assert actor.durable == 0 and not (tmp_path / "ckpt" / "step_000001").exists()
    trainer.release.set()
    await until(lambda: actor.durable == 2)
    assert (tmp_path / "ckpt" / "step_000002" / "version").read_text() == "2"
    assert (tmp_path / "ckpt" / "step_000001" / "version").read_text() == "1"
    actor.request_stop("test")
    await running
    # The stop's checkpoint came after both copies were written, in order.
    written = [c for c in trainer.calls if "written" in c or c.startswith("checkpoint")]
    assert written == ["copy of version 1 written", "copy of version 2 written",
                       "checkpoint of version 2"]  # fmt: skip


async def test_waiting_for_a_background_write_lends_the_cores(tmp_path):
    """The next checkpoint waits for the write under way unmarked: the writer's I/O
    computes nothing of the trainer's, so the engines keep the cores meanwhile."""
    trainer = CopyingTrainer()
    trainer.version = 1
    actor = background_actor(tmp_path, trainer, OneBatch())
    actor.mark = BusyMark(tmp_path / "trainer.busy")
    await actor._checkpoint(background=True)  # its write waits for release
    trainer.version = 2
    second = asyncio.create_task(actor._checkpoint(background=True))
    await asyncio.sleep(0.3)
    assert not second.done() and actor.mark.path.read_bytes() == b"\x00"
    trainer.release.set()
    await second
    await actor._settle_write()
    assert actor.durable == 2 and trainer.calls[-1] == "copy of version 2 written"


async def test_a_failed_background_write_fails_the_trainer_and_is_never_durable(tmp_path):
    trainer = CopyingTrainer(error=OSError(28, "No space left on device"))
    trainer.release.set()
    # Step 2's write fails while step 3 trains; step 3 takes no checkpoint, so only the
    # check after each step finds it (else the trainer would wait for a 4th batch).
    actor = background_actor(tmp_path, trainer, Batches(3), interval=2)
    with pytest.raises(ExceptionGroup) as caught:
        async with asyncio.timeout(60):
            await actor._run_until_stopped()
    assert caught.group_contains(OSError, match="No space left")
    assert actor.durable == 0 and not list((tmp_path / "ckpt").glob("step_*[0-9]"))
    assert trainer.calls.count("step ends") == 3


async def test_a_cancelled_wait_leaves_the_write_under_way_and_no_save_starts_beside_it(tmp_path):
    trainer = CopyingTrainer()
    trainer.version = 1
    actor = background_actor(tmp_path, trainer, OneBatch())
    await actor._checkpoint(background=True)  # the copy's write waits for release
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(actor._settle_write(), 0.1)  # a drain's timeout, say
    again = asyncio.create_task(actor._checkpoint())  # the same version, in the step
    await asyncio.sleep(0.2)
    assert not again.done() and "checkpoint of version 1" not in trainer.calls
    trainer.release.set()
    await again
    assert trainer.calls[-2:] == ["copy of version 1 written", "checkpoint of version 1"]
    assert actor.durable == 1


async def test_a_checkpoint_asked_for_while_a_copy_is_taken_waits_for_its_write(tmp_path):
    # The checkpoint command finds no write under way, then waits for the trainer: by the
    # time it has it, the copy's write has begun, and both would write step_000001.
    trainer = CopyingTrainer()
    trainer.version = 1
    trainer.copy_done.clear()  # the interval checkpoint's copy takes until set
    actor = background_actor(tmp_path, trainer, OneBatch())
    interval = asyncio.create_task(actor._checkpoint(background=True))
    await until(lambda: "copy of version 1" in trainer.calls)
    command = asyncio.create_task(actor._checkpoint())
    await asyncio.sleep(0.1)
    trainer.copy_done.set()
    await interval
    await asyncio.sleep(0.2)
    assert not command.done() and "checkpoint of version 1" not in trainer.calls
    trainer.release.set()
    await command
    assert trainer.calls[-2:] == ["copy of version 1 written", "checkpoint of version 1"]
