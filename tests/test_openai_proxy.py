"""The OpenAI proxy: a real ``openai`` client agent trained through it, token-exact.

Most tests put the scripted engine (``tests/scripted_engine.py``) behind the proxy, so the
test knows exactly what the model "sampled" and can check the captured trajectory against
it; the last one runs the real tiny engine over HTTP with a weight update in the middle of
an episode. The agents here are plain ``openai.AsyncOpenAI`` tool-calling loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import pytest_asyncio

from asyncrl.rollout.agent_workflow import AgentWorkflow
from asyncrl.rollout.base import RolloutContext
from asyncrl.rollout.openai_proxy import AgentTask, ProxyConfig, Session
from asyncrl.rollout.tools.calculator import calculator, calculator_tool
from asyncrl.rollout.tools.registry import openai_schema
from asyncrl.types import Sample, SampleStatus
from tests.scripted_engine import ScriptedEngine, Step
from tests.tiny_tokenizer import build_chatml_tokenizer

TOOLS = [openai_schema(calculator_tool())]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_chatml_tokenizer(Path(tmp_path_factory.mktemp("tok")))


def call_text(expression: str) -> str:
    body = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(body)}</tool_call>"


async def score(sample: Sample) -> float:
    return float(sample.response_text.strip() == f"#### {sample.label}")


async def calculator_agent(session: Session, task: AgentTask) -> str:
    """A plain openai-client loop: ask, run the calculator when told to, stop at an answer."""
    messages: list[Any] = [{"role": "user", "content": task.prompt}]
    async with session.client(max_retries=0) as client:
        for _ in range(4):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, max_tokens=128
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content or ""
            for tc in message.tool_calls:
                args = json.loads(tc.function.arguments)
                result = calculator(**args)
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": result})
    return ""


@pytest_asyncio.fixture
async def rig(tokenizer: Any) -> AsyncIterator[Any]:
    """``make(steps, agent, budget, ...)`` -> (workflow, ctx, engine), proxies started."""
    async with contextlib.AsyncExitStack() as stack:

        async def make(
            steps: list[Step],
            agent: Any = calculator_agent,
            budget: int = 400,
            max_calls: int = 16,
            length_first: bool = False,
        ) -> tuple[AgentWorkflow, RolloutContext, Any]:
            engine = ScriptedEngine(tokenizer, steps, length_first=length_first)
            sampling = {"max_new_tokens": budget, "temperature": 1.0}
            ctx = RolloutContext(engine, score, sampling, tokenizer=tokenizer)
            workflow = AgentWorkflow(agent, ProxyConfig(max_calls=max_calls))
            await stack.enter_async_context(workflow.resources(ctx))
            return workflow, ctx, engine

        yield make


def fresh(uid: str = "g/0", prompt: str = "what is 6*7?", label: str = "42") -> Sample:
    return Sample(uid=uid, group_id="g", prompt=prompt, label=label)


def render(tokenizer: Any, messages: list[Any], **kw: Any) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def test_an_openai_client_agent_is_trained_on_exactly_what_the_engine_sampled(rig, tokenizer):
    workflow, ctx, engine = await rig(
        [Step(call_text("6*7"), version=3), Step("#### 42", version=4)]
    )
    sample = await workflow(ctx, fresh())
    assert sample.status is SampleStatus.COMPLETED and sample.reward == 1.0
    user = [{"role": "user", "content": "what is 6*7?"}]
    prompt = render(tokenizer, user, tools=TOOLS, add_generation_prompt=True)
    assert sample.prompt_tokens.tolist() == prompt  # the first call's messages and tools
    observation = tokenizer("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)["input_ids"]  # fmt: skip
    first, second = engine.sampled
    assert sample.response_tokens.tolist() == first + observation + second
    assert sample.loss_mask.tolist() == [1] * len(first) + [0] * len(observation) + [1] * len(
        second
    )
    expected_lp = [-0.25 - 0.01 * i for i in range(len(first))]
    np.testing.assert_allclose(sample.logprobs[: len(first)], expected_lp, rtol=1e-6)
    assert (sample.logprobs[len(first) : -len(second)] == 0).all()
    versions = [3] * len(first) + [3] * len(observation) + [4] * len(second)
    assert sample.token_versions.tolist() == versions
    # Each call continued from every token so far: nothing was re-tokenised.
    assert engine.inputs == [prompt, prompt + first + observation]
    assert [(t.role, t.end - t.start) for t in sample.spans] == [
        ("assistant", len(first)), ("tool", len(observation)), ("assistant", len(second))
    ]  # fmt: skip
    assert sample.metadata["tool_calls"] == [{"name": "calculator", "error": None}]
    assert sample.metadata["final_state"] == "#### 42" and sample.metadata["agent_calls"] == 2


async def test_the_reply_is_a_standard_chat_completion_with_parsed_tool_calls(rig):
    seen: list[Any] = []

    async def agent(session: Session, task: AgentTask) -> str:
        async with session.client(max_retries=0) as client:
            reply = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "6*7"}], tools=TOOLS
            )
            seen.append(reply)
            return "done"

    workflow, ctx, _ = await rig([Step("thinking " + call_text("6*7"))], agent)
    await workflow(ctx, fresh())
    (reply,) = seen
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "thinking"
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "calculator"
    assert json.loads(tc.function.arguments) == {"expression": "6*7"}
    assert reply.usage.completion_tokens > 0 and reply.object == "chat.completion"


async def test_a_matched_stop_string_is_not_in_the_content_but_is_trained(rig, tokenizer):
    """OpenAI's content excludes the stop sequence it ended on; the sample keeps every
    sampled token, the stop string's too."""
    seen: list[Any] = []

    async def agent(session: Session, task: AgentTask) -> str:
        async with session.client(max_retries=0) as client:
            reply = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "6*7"}], stop=["###"]
            )
            seen.append(reply)
            return reply.choices[0].message.content

    workflow, ctx, engine = await rig([Step("It is 42 ###", matched="###")], agent)
    sample = await workflow(ctx, fresh())
    choice = seen[0].choices[0]
    # The text before the stop, unstripped, as /v1 and SGLang give it.
    assert choice.message.content == "It is 42 " and choice.finish_reason == "stop"
    assert sample.response_tokens.tolist()[-len(engine.sampled[0]) :] == engine.sampled[0]
    assert "###" in tokenizer.decode(engine.sampled[0])


