"""Constrained decoding on the real model: JSON schemas, regexes and EBNF through the
engine, SGLang's ``/generate`` and the real ``openai`` client; the log-prob convention of a
constrained token; bad specs refused alone."""

from __future__ import annotations

import json
import random
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import pytest_asyncio
import torch

from asyncrl.engines.base import GenerateRequest, SamplingParams
from asyncrl.engines.server.app import EngineServer
from asyncrl.engines.torch.engine import TorchEngine
from asyncrl.errors import EngineError

pytestmark = pytest.mark.asyncio(loop_scope="module")
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(smollm2_dir: Path) -> AsyncIterator[EngineServer]:
    # Compact JSON (SGLang's --constrained-json-disable-any-whitespace): a 135M model
    # allowed any whitespace can pad with tabs until its token budget runs out.
    from asyncrl.rollout.workflows import tool_call_parser

    engine = TorchEngine.from_pretrained(str(smollm2_dir), json_any_whitespace=False)
    server = EngineServer(
        engine, served_model_name="m", tool_call_parser=tool_call_parser("hermes")
    )
    await server.start("127.0.0.1", 0)
    yield server
    await server.stop()


def chat_ids(engine: TorchEngine, text: str) -> list[int]:
    return list(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    ))  # fmt: skip


async def generate(engine: TorchEngine, rid: str, ids: list[int], **sampling: Any) -> Any:
    params = SamplingParams(**({"max_new_tokens": 160, "temperature": 0.7} | sampling))
    outs = [
        o async for o in engine.generate(GenerateRequest(rid=rid, input_ids=ids, sampling=params))
    ]
    return outs[-1]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema of 1-3 properties: bounded strings and integers, booleans, enums,
    short arrays, and (once) a nested object; a random subset required. Every value is
    bounded, so a whole reply fits the token budget (an unbounded integer may not)."""
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] if depth == 0 else [])
    props: dict[str, Any] = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(kinds)
        props[f"k{i}"] = {
            "string": {"type": "string", "maxLength": rng.randint(1, 10)},
            "integer": {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 999])},
            "boolean": {"type": "boolean"},
            "enum": {"enum": rng.sample(["red", "green", "blue", "yes", "no"], 2)},
            "array": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3},
            "object": random_schema(rng, 1) if kind == "object" else {},
        }[kind]
    required = rng.sample(sorted(props), rng.randint(0, len(props)))
    return {"type": "object", "properties": props, "required": required}


async def test_every_reply_under_a_json_schema_is_valid_json_for_that_schema(server):
    """A property over 12 random schemas, generated together: each reply ends by its own
    stop (the grammar allows only EOS once the value is whole) and validates."""
    engine: TorchEngine = server.engine  # type: ignore[assignment]
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(12)]
    ids = chat_ids(engine, "Reply with a JSON object.")
    import asyncio

    outs = await asyncio.gather(*(
        generate(engine, f"s{i}", ids, json_schema=json.dumps(s), sampling_seed=i)
        for i, s in enumerate(schemas)
    ))  # fmt: skip
    for schema, out in zip(schemas, outs, strict=True):
        text = engine.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        assert out.finish_reason.type == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


async def test_regex_and_ebnf_replies_match_their_pattern_whole(server):
    engine: TorchEngine = server.engine  # type: ignore[assignment]
    ids = chat_ids(engine, "Is 7 prime? Then give a number.")
    pattern = r"(yes|no), [0-9]{3}"
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    for seed in range(3):
        out = await generate(engine, f"re{seed}", ids, regex=pattern, sampling_seed=seed)
        assert re.fullmatch(pattern, engine.tokenizer.decode(out.output_ids, True))
        out = await generate(engine, f"eb{seed}", ids, ebnf=grammar, sampling_seed=seed)
        text = engine.tokenizer.decode(out.output_ids, True)
        assert re.fullmatch(r"The answer is [0-9]+\.", text) and out.finish_reason.type == "stop"


async def test_a_constrained_tokens_logprob_is_renormalised_over_what_the_grammar_allows(
    server,
):
    """SGLang's convention: ``log_softmax(z_masked / T)``, the disallowed tokens at -inf.
    Replayed with an HF forward and the same grammar, token by token; the unmasked
    ``log_softmax(z / T)`` differs, so the mask is what the engine reports."""
    import xgrammar as xgr

    engine: TorchEngine = server.engine  # type: ignore[assignment]
    ids, t = chat_ids(engine, "Give me a person as JSON."), 0.8
    out = await generate(engine, "lp", ids, json_schema=json.dumps(PERSON), temperature=t)
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids + out.output_ids])).logits[0].float()
    z = logits[len(ids) - 1 : -1] / t
    matcher = engine.grammars.matcher("json_schema", json.dumps(PERSON))
    bitmask = xgr.allocate_token_bitmask(len(z), z.shape[-1])
    for i, token in enumerate(out.output_ids):
        matcher.fill_next_token_bitmask(bitmask, i)
        assert matcher.accept_token(token)
    masked = z.clone()
    xgr.apply_token_bitmask_inplace(masked, bitmask)
    rows = torch.arange(len(z))
    tokens = torch.tensor(out.output_ids)
    want = torch.log_softmax(masked, -1)[rows, tokens]
    free = torch.log_softmax(z, -1)[rows, tokens]
    got = torch.tensor(out.logprobs)
    assert (got - want).abs().max() < 1e-4
    assert (got - free).abs().max() > 1e-2


async def test_a_free_request_is_untouched_by_constrained_neighbours(server):
    engine: TorchEngine = server.engine  # type: ignore[assignment]
    ids = chat_ids(engine, "Name three colours.")
    alone = await generate(engine, "alone", ids, temperature=0, max_new_tokens=24)
    import asyncio

    together = await asyncio.gather(
        generate(engine, "free", ids, temperature=0, max_new_tokens=24),
        *(generate(engine, f"c{i}", ids, regex="[a-z]{1,20}") for i in range(3)),
    )
    assert together[0].output_ids == alone.output_ids


@pytest.mark.parametrize(
    ("sampling", "match"),
    [
        ({"regex": "[a-"}, "invalid regex: Regex parsing error"),
        ({"json_schema": "{not json"}, "invalid json_schema: not JSON"),
        ({"json_schema": '{"type": "nonsense"}'}, 'invalid json_schema: Unsupported type "nonse'),
        ({"ebnf": "root ::= undefined"}, "invalid ebnf"),
        ({"structural_tag": "{}"}, "structural_tag is not supported by this engine"),
        ({"regex": "a+", "min_new_tokens": 2}, "min_new_tokens cannot be combined with a gram"),
    ],
)
async def test_a_bad_grammar_fails_alone_with_its_reason(server, sampling, match):
    engine: TorchEngine = server.engine  # type: ignore[assignment]
    with pytest.raises(EngineError, match=re.escape(match)):
        await generate(engine, "bad", [1, 2, 3], **sampling)
    ok = await generate(engine, "ok", [1, 2, 3], regex="[0-9]{2}")
    assert len(engine.tokenizer.decode(ok.output_ids, True)) == 2


async def test_structured_outputs_through_the_openai_client_and_sglang_generate(server):
    import openai

    from asyncrl.engines.client.sglang import SGLangClient

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    chat = {"model": "m", "messages": [{"role": "user", "content": "A person, as JSON."}]}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    reply = await client.chat.completions.create(**chat, response_format=fmt, max_tokens=96)
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    reply = await client.chat.completions.create(
        **chat, response_format={"type": "json_object"}, max_tokens=200, temperature=0
    )
    (choice,) = reply.choices  # {"type": "object"} bounds nothing: it may run to the limit
    content = choice.message.content
    assert (
        isinstance(json.loads(content), dict)
        if choice.finish_reason == "stop"
        else content[0] == "{"
    )
    done = await client.completions.create(
        model="m", prompt="Colour:", max_tokens=8, extra_body={"regex": "(red|blue)"}
    )
    assert done.choices[0].text in ("red", "blue")
    with pytest.raises(openai.BadRequestError, match="Only one of regex, json_schema"):
        await client.chat.completions.create(**chat, response_format=fmt, extra_body={"regex": "a"})
    await client.close()
    async with SGLangClient([server.url]) as sglang:
        result = await sglang.generate([1, 2, 3], {"regex": "[0-9]{4}", "max_new_tokens": 16})
    assert re.fullmatch("[0-9]{4}", server.engine.tokenizer.decode(result.output_ids, True))


async def test_training_rollouts_refuse_a_grammar_and_say_why():
    """The trainer recomputes unmasked log-probs (docs/numerics.md): a constrained
    training rollout would be corrected against a policy it never sampled from."""
    from pydantic import ValidationError

    from asyncrl.rollout.config import EvalSetConfig, RolloutConfig

    for key, spec in (("json_schema", "{}"), ("regex", "a+"), ("ebnf", 'root ::= "a"')):
        with pytest.raises(ValidationError, match=f"rollout.sampling sets {key}.*a grammar's"):
            RolloutConfig(sampling={"max_new_tokens": 8, key: spec})
    held_out = EvalSetConfig(name="json", path="x.jsonl", sampling={"json_schema": "{}"})
    assert held_out.sampling == {"json_schema": "{}"}  # an eval set may constrain


def tool(name: str, **properties: Any) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": sorted(properties)}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


async def test_a_forced_tool_choice_always_returns_a_call_of_that_tool(server):
    """``required`` gives a call of an offered tool, a named choice a call of that one,
    its arguments valid for the tool's schema, whole and streamed."""
    import openai

    tools = [
        tool("calculator", expression={"type": "string", "maxLength": 16}),
        tool("weather", city={"enum": ["Paris", "Oslo"]}, days={"type": "integer", "maximum": 9}),
    ]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    chat = {"model": "m", "messages": [{"role": "user", "content": "What is 6 times 7?"}]}
    named = {"type": "function", "function": {"name": "weather"}}
    for choice, names in (("required", set(schemas)), (named, {"weather"})):
        for seed in range(3):
            reply = await client.chat.completions.create(
                **chat, tools=tools, tool_choice=choice, max_tokens=80, seed=seed
            )
            (out,) = reply.choices
            assert out.finish_reason == "tool_calls", out
            (call,) = out.message.tool_calls
            assert call.function.name in names
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    stream = await client.chat.completions.create(
        **chat, tools=tools, tool_choice=named, max_tokens=80, stream=True
    )
    deltas = [c.choices[0].delta async for c in stream if c.choices]
    heads = [t for d in deltas for t in d.tool_calls or () if t.function.name]
    assert [t.function.name for t in heads] == ["weather"]
    with pytest.raises(openai.BadRequestError, match="tool_choice 'required' needs tools"):
        await client.chat.completions.create(**chat, tool_choice="required", max_tokens=4)
    await client.close()


