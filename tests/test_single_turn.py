"""``single_turn`` against the real embedded engine behind the real HTTP server.

The tiny Qwen2 is served by ``EngineServer`` on 127.0.0.1 (weights at version 3) and
reached through ``SGLangClient``, as a rollout actor reaches it; rewards come from the
real hub. Greedy decoding makes every generation reproducible, so a resumed sample can
be compared token by token with an uninterrupted one. Two edge cases (a character split
by an abort, an engine without log-probs) use a scripted generator instead. Workflow
loading by dotted path is at the end.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from asyncrl.engines.base import FinishReason
from asyncrl.engines.client.sglang import GenerateResult, SGLangClient
from asyncrl.engines.server.app import EngineServer
from asyncrl.engines.sglang_wire import sampling_dict
from asyncrl.engines.torch.engine import TorchEngine
from asyncrl.rollout.base import Generator, RolloutContext, end_ids
from asyncrl.rollout.rewards import RewardConfig, RewardError, build_reward
from asyncrl.rollout.single_turn import single_turn
from asyncrl.rollout.workflows import load_workflow
from asyncrl.types import Sample, SampleStatus, pack_int32
from tests.tiny_model import build_tiny_model

pytestmark = pytest.mark.asyncio(loop_scope="module")

VERSION = 3
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 96, "ignore_eos": True}
PROMPT = [58, 271, 269, 310, 224, 14, 306, 34]


def text_reward(sample: Sample) -> dict[str, float]:
    """A custom reward by path: 1 for any text, and its length."""
    return {"score": 1.0, "chars": float(len(sample.response_text))}


def failing_reward(sample: Sample) -> float:
    raise ValueError("judge unavailable")


async def custom_workflow(ctx: RolloutContext, sample: Sample) -> Sample:
    return sample


def sync_workflow(ctx: RolloutContext, sample: Sample) -> Sample:
    return sample


@dataclass
class Recording:
    """Passes calls to the real engine and keeps what each one asked for."""

    engine: Generator
    calls: list[tuple[list[int], dict[str, Any], str | None]] = field(default_factory=list)

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        rid: str | None = None,
    ) -> GenerateResult:
        self.calls.append((list(input_ids), sampling_dict(sampling_params), rid))
        return await self.engine.generate(input_ids, sampling_params, rid=rid)


@dataclass
class Scripted:
    """Answers each call with the next scripted result."""

    results: list[GenerateResult]

    async def generate(self, input_ids: Any, sampling_params: Any = None, *, rid: Any = None):
        return self.results.pop(0)


# ------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    build_tiny_model(directory)
    return directory


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir: Path) -> AsyncIterator[tuple[str, TorchEngine]]:
    torch_engine = TorchEngine.from_pretrained(str(model_dir), version=VERSION)
    server = EngineServer(torch_engine)
    yield await server.start("127.0.0.1", 0), torch_engine
    await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(engine: tuple[str, TorchEngine]) -> AsyncIterator[SGLangClient]:
    async with SGLangClient(engine[0]) as c:
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(client: SGLangClient) -> GenerateResult:
    """The uninterrupted greedy response of ``PROMPT`` (8 tokens)."""
    return await client.generate(PROMPT, GREEDY)


def context(engine: Generator, tokenizer: Any, sampling: dict[str, Any], **reward: Any) -> Any:
    """A rollout context over ``engine``; the reward is ``text_reward`` unless given."""
    reward = reward or {"type": "custom", "path": "tests.test_single_turn:text_reward"}
    score = build_reward(RewardConfig(**reward))
    return RolloutContext(engine=engine, score=score, sampling=sampling, tokenizer=tokenizer)


def fresh(uid: str = "g/0") -> Sample:
    return Sample(uid=uid, group_id="g", packed_prompt=pack_int32(PROMPT), label="x")


def assert_aligned(sample: Sample) -> None:
    n = sample.response_length
    assert len(sample.logprobs) == len(sample.token_versions) == len(sample.loss_mask) == n


async def wait_generated(torch_engine: TorchEngine, total: int) -> None:
    """Until the engine has sampled ``total`` tokens since it started."""
    for _ in range(2000):
        if torch_engine.stats["generated_tokens"] >= total:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the engine sampled fewer than {total} tokens")


# ------------------------------------------------------------------------ the real engine


async def test_a_fresh_sample_stops_with_aligned_columns_and_a_reward(client, engine, reference):
    tokenizer = engine[1].tokenizer
    ids = reference.output_ids
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # a first occurrence
    recording = Recording(client)
    ctx = context(recording, tokenizer, {**GREEDY, "stop_token_ids": [ids[k]]})
    sample = await single_turn(ctx, fresh())
    assert sample.status is SampleStatus.COMPLETED and sample.finish_reason == "stop"
    assert sample.response_tokens.tolist() == ids[: k + 1]  # the stop token is kept
    assert_aligned(sample)
    assert sample.logprobs.tolist() == pytest.approx(reference.logprobs[: k + 1], abs=1e-5)
    assert sample.token_versions.tolist() == [VERSION] * (k + 1)
    assert sample.loss_mask.tolist() == [1] * (k + 1)
    text = tokenizer.decode(ids[: k + 1], skip_special_tokens=True)
    assert sample.response_text == text
    assert sample.reward == {"score": 1.0, "chars": float(len(text))}
    asked = {**sampling_dict(ctx.sampling), "max_new_tokens": 8}
    assert recording.calls == [(PROMPT, asked, "g/0#0#")]


async def test_a_sample_that_uses_its_budget_is_truncated_and_scored(client, engine, reference):
    ctx = context(client, engine[1].tokenizer, GREEDY)
    sample = await single_turn(ctx, fresh())
    assert sample.status is SampleStatus.TRUNCATED and sample.finish_reason == "length"
    assert sample.response_tokens.tolist() == reference.output_ids
    assert_aligned(sample)
    assert sample.reward is not None


async def test_a_partial_sample_resumes_with_the_rest_of_its_budget(client, engine, reference):
    sample = fresh()
    head = reference.output_ids[:3]
    sample.append_response(head, [-0.5, -0.25, -0.125], 1)  # sampled earlier, by version 1
    recording = Recording(client)
    ctx = context(recording, engine[1].tokenizer, GREEDY)
    await single_turn(ctx, sample)
    [(input_ids, params, _)] = recording.calls
    assert input_ids == PROMPT + head and params["max_new_tokens"] == 8 - 3
    assert sample.response_tokens.tolist() == reference.output_ids  # greedy: same tokens
    assert sample.logprobs[:3].tolist() == [-0.5, -0.25, -0.125]
    assert sample.token_versions.tolist() == [1, 1, 1] + [VERSION] * 5
    assert sample.status is SampleStatus.TRUNCATED and sample.reward is not None
    assert sample.response_text == engine[1].tokenizer.decode(reference.output_ids)


async def test_a_sample_whose_budget_is_used_up_is_truncated_without_a_call(client, engine):
    sample = fresh()
    sample.append_response(list(range(10, 18)), [0.0] * 8, 2, text="earlier")
    recording = Recording(client)
    await single_turn(context(recording, engine[1].tokenizer, GREEDY), sample)
    assert recording.calls == []
    assert sample.status is SampleStatus.TRUNCATED and sample.finish_reason == "length"
    assert sample.response_length == 8 and sample.reward == {"score": 1.0, "chars": 7.0}


async def test_an_aborted_sample_keeps_its_partial_tokens_unscored_and_resumes(client, engine):
    torch_engine = engine[1]
    ctx = context(client, torch_engine.tokenizer, LONG)
    sample = fresh("abort/0")
    sample.attempts = 1
    generated = torch_engine.stats["generated_tokens"]
    task = asyncio.create_task(single_turn(ctx, sample))
    await wait_generated(torch_engine, generated + 4)  # mid-generation
    await client.abort("abort/0#1#")
    await task
    assert sample.status is SampleStatus.ABORTED and sample.finish_reason == "abort"
    assert 0 < sample.response_length < 96 and sample.reward is None
    assert_aligned(sample)
    head = sample.response_tokens.tolist()
    sample.attempts = 2  # the actor counts the attempt; the rid changes with it
    await single_turn(ctx, sample)
    assert sample.status is SampleStatus.TRUNCATED and sample.response_length == 96
    assert sample.response_tokens[: len(head)].tolist() == head
    uninterrupted = await client.generate(PROMPT, LONG)
    assert sample.response_tokens.tolist() == uninterrupted.output_ids
    assert sample.reward is not None


async def test_a_group_is_cancelled_by_its_requests_exact_ids(client, engine):
    """SGLang aborts only a live rid: the group prefix itself aborts nothing, and the
    client's group cancel sends each of its calls' own ids (how APRIL cuts a group)."""
    torch_engine = engine[1]
    ctx = context(client, torch_engine.tokenizer, LONG)
    samples = [fresh(f"grp/{i}") for i in range(2)]
    for s in samples:
        s.attempts = 1
    generated = torch_engine.stats["generated_tokens"]
    tasks = [asyncio.create_task(single_turn(ctx, s)) for s in samples]
    await wait_generated(torch_engine, generated + 8)  # both mid-generation
    await client.abort("grp/")  # no request has this id: nothing happens
    assert await client.abort_prefix("grp/") == 2
    await asyncio.gather(*tasks)
    assert all(s.status is SampleStatus.ABORTED and s.response_length < 96 for s in samples)


async def test_pause_in_abort_mode_aborts_every_sample_in_flight(client, engine):
    torch_engine = engine[1]
    ctx = context(client, torch_engine.tokenizer, {**LONG, "max_new_tokens": 400})
    samples = [fresh(f"pause/{i}") for i in range(2)]
    generated = torch_engine.stats["generated_tokens"]
    tasks = [asyncio.create_task(single_turn(ctx, s)) for s in samples]
    await wait_generated(torch_engine, generated + 8)
    try:
        await client.pause("abort")
        await asyncio.gather(*tasks)
    finally:
        await client.continue_()
    for s in samples:
        assert s.status is SampleStatus.ABORTED and s.reward is None
        assert 0 < s.response_length < 400
        assert_aligned(s)


async def test_a_failing_reward_propagates_as_a_reward_error(client, engine):
    path = "tests.test_single_turn:failing_reward"
    ctx = context(client, engine[1].tokenizer, GREEDY, type="custom", path=path)
    with pytest.raises(RewardError, match="custom reward raised ValueError: judge unavailable"):
        await single_turn(ctx, fresh())


# --------------------------------------------------------------------- scripted engines


def result(ids: list[int], reason: str | None, *, logprobs: bool = True) -> GenerateResult:
    return GenerateResult(
        rid="r",
        output_ids=ids,
        logprobs=[-0.1] * len(ids) if logprobs else None,
        versions=[VERSION] * len(ids),
        finish_reason=None if reason is None else FinishReason(type=reason),
    )


async def test_a_character_split_by_an_abort_is_decoded_whole(engine):
    tokenizer = engine[1].tokenizer
    euro = tokenizer.encode("\u20ac", add_special_tokens=False)
    assert len(euro) > 1  # the tiny byte-level vocabulary spells it in several tokens
    script = Scripted([result(euro[:1], "abort"), result(euro[1:], "stop")])
    ctx = context(script, tokenizer, GREEDY)
    sample = await single_turn(ctx, fresh())
    assert sample.status is SampleStatus.ABORTED
    await single_turn(ctx, sample)
    assert sample.status is SampleStatus.COMPLETED and sample.response_text == "\u20ac"


async def test_an_engine_answer_without_a_finish_reason_is_an_abort():
    sample = await single_turn(context(Scripted([result([7], None)]), None, GREEDY), fresh())
    assert sample.status is SampleStatus.ABORTED and sample.response_length == 1


@pytest.mark.parametrize(
    ("last", "extra", "status"),
    [
        ("eos", {}, SampleStatus.COMPLETED),
        ("eos", {"ignore_eos": True}, SampleStatus.TRUNCATED),
        (9, {"stop_token_ids": [9]}, SampleStatus.COMPLETED),
        (9, {"stop_token_ids": [9], "ignore_eos": True}, SampleStatus.TRUNCATED),  # SGLang's
        (9, {}, SampleStatus.TRUNCATED),
    ],
)
async def test_a_reply_that_ends_on_its_last_allowed_token_ended(engine, last, extra, status):
    # SGLang checks the length first: EOS as the last allowed token says "length".
    tokenizer = engine[1].tokenizer
    end = tokenizer.eos_token_id if last == "eos" else last
    script = Scripted([result([7, end], "length")])
    ctx = context(script, tokenizer, {"temperature": 0, "max_new_tokens": 2, **extra})
    sample = await single_turn(ctx, fresh())
    assert sample.status is status and sample.reward is not None
    assert sample.finish_reason == ("stop" if status is SampleStatus.COMPLETED else "length")


async def test_a_stop_string_completed_by_the_last_allowed_token_ended_the_reply(engine):
    tokenizer = engine[1].tokenizer
    ids = tokenizer.encode("ab END", add_special_tokens=False)
    head = len(tokenizer.encode("ab", add_special_tokens=False))
    ctx = context(Scripted([]), tokenizer, {"temperature": 0, "stop": [" END"]})
    for n in range(head + 1, len(ids) + 1):  # " END" is whole only with the last token
        reason = ctx.finish(result(ids[:n], "length"), ctx.sampling)
        assert (reason.type, reason.matched) == (
            ("stop", " END") if n == len(ids) else ("length", None)
        )
    already = ids + tokenizer.encode("x", add_special_tokens=False)  # matched before: cut
    assert ctx.finish(result(already, "length"), ctx.sampling).type == "length"
    regex = context(Scripted([]), tokenizer, {"temperature": 0, "stop_regex": "E+ND$"})
    assert ctx.finish(result(ids, "length"), regex.sampling).matched == "E+ND$"


async def test_the_end_tokens_are_the_tokenizers_and_its_models_configs(engine, tmp_path):
    tokenizer = engine[1].tokenizer
    assert end_ids(tokenizer) == {tokenizer.eos_token_id}  # the tiny model's configs agree
    assert end_ids(None) == frozenset()
    folder = tmp_path / "model"
    tokenizer.save_pretrained(folder)
    loaded = AutoTokenizer.from_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert end_ids(loaded) == {tokenizer.eos_token_id, 5, 6, 7}
    (folder / "config.json").write_text("not json")  # unreadable: skipped
    assert end_ids(loaded) == {tokenizer.eos_token_id, 5, 6}


async def test_an_engine_answer_without_log_probs_is_refused():
    ctx = context(Scripted([result([7, 8], "stop", logprobs=False)]), None, GREEDY)
    with pytest.raises(ValueError, match="no log-probs"):
        await single_turn(ctx, fresh())


# ------------------------------------------------------------------------ workflow loading


async def test_no_workflow_path_is_single_turn_and_a_path_loads_an_async_function():
    assert load_workflow(None) is single_turn
    assert load_workflow("tests.test_single_turn:custom_workflow") is custom_workflow
    assert load_workflow("tests.test_single_turn.custom_workflow") is custom_workflow


async def test_a_workflow_path_to_a_sync_or_missing_function_fails_naming_it():
    sync_path = "tests.test_single_turn:sync_workflow"
    with pytest.raises(ValueError, match=re.escape(f"{sync_path!r} must be an async function")):
        load_workflow(sync_path)
    with pytest.raises(ValueError, match=re.escape("workflow path 'tests.nope:fn': cannot")):
        load_workflow("tests.nope:fn")


async def test_the_rollout_temperature_crosses_one_parse_from_config_to_the_engine(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """The context parses the config's mapping once; the in-process call hands the typed
    params to the engine, and the server's dict parse is never reached."""
    from asyncrl.engines.server import generate_wire
    from asyncrl.engines.server.in_process import InProcessGenerator

    torch_engine = TorchEngine.from_pretrained(str(model_dir), version=VERSION)
    seen: list[Any] = []
    submit = torch_engine.generate

    def spy(request: Any) -> Any:
        seen.append(request.sampling)
        return submit(request)

    def no_dict(raw: Any) -> Any:
        raise AssertionError(f"sampling params parsed again from {raw!r}")

    monkeypatch.setattr(torch_engine, "generate", spy)
    monkeypatch.setattr(generate_wire, "_convert_sampling", no_dict)
    server = EngineServer(torch_engine)
    await server.start("127.0.0.1", 0)
    try:
        tokenizer = torch_engine.tokenizer
        ctx = context(InProcessGenerator([server]), tokenizer, {**GREEDY, "temperature": 0.7})
        done = await single_turn(ctx, fresh())
    finally:
        await server.stop()
    assert done.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED), done.error
    # the server's start-up probe first (greedy), then the rollout's one call
    assert [p.temperature for p in seen] == [0, 0.7] and seen[-1].max_new_tokens == 8
    assert ctx.sampling.temperature == 0.7 and ctx.sampling.max_new_tokens == 8