async def _expect(session: Session, error: type[Exception], match: str, **call: Any) -> None:
    async with session.client(max_retries=0) as client:
        with pytest.raises(error, match=match):
            await client.chat.completions.create(model="m", **call)


async def test_bad_calls_get_clear_openai_errors_and_the_episode_goes_on(rig):
    user = [{"role": "user", "content": "6*7"}]

    async def agent(session: Session, task: AgentTask) -> str:
        wrong_key = Session(session.base_url, "not-the-key")
        await _expect(wrong_key, openai.AuthenticationError, "invalid API key", messages=user)
        named = {"type": "function", "function": {"name": "calculator"}}
        other = {"type": "function", "function": {"name": "other"}}
        for choice, message in (
            ("required", "tool_choice 'required' is not supported by the training proxy: a"),
            (named, "'name': 'calculator'}} is not supported by the training proxy: a gram"),
            ("sometimes", "tool_choice 'sometimes' is not one of 'none', 'auto'"),
            (other, "names function 'other', which is not among tools"),
        ):
            await _expect(session, openai.BadRequestError, re.escape(message),
                          messages=user, tools=TOOLS, tool_choice=choice)  # fmt: skip
        await _expect(session, openai.BadRequestError, "n > 1", messages=user, n=2)
        await _expect(session, openai.BadRequestError, "non-empty list", messages=[])
        async with session.client(max_retries=0) as client:
            first = await client.chat.completions.create(model="m", messages=user, tools=TOOLS)
        said = first.choices[0].message.model_dump(exclude_none=True)
        edited = [{"role": "user", "content": "6*8"}, said, {"role": "tool", "content": "42"}]
        await _expect(session, openai.BadRequestError, r"messages\[0\] differs",
                      messages=edited, tools=TOOLS)  # fmt: skip
        await _expect(session, openai.BadRequestError, "tools changed",
                      messages=[*user, said, {"role": "tool", "content": "42"}])  # fmt: skip
        injected = [*user, said, {"role": "assistant", "content": "x"}]
        await _expect(session, openai.BadRequestError, "assistant message the model did not",
                      messages=injected, tools=TOOLS)  # fmt: skip
        async with session.client(max_retries=0) as client:
            final = await client.chat.completions.create(
                model="m", messages=[*user, said, {"role": "tool", "content": "42"}], tools=TOOLS
            )
        return final.choices[0].message.content or ""

    workflow, ctx, engine = await rig([Step(call_text("6*7")), Step("#### 42")], agent)
    sample = await workflow(ctx, fresh())
    assert sample.status is SampleStatus.COMPLETED and sample.reward == 1.0
    assert len(engine.inputs) == 2  # the refused calls never reached the engine