async def test_a_request_whose_grammar_compiles_can_be_aborted_and_paused(server, monkeypatch):
    """The request is registered while its grammar compiles in a thread: abort by rid
    finds it, and a pause that aborts returns once it ended, not never."""
    import asyncio
    import time

    engine: TorchEngine = server.engine  # type: ignore[assignment]
    compile_ = engine.grammars.matcher

    def slow(kind: str, spec: str) -> Any:
        time.sleep(0.5)
        return compile_(kind, spec)

    monkeypatch.setattr(engine.grammars, "matcher", slow)
    call = asyncio.create_task(generate(engine, "slow-1", [1, 2, 3], regex="[0-9]{9}"))
    await asyncio.sleep(0.1)
    assert engine.abort("slow-1") == 1
    assert (await call).finish_reason.type == "abort"
    call = asyncio.create_task(generate(engine, "slow-2", [1, 2, 3], regex="[0-9]{9}"))
    await asyncio.sleep(0.1)
    await asyncio.wait_for(engine.pause("abort"), timeout=10)
    await engine.resume()
    assert (await call).finish_reason.type == "abort"


async def test_a_forced_call_of_a_tool_with_defs_compiles():
    """pydantic's tool schemas keep their types under ``$defs``: they resolve at the
    call's root, and several tools are one grammar."""
    import xgrammar as xgr

    from asyncrl.engines.server.tool_stream import forced_call_grammar
    from asyncrl.rollout.multi_turn import HermesParser

    loc = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    params = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Loc"}},
              "required": ["at"], "$defs": {"Loc": loc}}  # fmt: skip
    tools = [tool("plain", x={"type": "integer"}),
             {"type": "function", "function": {"name": "where", "parameters": params}}]  # fmt: skip
    grammar = forced_call_grammar({"tools": tools, "tool_choice": "required"}, HermesParser())
    accepts = xgr.testing._is_grammar_accept_string  # xgrammar's own test helper
    assert grammar is not None

    def call(body: str) -> str:
        return f"<tool_call>{body}</tool_call>"

    # compact JSON, as any_whitespace=False writes it: ", " and ": " between items
    assert accepts(grammar, call('{"name": "where", "arguments": {"at": {"city": "Oslo"}}}'))
    assert accepts(grammar, call('{"name": "plain", "arguments": {"x": 3}}'))
    assert not accepts(grammar, call('{"name": "where", "arguments": {"at": 3}}'))
