"""Held-out evaluation: pass@k over prompts, failures counted wrong, breakdowns, config
checks, the eval actor's lower priority; and the per-process limits of every actor
(threads, open files)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import resource
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from asyncrl.actors.base import ActorSpec
from asyncrl.actors.config import EvalActorConfig
from asyncrl.actors.eval import EvalActor, scored_versions
from asyncrl.engines.base import FinishReason
from asyncrl.engines.config import EngineConfig
from asyncrl.engines.sglang_wire import GenerateResult
from asyncrl.rollout.base import RolloutContext
from asyncrl.rollout.config import EvalConfig, EvalSetConfig, RewardConfig
from asyncrl.rollout.evaluation import evaluate_set, score_samples
from asyncrl.rollout.rewards import build_reward
from asyncrl.rollout.single_turn import single_turn
from asyncrl.types import Prompt, Sample, SampleStatus
from asyncrl.wire.messages import WeightVersion


def prompt(i: int, label: str, kind: str) -> Prompt:
    return Prompt(uid=f"p{i}", prompt_id=f"set:{i}", prompt=f"q{i}", label=label,
                  metadata={"kind": kind})  # fmt: skip


def samples_with(hits: list[int], n: int) -> list[Sample]:
    """``n`` samples for each prompt, the first ``hits[i]`` of prompt i scoring 1."""
    out = []
    for i, c in enumerate(hits):
        p = prompt(i, "x", "a" if i % 2 == 0 else "b")
        for j in range(n):
            s = Sample.for_prompt(p, group_id=f"g{i}", index=j, version=0)
            s.status, s.reward = SampleStatus.COMPLETED, 1.0 if j < c else 0.0
            out.append(s)
    return out


def test_pass_at_k_is_the_mean_of_the_unbiased_estimator_over_prompts():
    cfg = EvalSetConfig(name="t", path="x.jsonl", n_samples=4, pass_k=[2, 4], group_by="kind")
    m = score_samples(samples_with([0, 1, 2, 4], 4), cfg, correct=1.0)
    # pass@1 = c/n per prompt; pass@2 = 1 - C(n-c,2)/C(4,2): 0, 1/2, 5/6, 1.
    assert m["pass@1"] == pytest.approx((0 + 0.25 + 0.5 + 1) / 4)
    assert m["pass@2"] == pytest.approx((0 + 0.5 + 5 / 6 + 1) / 4)
    assert m["pass@4"] == pytest.approx(3 / 4)
    assert m["reward"] == pytest.approx(7 / 16)
    assert m["pass@1/a"] == pytest.approx((0 + 0.5) / 2)  # prompts 0 and 2
    assert m["pass@1/b"] == pytest.approx((0.25 + 1) / 2)
    assert (m["prompts"], m["samples"], m["failed"]) == (4, 16, 0)


def test_failed_samples_count_as_wrong_and_are_reported():
    cfg = EvalSetConfig(name="t", path="x.jsonl", n_samples=2)
    samples = samples_with([2, 2], 2)
    samples[0].status, samples[0].reward = SampleStatus.FAILED, None
    m = score_samples(samples, cfg, correct=1.0)
    assert m["failed"] == 1 and m["pass@1"] == pytest.approx(0.75)


class ScriptedGenerator:
    """Answers prompt ``qi`` with ``answers[i]`` (ids are the bytes); raises for ``boom``."""

    def __init__(self, answers: dict[int, str]) -> None:
        self.answers = answers
        self.calls = 0

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        rid: str | None = None,
    ) -> GenerateResult:
        self.calls += 1
        text = self.answers[int(bytes(input_ids).decode()[1:])]
        if text == "boom":
            raise ConnectionError("engine went away")
        ids = list(text.encode())
        return GenerateResult(rid=rid or "", output_ids=ids, logprobs=[-0.1] * len(ids),
                              versions=[7] * len(ids), finish_reason=FinishReason(type="stop"),
                              text=text)  # fmt: skip


async def test_evaluate_set_runs_the_workflow_n_times_per_prompt_with_the_real_reward():
    prompts = []
    for i, label in enumerate(["4", "9", "1"]):
        p = prompt(i, label, "k")
        # Token ids are the bytes of the text, as the scripted generator reads them.
        p.packed_prompt = np.frombuffer(f"q{i}".encode(), np.uint8).astype(np.int32).tobytes()
        prompts.append(p)
    gen = ScriptedGenerator({0: " #### 4", 1: " #### 8", 2: "boom"})
    score = build_reward(RewardConfig(type="exact"))
    ctx = RolloutContext(engine=gen, score=score, sampling={"max_new_tokens": 16})
    cfg = EvalSetConfig(name="t", path="x.jsonl", n_samples=2, pass_k=[2])
    m = await evaluate_set(ctx, single_turn, prompts, cfg, correct=1.0, max_concurrency=2)
    await score.aclose()
    assert gen.calls == 6
    assert m["pass@1"] == pytest.approx(1 / 3) and m["pass@2"] == pytest.approx(1 / 3)
    assert m["failed"] == 2  # the raising engine call failed those samples, not the eval
    assert m["response_len"] == pytest.approx((7 + 7) * 2 / 6)
    assert m["seconds"] >= 0 and not math.isnan(m["reward"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval": 5}, "eval.sets is empty"),
        ({"interval": 5, "sets": [{"name": "a", "path": "x"}] * 2}, "must be unique"),
        ({"sets": [{"name": "a", "path": "x", "n_samples": 2, "pass_k": [4]}]}, "k=\\[4\\]"),
        ({"sets": [{"name": "a", "path": "x", "sampling": {"top_p": 2}}]}, "sampling"),
    ],
)
def test_eval_configs_that_cannot_work_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EvalConfig(**kwargs)


def test_an_actor_process_gets_the_thread_limit_of_its_spec():
    code = (
        "from asyncrl.runtime.child import limit_threads; import os, torch;"
        "limit_threads(1); print(os.environ['OMP_NUM_THREADS'], torch.get_num_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.split() == ["1", "1"], out.stderr
    # Idle OpenMP threads sleep instead of spinning on a core, unless the user says otherwise.
    code = code.replace("torch.get_num_threads()", "os.environ['OMP_WAIT_POLICY']")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.split() == ["1", "PASSIVE"], out.stderr
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.split() == ["1", "ACTIVE"], out.stderr


def test_the_trainer_alone_gets_runtime_trainer_threads(tmp_path):
    from asyncrl.config import load_config
    from asyncrl.job import job_actor_specs
    from asyncrl.runtime.topology import allocate_endpoints

    flags = ["--runtime.threads", "1", "--runtime.trainer-threads", "2"]
    cfg = load_config("examples/arith/config.yaml", overrides=flags)
    specs = job_actor_specs(cfg, allocate_endpoints(), tmp_path, resume=False)
    threads = {s.role: s.threads for s in specs}
    assert threads == {"buffer": 1, "rollout": 1, "trainer": 2, "eval": 1}


def test_an_actor_process_lifts_its_soft_open_file_limit_to_the_hard_one():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard <= 256:
        pytest.skip(f"hard open-file limit {hard}: nothing to lift")
    code = (
        "import resource; from asyncrl.runtime.child import raise_open_file_limit;"
        "before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]; raise_open_file_limit();"
        "print(before, *resource.getrlimit(resource.RLIMIT_NOFILE))"
    )

    def lowered() -> None:  # as a login shell's usual soft limit of 1,024 would be
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         preexec_fn=lowered)  # fmt: skip
    assert out.stdout.split() == ["256", str(hard), str(hard)], out.stderr


def test_the_eval_actor_lowers_the_priority_of_every_thread_and_those_it_starts_later():
    code = (
        "import os, threading, time\n"
        "from asyncrl.actors.eval import lower_priority\n"
        "stop = threading.Event()\n"
        "early = threading.Thread(target=stop.wait); early.start(); time.sleep(0.05)\n"
        "base = os.getpriority(os.PRIO_PROCESS, 0)\n"
        "lower_priority(3)\n"
        "late = []\n"
        "t = threading.Thread(target=lambda: late.append(os.getpriority(os.PRIO_PROCESS, 0)))\n"
        "t.start(); t.join()\n"
        "print(base, os.getpriority(os.PRIO_PROCESS, 0), "
        "os.getpriority(os.PRIO_PROCESS, early.native_id), late[0])\n"
        "stop.set()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    base, main, early, late = map(int, out.stdout.split())
    want = min(19, base + 3)
    assert (main, early, late) == (want, want, want), out.stderr
    assert EvalConfig().nice == 10  # the default: evaluation takes the cores training leaves


async def test_an_eval_actor_that_missed_the_final_pull_evaluates_the_final_checkpoint(
    tmp_path,
):
    """The trainer exits once the final version is pulled; an eval incarnation that comes
    up after that (a restart) falls back to the final checkpoint, or ends without it."""
    final = tmp_path / "step_000004" / "policy"
    config = EvalActorConfig(
        engine=EngineConfig(model_path="unused"),
        sampling={},
        reward=RewardConfig(),
        eval=EvalConfig(sets=[EvalSetConfig(name="held-out", path="unused.jsonl")]),
        num_steps=4,
        metrics_path="unused.jsonl",
        final_checkpoint=str(final),
    )
    spec = ActorSpec(name="eval", role="eval", cls="x:y", params=config.model_dump(mode="json"))

    def fresh() -> EvalActor:
        actor = EvalActor(spec)
        actor.num_steps, actor._pending, actor._final_lost = 4, None, False
        actor._ready, actor._final_due = asyncio.Event(), asyncio.Event()
        return actor

    gone = fresh()
    gone._final_from_disk(4)  # no checkpoint: the eval ends without the final version
    assert gone._final_lost and gone._pending is None and gone._ready.is_set()
    final.mkdir(parents=True)
    saved = fresh()
    saved._final_from_disk(4)
    assert not saved._final_lost and saved._ready.is_set()
    assert saved._pending is not None
    msg, tensors = saved._pending
    assert (msg.version, msg.transport, msg.location, tensors) == (4, "disk", str(final), None)


async def test_the_final_version_cancels_an_intermediate_eval_but_a_lost_one_does_not():
    """Training ended while an old version was being scored (a restarted eval actor): the
    job waits on the final version, so that eval is cancelled. When the final version is
    lost instead, the running eval is the last one there is and finishes. Version 0's,
    the baseline, always finishes, and the final version is scored after it."""
    config = EvalActorConfig(
        engine=EngineConfig(model_path="unused"), sampling={}, reward=RewardConfig(),
        eval=EvalConfig(interval=2, sets=[EvalSetConfig(name="held", path="unused.jsonl")]),
        num_steps=4, metrics_path="unused.jsonl",
    )  # fmt: skip
    spec = ActorSpec(name="eval", role="eval", cls="x:y", params=config.model_dump(mode="json"))

    async def scored(final_arrives: bool, slow: int = 2) -> tuple[list[int], int]:
        actor = EvalActor(spec)
        actor.cfg, actor.num_steps, actor.next_due = config.eval, 4, 0
        actor._pending, actor._final_lost = None, False
        actor._ready, actor._final_due = asyncio.Event(), asyncio.Event()

        async def load_tensors(tensors: dict, version: int) -> None:
            pass

        actor.host = type("Host", (), {"engine": None, "load_tensors": staticmethod(load_tensors)})
        started, finished, release = asyncio.Event(), [], asyncio.Event()

        async def evaluate(version: int, sets: list | None = None) -> None:
            started.set()
            if version == slow:
                await release.wait()  # never released when the final version arrives
            finished.append(version)

        actor._evaluate = evaluate
        loop = asyncio.create_task(actor._evaluate_loop())
        actor._offer(WeightVersion(version=slow, transport="pull", location=""), {})
        await asyncio.wait_for(started.wait(), 5)
        if final_arrives:
            actor._offer(WeightVersion(version=4, transport="pull", location=""), {})
            if slow == 0:
                await asyncio.sleep(0.05)
                assert not loop.done()  # the final version waits for the baseline
                release.set()
        else:
            actor._final_from_disk(4)  # no checkpoint: the final version is lost
            await asyncio.sleep(0.05)
            assert not loop.done()
            release.set()
        await asyncio.wait_for(loop, 5)
        return finished, actor.preempted

    assert await scored(final_arrives=True) == ([4], 1)
    assert await scored(final_arrives=False) == ([2], 0)
    assert await scored(final_arrives=True, slow=0) == ([0, 4], 0)


async def test_the_baseline_is_scored_from_the_initial_weights_when_its_announcement_is_missed(
    tmp_path,
):
    """A fast trainer publishes version 1 before the eval actor subscribes: the receiver
    hands over the newest announcement, so version 0's is never seen. The baseline is the
    engine's initial weights, scored at once; a job whose file already has it (a resume)
    does not score it again."""
    metrics = tmp_path / "eval.jsonl"
    config = EvalActorConfig(
        engine=EngineConfig(model_path="unused"), sampling={}, reward=RewardConfig(),
        eval=EvalConfig(interval=2, sets=[EvalSetConfig(name="held", path="unused.jsonl")]),
        num_steps=2, metrics_path=str(metrics), baseline_from_engine=True,
    )  # fmt: skip
    spec = ActorSpec(name="eval", role="eval", cls="x:y", params=config.model_dump(mode="json"))
    announced = [WeightVersion(version=v, transport="pull", location="") for v in (1, 2)]

    class Receiver:
        async def next_version(self, after: int = -1) -> WeightVersion:
            if not announced:
                await asyncio.Event().wait()
            return announced.pop(0)

        async def fetch(self, msg: WeightVersion) -> dict:
            fetched.append(msg.version)
            return {}

    fetched: list[int] = []

    async def scored(at_start: bool = True) -> list[int]:
        actor = EvalActor(spec)
        actor.cfg = config.eval.model_copy(update={"at_start": at_start})
        actor.num_steps, actor.next_due = 2, 0 if at_start else 2
        actor._pending, actor._final_lost = None, False
        actor._ready, actor._final_due = asyncio.Event(), asyncio.Event()
        actor.sets = [type("Set", (), {"cfg": config.eval.sets[0]})]
        actor.receiver = Receiver()

        async def load_tensors(tensors: dict, version: int) -> None:
            pass

        actor.host = type("Host", (), {"engine": object(), "version": 0,
                                       "load_tensors": staticmethod(load_tensors)})  # fmt: skip
        actor._schedule_from(scored_versions(metrics))
        finished: list[int] = []

        async def evaluate(version: int, sets: list | None = None) -> None:
            finished.append(version)
            with metrics.open("a") as f:
                f.write(json.dumps({"version": version, "set": "held", "pass@1": 0.1}) + "\n")

        actor._evaluate = evaluate
        await asyncio.wait_for(actor.run(), 5)
        announced[:] = [WeightVersion(version=v, transport="pull", location="") for v in (1, 2)]
        return finished

    assert await scored() == [0, 2]  # version 1 is not due: the interval is 2
    # A finished job resumed: version 2 is pulled (its trainer waits for that before it
    # exits) and not scored again.
    assert await scored() == [] and fetched == [2, 2]
    rows = metrics.read_text().splitlines()
    metrics.write_text(rows[0] + "\n")  # the job stopped before its final version
    assert await scored() == [2]  # resumed: version 0 is in the file already
    metrics.unlink()
    assert await scored(at_start=False) == [2]


def test_a_restarted_eval_actor_starts_past_the_scored_versions_and_scores_missing_sets(
    tmp_path,
):
    """Its schedule resumes from the job's rows: the next due version after the newest
    scored one, and version 0 only for the sets without it. A damaged file costs
    rescoring, never the setup: the rows that do not parse are skipped."""
    metrics = tmp_path / "eval.jsonl"
    rows = [{"version": 0, "set": "a"}, {"version": 3, "set": "a"}, {"version": 3, "set": "b"},
            {"version": False, "set": "b"}, {"version": 0, "set": ["b"]}, [0, "b"]]  # fmt: skip
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"version": 0, "se\n\n')
    assert scored_versions(metrics) == {0: {"a"}, 3: {"a", "b"}}
    assert scored_versions(tmp_path / "none.jsonl") == {}
    sets = [EvalSetConfig(name=n, path="unused.jsonl") for n in ("a", "b")]
    config = EvalActorConfig(
        engine=EngineConfig(model_path="unused"), sampling={}, reward=RewardConfig(),
        eval=EvalConfig(interval=2, sets=sets), num_steps=10, metrics_path=str(metrics),
        baseline_from_engine=True,
    )  # fmt: skip
    spec = ActorSpec(name="eval", role="eval", cls="x:y", params=config.model_dump(mode="json"))

    def schedule(engine: object | None, from_engine: bool = True) -> tuple[list[str], int]:
        actor = EvalActor(spec)
        actor.cfg, actor.next_due = config.eval, 0
        actor.config = config.model_copy(update={"baseline_from_engine": from_engine})
        actor.sets = [type("Set", (), {"cfg": s}) for s in sets]
        actor.host = type("Host", (), {"engine": engine, "version": 0})
        actor._schedule_from(scored_versions(metrics))
        return [s.cfg.name for s in actor.baseline], actor.next_due

    assert schedule(object()) == (["b"], 4)
    assert schedule(None) == ([], 4)  # a remote engine: version 0 from its announcement
    assert schedule(object(), from_engine=False) == ([], 4)  # another model than the trainer's


async def test_an_eval_actor_restarted_after_its_final_rows_scores_only_what_they_lack(tmp_path):
    """An incarnation that died after writing the final version's rows (its Bye lost, a
    kill as it exited) is restarted and told to score the final checkpoint: it ends at
    once, and one that died between two sets scores only the set left."""
    metrics = tmp_path / "eval.jsonl"
    sets = [EvalSetConfig(name=n, path="unused.jsonl") for n in ("a", "b")]
    config = EvalActorConfig(
        engine=EngineConfig(model_path="unused"), sampling={}, reward=RewardConfig(),
        eval=EvalConfig(interval=4, sets=sets), num_steps=4, metrics_path=str(metrics),
    )  # fmt: skip
    spec = ActorSpec(name="eval", role="eval", cls="x:y", params=config.model_dump(mode="json"))

    async def restarted(rows: list[tuple[int, str]]) -> list[tuple[int, list[str]]]:
        metrics.write_text("".join(json.dumps({"version": v, "set": n}) + "\n" for v, n in rows))
        actor = EvalActor(spec)
        actor.cfg, actor.num_steps, actor.next_due = config.eval, 4, 4
        actor._pending, actor._final_lost = None, False
        actor._ready, actor._final_due = asyncio.Event(), asyncio.Event()
        actor.sets = [type("Set", (), {"cfg": s}) for s in sets]

        async def load(msg: WeightVersion, receiver: object) -> bool:
            return True

        actor.host = type("Host", (), {"engine": None, "version": 0, "load": staticmethod(load)})

        async def next_version(after: int = -1) -> WeightVersion:
            await asyncio.Event().wait()  # the trainer has exited: nothing is announced

        actor.receiver = type("Receiver", (), {"next_version": staticmethod(next_version)})
        actor._schedule_from(scored_versions(metrics))
        scored: list[tuple[int, list[str]]] = []

        async def evaluate(version: int, only: list | None = None) -> None:
            scored.append((version, [s.cfg.name for s in only or actor.sets]))

        actor._evaluate = evaluate
        actor._queue_final(4, str(tmp_path))  # as the controller's feed_final does
        await asyncio.wait_for(actor.run(), 5)
        return scored

    assert await restarted([(0, "a"), (0, "b"), (4, "a"), (4, "b")]) == []
    assert await restarted([(0, "a"), (0, "b"), (4, "a")]) == [(4, ["b"])]
    assert await restarted([(0, "a"), (0, "b")]) == [(4, ["a", "b"])]