async def test_two_calls_at_once_in_one_session_are_refused(rig):
    started, gate = asyncio.Event(), asyncio.Event()
    errors: list[str] = []

    class SlowEngine(ScriptedEngine):
        async def generate(self, *args: Any, **kw: Any) -> Any:
            started.set()
            await gate.wait()
            return await super().generate(*args, **kw)

    async def agent(session: Session, task: AgentTask) -> str:
        user = [{"role": "user", "content": "a"}]
        async with session.client(max_retries=0) as client:
            first = asyncio.create_task(client.chat.completions.create(model="m", messages=user))
            await started.wait()  # the first call is in the engine now
            try:
                await client.chat.completions.create(model="m", messages=user)
            except openai.BadRequestError as exc:
                errors.append(str(exc))
            gate.set()
            return (await first).choices[0].message.content or ""

    workflow, ctx, engine = await rig([], agent)
    ctx.engine = SlowEngine(engine.tokenizer, [Step("#### 1")])
    sample = await workflow(ctx, fresh())
    assert len(errors) == 1 and "one call at a time" in errors[0]
    assert sample.metadata["final_state"] == "#### 1" and sample.metadata["agent_calls"] == 1


async def test_a_failed_call_leaves_no_trace_so_the_clients_retry_starts_clean(rig, tokenizer):
    # The engine fails the second call once; openai's default retry sends it again and
    # the trajectory holds each call once.
    class FailsOnce(ScriptedEngine):
        failed = False

        async def generate(self, *args: Any, **kw: Any) -> Any:
            if len(self.inputs) == 1 and not self.failed:
                self.failed = True
                raise ConnectionError("engine hiccup")
            return await super().generate(*args, **kw)

    async def agent(session: Session, task: AgentTask) -> str:
        messages: list[Any] = [{"role": "user", "content": "6*7"}]
        async with session.client(max_retries=2) as client:  # the client's default
            reply = await client.chat.completions.create(model="m", messages=messages)
            # The pydantic message itself goes back, as most agents send it (content None).
            messages += [reply.choices[0].message, {"role": "tool", "content": "42"}]
            final = await client.chat.completions.create(model="m", messages=messages)
        return final.choices[0].message.content or ""

    workflow, ctx, _ = await rig([], agent)
    ctx.engine = engine = FailsOnce(tokenizer, [Step(call_text("6*7")), Step("#### 42")])
    sample = await workflow(ctx, fresh())
    assert engine.failed and sample.status is SampleStatus.COMPLETED and sample.reward == 1.0
    first, second = engine.sampled
    observation = len(sample.response_tokens) - len(first) - len(second)
    assert sample.loss_mask.tolist() == [1] * len(first) + [0] * observation + [1] * len(second)
    assert sample.metadata["tool_calls"] == [{"name": "calculator", "error": None}]


async def test_an_agent_editing_its_task_does_not_change_the_sample(rig):
    async def agent(session: Session, task: AgentTask) -> str:
        task.metadata["seen"] = True
        messages = [{"role": "user", "content": task.prompt}]
        async with session.client(max_retries=0) as client:
            reply = await client.chat.completions.create(model="m", messages=messages)
        messages.append(reply.choices[0].message)  # a pydantic object: not wire data
        return reply.choices[0].message.content or ""

    workflow, ctx, _ = await rig([Step("#### 42")], agent)
    sample = await workflow(ctx, fresh())
    assert sample.prompt == "what is 6*7?" and "seen" not in sample.metadata


