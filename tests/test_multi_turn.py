"""The multi-turn tool-use workflow: token alignment, loss masks, tool errors, cuts, resume.

The engine here is a scripted ``Generator`` (the workflow's only seam to the model): each
call returns the tokens of the next scripted turn, so a test can say exactly what the model
"sampled" and check that the trained tokens are those tokens, in order, untouched. The
real engine runs the same workflow in the end-to-end tests.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncrl.rollout.base import RolloutContext
from asyncrl.rollout.multi_turn import (
    HermesParser,
    Llama3Parser,
    MultiTurn,
    MultiTurnConfig,
    ObservationRenderer,
    ToolCall,
)
from asyncrl.rollout.tools import FunctionTool, ToolRegistry, calculator_tool
from asyncrl.rollout.tools.calculator import CALCULATOR_PARAMETERS
from asyncrl.types import Sample, SampleStatus, pack_int32
from tests.scripted_engine import ScriptedEngine, Step
from tests.tiny_tokenizer import build_chatml_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_chatml_tokenizer(Path(tmp_path_factory.mktemp("tok")))


async def score(sample: Sample) -> float:
    return float(sample.response_text.endswith("#### 42"))  # special tokens are skipped


def call(expression: str) -> str:
    body = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(body)}</tool_call>"


def make_sample(tokenizer: Any, **kw: Any) -> Sample:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is 6*7?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return Sample(uid="g/0", group_id="g", packed_prompt=pack_int32(ids), **kw)


def context(tokenizer: Any, engine: ScriptedEngine, budget: int = 400) -> RolloutContext:
    registry = ToolRegistry([calculator_tool()])
    sampling = {"max_new_tokens": budget, "temperature": 1.0}
    return RolloutContext(engine, score, sampling, tokenizer=tokenizer, tools=registry)


def observation(tokenizer: Any, content: str) -> list[int]:
    text = f"\n<|im_start|>tool\n{content}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def test_the_trained_tokens_are_the_sampled_tokens_with_observations_masked(tokenizer):
    steps = [
        Step(call("6*7"), version=3),
        Step(call("42-0"), version=4),
        Step("#### 42", version=4),
    ]
    engine = ScriptedEngine(tokenizer, steps)
    sample = make_sample(tokenizer)
    out = await MultiTurn()(context(tokenizer, engine), sample)

    t1, t2, t3 = engine.sampled
    o1, o2 = observation(tokenizer, "42"), observation(tokenizer, "42")
    assert out.response_tokens.tolist() == t1 + o1 + t2 + o2 + t3
    # each request continued from exactly the tokens so far: nothing re-tokenised
    prompt = out.prompt_tokens.tolist()
    assert engine.inputs == [prompt, prompt + t1 + o1, prompt + t1 + o1 + t2 + o2]
    assert out.loss_mask.tolist() == [1] * len(t1) + [0] * len(o1) + [1] * len(t2) + [0] * len(
        o2
    ) + [1] * len(t3)
    sampled_logprobs = [-0.25 - 0.01 * i for i in range(len(t1))]
    np.testing.assert_allclose(out.logprobs[: len(t1)], sampled_logprobs, rtol=1e-6)
    assert not out.logprobs[len(t1) : len(t1) + len(o1)].any()
    # observation tokens carry the version of the turn that asked for them
    versions = [3] * (len(t1) + len(o1)) + [4] * (len(t2) + len(o2) + len(t3))
    assert out.token_versions.tolist() == versions
    assert [s.role for s in out.spans] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert (out.status, out.finish_reason, out.reward) == (SampleStatus.COMPLETED, "stop", 1.0)
    calls = out.metadata["tool_calls"]
    assert [(c["name"], c["error"], c["timed_out"]) for c in calls] == [
        ("calculator", None, False)
    ] * 2
    assert all(0 <= c["seconds"] < 5 for c in calls)


async def test_tool_errors_become_observations_and_the_episode_goes_on(tokenizer):
    steps = [
        Step('<tool_call>{"name": "calculator", "arguments": {"expression": "x+1"}}</tool_call>'),
        Step('<tool_call>{"name": "web", "arguments": {}}</tool_call>'),
        Step("<tool_call>{not json}</tool_call>"),
        Step("#### 42"),
    ]
    engine = ScriptedEngine(tokenizer, steps)
    out = await MultiTurn()(context(tokenizer, engine), make_sample(tokenizer))
    tool_texts = [
        tokenizer.decode(out.response_tokens[s.start : s.end].tolist())
        for s in out.spans
        if s.role == "tool"
    ]
    assert "Error: CalculatorError: unsupported element Name" in tool_texts[0]
    assert "Error: unknown tool 'web'; available: calculator" in tool_texts[1]
    assert "Error: the tool call is not valid JSON" in tool_texts[2]
    assert out.status is SampleStatus.COMPLETED and out.reward == 1.0
    errors = [c["error"] is not None for c in out.metadata["tool_calls"]]
    assert errors == [True, True, True]


async def test_the_max_turn_cut_ends_the_episode_truncated_and_scored(tokenizer):
    engine = ScriptedEngine(tokenizer, [Step(call("1+1"))] * 5)
    workflow = MultiTurn(MultiTurnConfig(max_turns=2))
    out = await workflow(context(tokenizer, engine), make_sample(tokenizer))
    assert [s.role for s in out.spans] == ["assistant", "tool", "assistant"]
    assert (out.status, out.finish_reason, out.reward) == (SampleStatus.TRUNCATED, "max_turns", 0.0)
    assert len(engine.inputs) == 2


async def test_the_token_budget_covers_turns_and_observations(tokenizer):
    t1 = tokenizer(call("6*7"), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    o1 = observation(tokenizer, "42")
    # room for the first turn, its observation and 3 more tokens
    budget = len(t1) + len(o1) + 3
    engine = ScriptedEngine(tokenizer, [Step(call("6*7")), Step("#### 42")])
    out = await MultiTurn()(context(tokenizer, engine, budget), make_sample(tokenizer))
    assert out.response_length == budget
    assert (out.status, out.finish_reason) == (SampleStatus.TRUNCATED, "length")
    # an observation that would leave no room for an answer ends the episode instead
    engine = ScriptedEngine(tokenizer, [Step(call("6*7"))])
    out = await MultiTurn()(context(tokenizer, engine, len(t1) + len(o1)), make_sample(tokenizer))
    assert out.response_tokens.tolist() == t1
    assert (out.status, out.finish_reason) == (SampleStatus.TRUNCATED, "length")


async def test_a_final_answer_whose_eos_is_the_budgets_last_token_completes(tokenizer):
    # SGLang says "length" for it (it checks the length before the stop token).
    t1 = tokenizer(call("6*7"), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    answer = tokenizer("#### 42", add_special_tokens=False)["input_ids"]
    budget = len(t1) + len(observation(tokenizer, "42")) + len(answer) + 1
    steps = [Step(call("6*7")), Step("#### 42")]
    engine = ScriptedEngine(tokenizer, steps, length_first=True)
    out = await MultiTurn()(context(tokenizer, engine, budget), make_sample(tokenizer))
    assert out.response_length == budget and engine.sampled[1][-1] == tokenizer.eos_token_id
    assert (out.status, out.finish_reason, out.reward) == (SampleStatus.COMPLETED, "stop", 1.0)


async def test_an_aborted_turn_resumes_as_the_same_turn_under_new_weights(tokenizer):
    text = call("6*7")
    head, rest = text[:20], text[20:]
    engine = ScriptedEngine(
        tokenizer,
        [Step(head, finish="abort", version=5), Step(rest, version=6), Step("#### 42", version=6)],
    )
    ctx = context(tokenizer, engine)
    sample = await MultiTurn()(ctx, make_sample(tokenizer))
    assert (sample.status, sample.finish_reason) == (SampleStatus.ABORTED, "abort")
    assert sample.reward is None
    done = await MultiTurn()(ctx, sample)  # the buffer hands it out again
    assert done.status is SampleStatus.COMPLETED and done.reward == 1.0
    assert [s.role for s in done.spans] == ["assistant", "tool", "assistant"]
    first = done.spans[0]
    assert set(done.token_versions[first.start : first.end].tolist()) == {5, 6}
    assert engine.inputs[1] == done.prompt_tokens.tolist() + engine.sampled[0]


async def test_the_tools_of_a_data_row_are_the_ones_offered(tokenizer):
    row_tools = [{"type": "function", "function": {"name": "python"}}]
    engine = ScriptedEngine(tokenizer, [Step(call("1+1"))])
    sample = make_sample(tokenizer, tools=row_tools)
    with pytest.raises(ValueError, match="the data names tool 'python'"):
        await MultiTurn()(context(tokenizer, engine), sample)


async def test_an_abort_while_the_tools_run_stops_the_episode_before_its_next_turn(tokenizer):
    aborts = [0]

    async def slow_calculator(expression: str) -> str:
        aborts[0] += 1  # the buffer's abort arrives while the tool runs
        return "42"

    registry = ToolRegistry(
        [FunctionTool("calculator", "x", slow_calculator, CALCULATOR_PARAMETERS)]
    )
    engine = ScriptedEngine(tokenizer, [Step(call("6*7"), version=1), Step("#### 42", version=2)])
    sampling = {"max_new_tokens": 400}
    ctx = RolloutContext(
        engine, score, sampling, tokenizer=tokenizer, tools=registry, aborts=lambda: aborts[0]
    )
    sample = await MultiTurn()(ctx, make_sample(tokenizer))
    assert (sample.status, sample.finish_reason) == (SampleStatus.ABORTED, "abort")
    assert [s.role for s in sample.spans] == ["assistant", "tool"] and len(engine.inputs) == 1
    done = await MultiTurn()(ctx, sample)  # handed out again: the next turn, new weights
    assert done.status is SampleStatus.COMPLETED and done.reward == 1.0
    assert [s.role for s in done.spans] == ["assistant", "tool", "assistant"]


async def test_a_tool_missing_from_the_rows_list_is_not_offered(tokenizer):
    row_tools = [{"type": "function", "function": {"name": "calculator"}}]
    registry = ToolRegistry([calculator_tool(), FunctionTool("other", "x", _other)])
    body = json.dumps({"name": "other", "arguments": {}})
    steps = [Step(f"<tool_call>{body}</tool_call>"), Step("#### 42")]
    engine = ScriptedEngine(tokenizer, steps)
    sampling = {"max_new_tokens": 400}
    ctx = RolloutContext(engine, score, sampling, tokenizer=tokenizer, tools=registry)
    out = await MultiTurn()(ctx, make_sample(tokenizer, tools=row_tools))
    assert out.metadata["tool_calls"][0]["error"].startswith("Error: unknown tool 'other'")


async def _other() -> str:
    return "should not run"


def test_hermes_parser_finds_every_call_and_reports_malformed_ones():
    parser = HermesParser()
    text = (
        "thinking <tool_call>\n"
        '{"name": "a", "arguments": {"x": 1}}\n</tool_call> and '
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    assert parser.parse(text) == [ToolCall("a", {"x": 1}), ToolCall("b", '{"y": 2}')]
    assert parser.parse("no calls here") == []
    (bad,) = parser.parse('<tool_call>["a"]</tool_call>')
    assert bad.error is not None and "must be" in bad.error
    cut = parser.parse('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b", "argu')
    assert cut[0] == ToolCall("a", None)
    assert cut[1].error == "a <tool_call> was opened but never closed"
    (deep,) = parser.parse("<tool_call>" + "[" * 5000 + "</tool_call>")
    assert deep.error is not None and deep.error.startswith("the tool call is not valid JSON")


def test_llama3_parser_reads_sglangs_json_calls_after_the_python_tag():
    parser = Llama3Parser()
    first = '{"name": "search", "parameters": {"q": "a;b"}}'
    second = '{"name": "calculator", "arguments": {"expression": "6*7"}}'
    text = f"Let me look. <|python_tag|>{first}; {second}"
    assert parser.parse(text) == [
        ToolCall("search", {"q": "a;b"}), ToolCall("calculator", {"expression": "6*7"})
    ]  # fmt: skip
    assert parser.content(text) == "Let me look."
    # The tag is optional when the turn starts with the JSON; text after the calls is content.
    assert parser.parse(f" {first} and that is all") == [ToolCall("search", {"q": "a;b"})]
    assert parser.content(f" {first} and that is all") == "and that is all"
    # After the tag, a bad object is an error the model is told about, and stays content.
    cut = parser.parse(f"<|python_tag|>{first};" + '{"name": "calc')
    assert cut[0] == ToolCall("search", {"q": "a;b"}) and cut[1].error is not None
    assert cut[1].error.startswith("the tool call is not valid JSON")
    assert parser.content(f"<|python_tag|>{first};" + '{"name": "calc') == '{"name": "calc'
    (nameless,) = parser.parse('<|python_tag|>{"parameters": {}}')
    assert nameless.error is not None and "must be" in nameless.error
    # Without the tag, JSON that is not a call is an answer, not a failed call.
    assert parser.parse('{"answer": 42}') == [] and parser.content('{"answer": 42}') == (
        '{"answer": 42}'
    )
    assert parser.parse("no calls; {here}") == []


def test_the_parser_names_include_sglangs_llama3(capsys):
    from asyncrl.cli import main
    from asyncrl.rollout.workflows import tool_call_parser

    assert isinstance(tool_call_parser("llama3"), Llama3Parser)
    assert isinstance(tool_call_parser("qwen25"), HermesParser)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "llama3" in " ".join(capsys.readouterr().out.split())


def test_the_observation_delta_is_what_the_template_adds_after_the_turn(tokenizer):
    renderer = ObservationRenderer(tokenizer)
    messages = [{"role": "tool", "content": "7"}, {"role": "tool", "content": "8"}]
    closed = renderer.render(messages, turn_closed=True)
    expected = (
        "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>tool\n8<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(closed) == expected
    assert tokenizer.decode(renderer.render(messages, turn_closed=False)) == "<|im_end|>" + expected


async def test_a_turn_cut_at_the_per_turn_cap_still_runs_its_calls(tokenizer):
    text = call("6*7") + " and then some more words"
    n = len(tokenizer(call("6*7"), add_special_tokens=False)["input_ids"]) + 2
    engine = ScriptedEngine(tokenizer, [Step(text), Step("#### 42" + " and more words" * 40)])
    workflow = MultiTurn(MultiTurnConfig(max_tokens_per_turn=n))
    out = await workflow(context(tokenizer, engine), make_sample(tokenizer))
    # the cut turn held a call: it ran, and its observation opens with the end-of-turn token
    _, tool, last = out.spans
    tool_text = tokenizer.decode(out.response_tokens[tool.start : tool.end].tolist())
    assert tool_text.startswith("<|im_end|>\n<|im_start|>tool\n42")
    # the second turn, cut with no call in it, ends the episode truncated
    assert last.end - last.start == n
    assert (out.status, out.finish_reason) == (SampleStatus.TRUNCATED, "length")


#: Qwen2.5's way with tool messages (written out here; no model hub): consecutive tool
#: results share one user block, each wrapped in <tool_response> tags.
QWEN_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_the_observation_delta_follows_a_qwen_style_template(tokenizer):
    qwen = copy.deepcopy(tokenizer)
    qwen.chat_template = QWEN_STYLE_TEMPLATE
    messages = [{"role": "tool", "content": "7"}, {"role": "tool", "content": "8"}]
    delta = ObservationRenderer(qwen).render(messages, turn_closed=True)
    expected = (
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\n8\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert qwen.decode(delta) == expected