async def test_the_token_budget_and_the_call_limit_end_the_episode_truncated(rig):
    workflow, ctx, _ = await rig([Step(call_text("6*7")), Step("#### 42")], budget=30)
    sample = await workflow(ctx, fresh())
    assert sample.status is SampleStatus.TRUNCATED and sample.finish_reason == "length"
    assert sample.response_length <= 30 and sample.reward == 0.0  # scored all the same

    steps = [Step(call_text(f"{i}*7")) for i in range(3)]
    workflow, ctx, engine = await rig(steps, max_calls=2)
    sample = await workflow(ctx, fresh())
    assert sample.status is SampleStatus.TRUNCATED and sample.finish_reason == "max_turns"
    assert len(engine.inputs) == 2 and sample.metadata["agent_calls"] == 3


async def test_an_answer_whose_eos_is_the_last_token_of_the_budget_completes(rig, tokenizer):
    # SGLang says "length" for it (it checks the length before the stop token).
    n = len(tokenizer("#### 42", add_special_tokens=False)["input_ids"]) + 1
    workflow, ctx, engine = await rig([Step("#### 42")], budget=n, length_first=True)
    sample = await workflow(ctx, fresh())
    assert engine.sampled[0][-1] == tokenizer.eos_token_id and sample.response_length == n
    assert (sample.status, sample.finish_reason, sample.reward) == (
        SampleStatus.COMPLETED, "stop", 1.0
    )  # fmt: skip


async def test_a_weight_update_in_a_call_only_delays_it(rig, tokenizer):
    # The engine aborts the first call part-way (an update with on_update: abort); the proxy
    # continues from the partial tokens on the new weights and the agent sees one reply.
    whole = call_text("6*7")
    part = tokenizer.decode(tokenizer(whole, add_special_tokens=False)["input_ids"][:5])
    steps = [Step(part, finish="abort", version=0), Step(whole[len(part) :], version=1),
             Step("#### 42", version=1)]  # fmt: skip
    workflow, ctx, engine = await rig(steps)
    sample = await workflow(ctx, fresh())
    assert sample.status is SampleStatus.COMPLETED and sample.reward == 1.0
    assert sample.metadata["agent_calls"] == 2 and len(engine.inputs) == 3
    assert engine.inputs[1] == engine.inputs[0] + engine.sampled[0]  # continued, not redone
    assert sample.token_versions.tolist()[:6] == [0] * 5 + [1]
    assert sample.spans[0].role == "assistant"
    assert sample.spans[0].end == len(engine.sampled[0]) + len(engine.sampled[1])


async def test_an_abort_of_all_work_restarts_the_episode_from_scratch(rig):
    aborts = 0
    workflow, ctx, engine = await rig([Step(call_text("6*7"))])
    ctx.aborts = lambda: aborts

    async def abort_while_tools_run(expression: str) -> str:
        nonlocal aborts
        aborts += 1  # an APRIL round closes while the agent runs its tool
        return calculator(expression)

    async def agent(session: Session, task: AgentTask) -> str:
        messages: list[Any] = [{"role": "user", "content": "6*7"}]
        async with session.client(max_retries=0) as client:
            while True:
                reply = await client.chat.completions.create(model="m", messages=messages)
                message = reply.choices[0].message
                if not message.tool_calls:
                    return message.content or ""
                messages.append(message.model_dump(exclude_none=True))
                result = await abort_while_tools_run("6*7")
                messages.append({"role": "tool", "content": result})

    workflow.agent = agent
    sample = await workflow(ctx, fresh())
    assert sample.status is SampleStatus.ABORTED and sample.response_length == 0
    assert sample.metadata["tool_calls"] == [] and len(engine.inputs) == 1
    # Resumed later, the agent runs again from the start.
    engine.steps = [Step(call_text("6*7")), Step("#### 42")]
    workflow.agent = calculator_agent
    sample.attempts += 1
    again = await workflow(ctx, sample)
    assert again.status is SampleStatus.COMPLETED and again.reward == 1.0


async def test_an_agent_that_raises_or_never_calls_fails_its_sample(rig):
    async def silent(session: Session, task: AgentTask) -> str:
        return "#### 42"

    async def buggy(session: Session, task: AgentTask) -> str:
        raise KeyError("tool registry")

    workflow, ctx, _ = await rig([], silent)
    with pytest.raises(ValueError, match="without calling the model"):
        await workflow(ctx, fresh())
    workflow.agent = buggy
    with pytest.raises(KeyError, match="tool registry"):
        await workflow(ctx, fresh())  # the rollout actor marks the sample failed with it


async def test_an_abort_of_all_work_during_an_engine_call_restarts_the_episode(rig, tokenizer):
    aborts = 0

    class AbortsAll(ScriptedEngine):
        async def generate(self, *args: Any, **kw: Any) -> Any:
            nonlocal aborts
            aborts += 1  # a drain: every in-flight request comes back aborted
            return await super().generate(*args, **kw)

    async def swallowing(session: Session, task: AgentTask) -> str:
        try:
            return await calculator_agent(session, task)
        except BaseException:  # an agent that swallows everything, cancellation too
            return "gave up"

    workflow, ctx, _ = await rig([], swallowing)
    ctx.engine = AbortsAll(tokenizer, [Step("<tool", finish="abort"), Step("more")])
    ctx.aborts = lambda: aborts
    sample = await workflow(ctx, fresh())
    assert sample.status is SampleStatus.ABORTED and sample.response_length == 0
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the proxy's cancel was withdrawn


class Recording:
    """A ``Generator`` in front of a real client that keeps every result it returned."""

    def __init__(self, client: Any) -> None:
        self.client, self.results = client, []

    async def generate(self, input_ids: Any, sampling_params: Any = None, *, rid: Any = None):
        result = await self.client.generate(input_ids, sampling_params, rid=rid)
        self.results.append(result)
        return result


async def test_the_real_engine_behind_the_proxy_with_a_weight_update_mid_episode(tmp_path):
    from asyncrl.engines.client.sglang import SGLangClient
    from asyncrl.engines.server.app import EngineServer
    from asyncrl.engines.torch.engine import TorchEngine
    from tests.tiny_model import build_tiny_model

    model, tokenizer = build_tiny_model(tmp_path)
    engine = TorchEngine.from_pretrained(str(tmp_path))
    server = EngineServer(engine)
    url = await server.start("127.0.0.1", 0)
    replies: list[Any] = []

    async def agent(session: Session, task: AgentTask) -> str:
        messages: list[Any] = [{"role": "user", "content": task.prompt}]
        async with session.client(max_retries=0) as client:
            for follow_up in ("go on", None):
                reply = await client.chat.completions.create(
                    model="m", messages=messages, max_tokens=40
                )
                replies.append(reply)
                messages.append(reply.choices[0].message.model_dump(exclude_none=True))
                if follow_up:
                    messages.append({"role": "user", "content": follow_up})
        return reply.choices[0].message.content or ""

    async def update_mid_call(client: SGLangClient) -> None:
        # What EngineHost.load does with on_update: abort, once the first call is running.
        while engine.stats["generated_tokens"] < 10:  # noqa: ASYNC110 (no event to wait on)
            await asyncio.sleep(0.002)
        await client.abort(abort_all=True)
        new = {k: v + 0.01 for k, v in model.state_dict().items() if "norm" not in k}
        await engine.update_weights_from_tensors(new, version=1)

    try:
        async with SGLangClient(url) as client:
            recording = Recording(client)
            sampling = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
            ctx = RolloutContext(recording, score, sampling, tokenizer=tokenizer)
            workflow = AgentWorkflow(agent)
            async with workflow.resources(ctx):
                sample, _ = await asyncio.gather(
                    workflow(ctx, fresh(prompt="hello")), update_mid_call(client)
                )
    finally:
        await server.stop()
    assert sample.status is SampleStatus.COMPLETED and len(replies) == 2
    assert [r.choices[0].finish_reason for r in replies] == ["length", "length"]
    assert [r.usage.completion_tokens for r in replies] == [40, 40]  # the update only delayed
    sampled = [t for r in recording.results for t in r.output_ids]
    assert sample.response_tokens[sample.loss_mask == 1].tolist() == sampled
    lps = [lp for r in recording.results for lp in r.logprobs]
    np.testing.assert_allclose(sample.logprobs[sample.loss_mask == 1], lps, rtol=1e-6)
    first = sample.token_versions[: sample.spans[0].end].tolist()
    assert first[0] == 0 and first[-1] == 1 and first == sorted(first)  # the update landed
    assert recording.results[0].finish_reason.type == "abort" and len(recording.results) == 3


async def test_calls_after_the_budget_is_spent_get_empty_length_replies(rig):
    replies: list[Any] = []

    async def stubborn(session: Session, task: AgentTask) -> str:
        messages: list[Any] = [{"role": "user", "content": "6*7"}]
        async with session.client(max_retries=0) as client:
            for _ in range(3):  # keeps going whatever the replies say
                reply = await client.chat.completions.create(model="m", messages=messages)
                replies.append(reply.choices[0])
                messages += [reply.choices[0].message, {"role": "user", "content": "more"}]
        return "done"

    workflow, ctx, engine = await rig([Step("x" * 40)], stubborn, budget=30)
    sample = await workflow(ctx, fresh())
    assert [r.finish_reason for r in replies] == ["length"] * 3
    assert [r.message.content for r in replies[1:]] == [None, None]
    assert len(engine.inputs) == 1 and sample.response_length == 30
    assert sample.status is SampleStatus.TRUNCATED and sample.finish_reason == "length"


async def test_an_engine_failure_is_a_500_the_agent_can_read_and_fails_the_sample(rig):
    class Broken:
        async def generate(self, *args: Any, **kw: Any) -> Any:
            raise ConnectionError("engine at 127.0.0.1:1 refused")

    workflow, ctx, _ = await rig([])
    ctx.engine = Broken()
    with pytest.raises(openai.InternalServerError, match=r"engine at 127\.0\.0\.1:1 refused"):
        await workflow(ctx, fresh())


# ----------------------------------------------------------------------------- streaming


async def accumulate(stream: Any) -> tuple[dict[str, Any], str, Any]:
    """The assistant message a streaming client builds from the chunks (keys left out when
    empty, as ``model_dump(exclude_none=True)`` does), the finish reason and the usage (the
    last chunk's, with ``include_usage``)."""
    content, calls, reason, usage = "", {}, None, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for part in choice.delta.tool_calls or ():
                new = {"id": part.id, "type": "function", "function": {"name": "", "arguments": ""}}
                call = calls.setdefault(part.index, new)
                call["function"]["name"] += part.function.name or ""
                call["function"]["arguments"] += part.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant"}
    if content:
        message["content"] = content
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, reason, usage


def calculator_loop(stream: bool, replies: list[Any]) -> Any:
    """An agent that runs the calculator on every call and says "go on" to a reply with
    neither calls nor an answer; ``stream``: it streams and sends back what it built."""

    async def agent(session: Session, task: AgentTask) -> str:
        messages: list[Any] = [{"role": "user", "content": task.prompt}]
        request = {"model": "m", "tools": TOOLS, "tool_choice": "auto", "max_tokens": 300}
        async with session.client(max_retries=0) as client:
            for _ in range(4):
                if stream:
                    chunks = await client.chat.completions.create(
                        messages=messages, stream=True,
                        stream_options={"include_usage": True}, **request,
                    )  # fmt: skip
                    message, reason, _ = await accumulate(chunks)
                else:
                    reply = await client.chat.completions.create(messages=messages, **request)
                    message = reply.choices[0].message.model_dump(exclude_none=True)
                    reason = reply.choices[0].finish_reason
                replies.append((message, reason))
                messages.append(message)
                for tc in message.get("tool_calls") or ():
                    result = calculator(**json.loads(tc["function"]["arguments"]))
                    messages.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
                if message.get("content", "").startswith("####"):
                    return message["content"]
                if not message.get("tool_calls"):
                    messages.append({"role": "user", "content": "go on"})
        return ""

    return agent


def streaming_steps() -> list[Step]:
    return [
        Step("hmm <tool_call>{oops}</tool_call>"),  # malformed: stays content
        Step("Let me see. " + call_text("6*7") + "\n" + call_text("1+1")),  # two calls
        Step("#### 42"),
    ]


async def test_a_streaming_agent_trains_the_same_tokens_as_a_non_streaming_one(rig):
    runs = []
    for stream in (False, True):
        replies: list[Any] = []
        agent = calculator_loop(stream, replies)
        workflow, ctx, _ = await rig(streaming_steps(), agent, budget=1000)
        runs.append((await workflow(ctx, fresh()), replies))
    (whole, whole_replies), (streamed, streamed_replies) = runs
    assert streamed.status is SampleStatus.COMPLETED and streamed.reward == 1.0
    assert streamed.prompt_tokens.tolist() == whole.prompt_tokens.tolist()
    assert streamed.response_tokens.tolist() == whole.response_tokens.tolist()
    assert streamed.loss_mask.tolist() == whole.loss_mask.tolist()
    np.testing.assert_array_equal(streamed.logprobs, whole.logprobs)
    assert streamed.metadata["tool_calls"] == whole.metadata["tool_calls"] == [
        {"name": "calculator", "error": None}] * 2  # fmt: skip
    # What the streaming agent built is the non-streamed reply, ids included.
    assert streamed_replies == whole_replies
    reasons = [reason for _, reason in streamed_replies]
    assert reasons == ["stop", "tool_calls", "stop"]
    assert streamed_replies[0][0]["content"] == "hmm <tool_call>{oops}</tool_call>"
    ids = [tc["id"] for tc in streamed_replies[1][0]["tool_calls"]]
    assert len(set(ids)) == 2 and streamed_replies[1][0]["content"] == "Let me see."


async def test_a_streamed_reply_is_server_sent_events_ending_with_usage_and_done(rig):
    import aiohttp

    raw: list[str] = []

    async def agent(session: Session, task: AgentTask) -> str:
        body = {"model": "m", "messages": [{"role": "user", "content": "6*7"}], "tools": TOOLS,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        headers = {"Authorization": f"Bearer {session.api_key}"}
        async with aiohttp.ClientSession() as http:
            url = session.base_url + "/chat/completions"
            async with http.post(url, json=body, headers=headers) as resp:
                assert resp.status == 200 and resp.content_type == "text/event-stream"
                raw.append(await resp.text())
        return "done"

    workflow, ctx, engine = await rig([Step("ok " + call_text("6*7"))], agent)
    sample = await workflow(ctx, fresh())
    events = raw[0].removesuffix("\n\n").split("\n\n")
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *_, finish, usage = chunks
    assert finish["choices"][0]["finish_reason"] == "tool_calls" and usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == len(engine.sampled[0])
    assert sample.metadata["tool_calls"] == [{"name": "calculator", "error": None}]


async def test_tool_choice_none_on_the_proxy_leaves_the_call_as_content(rig):
    seen: list[Any] = []

    async def agent(session: Session, task: AgentTask) -> str:
        messages: list[Any] = [{"role": "user", "content": "6*7"}]
        async with session.client(max_retries=0) as client:
            for stream in (True, False):
                request = {"model": "m", "messages": messages, "tools": TOOLS}
                if stream:
                    chunks = await client.chat.completions.create(
                        **request, tool_choice="none", stream=True
                    )
                    message, reason, _ = await accumulate(chunks)
                else:
                    reply = await client.chat.completions.create(**request)
                    message = reply.choices[0].message.model_dump(exclude_none=True)
                    reason = reply.choices[0].finish_reason
                seen.append((message, reason))
                messages += [message, {"role": "user", "content": "again"}]
        return "done"

    workflow, ctx, _ = await rig([Step(call_text("6*7")), Step("#### 42")], agent)
    sample = await workflow(ctx, fresh())
    (unparsed, reason), (final, _) = seen
    assert unparsed == {"role": "assistant", "content": call_text("6*7")}
    assert reason == "stop" and final["content"] == "#### 42"  # the episode went on
    assert not sample.metadata["tool_calls"] and sample.status is SampleStatus.COMPLETED
