"""The SGLang-compatible HTTP server over real HTTP on 127.0.0.1, with the tiny Qwen2.

One server (``EngineServer`` in this process) serves the module; each test checks the
golden shapes of ``docs/sglang_api.md`` (key sets and types, not values), the abort
and pause guarantees of section 5, weight updates, refusals, and the OpenAI routes. The
distributed weight update runs ``asyncrl serve`` as a subprocess, because this process
is the trainer's rank 0 and torch.distributed allows one default group per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import re
import socket
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from asyncrl.cli import main
from asyncrl.engines.base import GenerateRequest, SamplingParams
from asyncrl.engines.client.sglang import EngineUnavailable, SGLangClient, SGLangError
from asyncrl.engines.server.app import EngineServer
from asyncrl.engines.server.in_process import InProcessGenerator
from asyncrl.engines.torch.engine import TorchEngine
from tests.tiny_model import build_tiny_model

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 480, "ignore_eos": True}
PROMPT = [5, 9, 11, 40, 41]
META_FINAL = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "weight_versions",
    "e2e_latency",
    "response_sent_to_client_ts",
}
LOGPROB_KEYS = {"input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"}
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    build_tiny_model(directory)
    return directory


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny_seed1")
    build_tiny_model(directory, seed=1)
    return directory


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(model_dir: Path) -> AsyncIterator[EngineServer]:
    server = EngineServer(TorchEngine.from_pretrained(str(model_dir)))
    await server.start("127.0.0.1", 0)
    yield server
    await server.stop()


@pytest.fixture(scope="module")
def url(served: EngineServer) -> str:
    return served.url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def call(
    http: aiohttp.ClientSession,
    url: str,
    path: str,
    body: Any = None,
    *,
    method: str = "POST",
    raw: bytes | None = None,
) -> tuple[int, Any]:
    """One request; JSON replies decoded, anything else as text."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    async with http.request(method, url + path, data=data) as resp:
        text = await resp.text()
        if resp.content_type == "application/json":
            return resp.status, json.loads(text)
        return resp.status, text


async def generate(http: aiohttp.ClientSession, url: str, **body: Any) -> Any:
    status, reply = await call(http, url, "/generate", body)
    assert status == 200, reply
    return reply


async def wait_running(http: aiohttp.ClientSession, url: str, count: int = 1) -> None:
    """Until the engine runs ``count`` requests (they have started decoding)."""
    for _ in range(500):
        _, loads = await call(http, url, "/v1/loads", method="GET")
        if loads["loads"][0]["num_running_reqs"] >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"fewer than {count} requests running")


def check_output(out: dict[str, Any], *, logprobs: bool = False) -> None:
    """The section 1.3 shape of a final output."""
    assert set(out) >= {"text", "output_ids", "meta_info"} and isinstance(out["text"], str)
    meta, ids = out["meta_info"], out["output_ids"]
    assert set(meta) == META_FINAL | (LOGPROB_KEYS if logprobs else set())
    assert all(isinstance(t, int) for t in ids) and meta["completion_tokens"] == len(ids)
    assert isinstance(meta["weight_version"], str) and isinstance(meta["e2e_latency"], float)
    assert meta["weight_versions"][0]["start"] == 0 and meta["weight_versions"][-1]["end"] == len(
        ids
    )
    if logprobs:
        triples = meta["output_token_logprobs"]
        assert [t[1] for t in triples] == ids and meta["output_token_logprobs_length"] == len(ids)
        assert all(isinstance(lp, float) and text is None for lp, _, text in triples)


def sse_events(raw: str) -> list[str]:
    """Split an SSE body, checking the framing: only ``data: `` events and blank lines."""
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), raw[:500]
    return [e.removeprefix("data: ") for e in events]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------- discovery


async def _server_info_fits_sglangs(http, url) -> None:
    """Every SGLang server arg our ``/server_info`` reports has the type SGLang 0.5.23
    declares for it, and what the router and slime read is there."""
    from tests.sglang_types import fits, server_arg_fields

    _, info = await call(http, url, "/server_info", method="GET")
    declared = server_arg_fields()
    assert len(declared) > 400  # the parse found ServerArgs, not an empty folder
    read = {"model_path", "dp_size", "tp_size", "pp_size", "disaggregation_mode",
            "encoder_only", "context_length", "page_size"}  # fmt: skip
    assert read <= set(info) & set(declared)
    checked = {k: declared[k] for k in info if k in declared and declared[k] != "None"}
    wrong = {k: (info[k], a) for k, a in checked.items() if not fits(info[k], a)}
    assert not wrong, wrong
    assert len(checked) >= 20, sorted(checked)


async def test_discovery_endpoints_answer_with_sglangs_shapes(http, url):
    from tests.sglang_types import api_types

    for path in ("/health", "/health_generate", "/ready", "/ping"):
        assert await call(http, url, path, method="GET") == (200, "")
    assert await call(http, url, "/ping") == (200, "")  # POST too, as SageMaker's
    for path in ("/get_weight_version", "/weight_version"):
        status, reply = await call(http, url, path, method="GET")
        assert status == 200 and isinstance(reply["weight_version"], str)
    for path in ("/get_model_info", "/model_info"):
        _, info = await call(http, url, path, method="GET")
        assert {"model_path", "tokenizer_path", "is_generation", "weight_version"} <= set(info)
        assert info["architectures"] == ["Qwen2ForCausalLM"]
        api_types().GetModelInfoResponse.from_json_value(info)
    for path in ("/get_server_info", "/server_info"):
        _, info = await call(http, url, path, method="GET")
        assert {
            "model_path",
            "tokenizer_path",
            "dp_size",
            "tp_size",
            "version",
            "max_total_num_tokens",
            "max_req_input_len",
            "context_length",
        } <= set(info)
        assert isinstance(info["internal_states"], list) and info["port"] == int(url[-5:])
        api_types().GetServerInfoResponse.from_json_value(info)  # SGLang 0.5.23's contract
        assert info["max_context_length"] == info["context_length"]
    _, models = await call(http, url, "/v1/models", method="GET")
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    await _server_info_fits_sglangs(http, url)
    _, loads = await call(http, url, "/v1/loads?include=core", method="GET")
    assert {"num_running_reqs", "num_waiting_reqs"} <= set(loads["loads"][0])
    _, legacy = await call(http, url, "/get_load", method="GET")
    assert set(legacy[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    assert isinstance((await call(http, url, "/version", method="GET"))[1]["version"], str)
    for method in ("GET", "POST"):
        async with http.request(method, url + "/flush_cache") as resp:
            assert resp.status == 200 and resp.content_type == "text/plain"
            assert (await resp.text()).startswith("Cache flushed.")


async def test_health_is_503_until_the_warm_up_generation_is_done(model_dir):
    engine = TorchEngine.from_pretrained(str(model_dir))
    await engine.pause("in_place")  # holds the warm-up generation
    server = EngineServer(engine)
    url = await server.start(wait_ready=False)
    try:
        async with aiohttp.ClientSession() as session:
            assert (await call(session, url, "/health", method="GET"))[0] == 503
            await engine.resume()
            for _ in range(200):
                if (await call(session, url, "/health", method="GET"))[0] == 200:
                    break
                await asyncio.sleep(0.02)
            assert (await call(session, url, "/health", method="GET"))[0] == 200
    finally:
        await server.stop()


async def test_a_request_aborted_in_the_waiting_queue_has_no_prompt_tokens(model_dir):
    server = EngineServer(TorchEngine.from_pretrained(str(model_dir), max_running=1))
    url = await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            running = asyncio.create_task(
                call(session, url, "/generate", {"input_ids": PROMPT, "sampling_params": LONG})
            )
            await wait_running(session, url)
            queued = asyncio.create_task(
                call(session, url, "/generate", {"input_ids": [1], "rid": "q", "stream": True})
            )
            for _ in range(200):  # until the engine holds it in its waiting queue
                _, loads = await call(session, url, "/v1/loads", method="GET")
                if loads["loads"][0]["num_waiting_reqs"]:
                    break
                await asyncio.sleep(0.01)
            assert await call(session, url, "/abort_request", {"abort_all": True}) == (200, "")
            status, text = await queued
            final = json.loads(sse_events(text)[-2])
            assert status == 200 and (await running)[0] == 200
    finally:
        await server.stop()
    meta = final["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in meta and "cached_tokens" not in meta
    assert final["output_ids"] == [] and meta["completion_tokens"] == 0


# ----------------------------------------------------------------------------- /generate


async def test_generate_returns_the_native_shape_with_logprob_triples(http, url):
    out = await generate(
        http,
        url,
        input_ids=PROMPT,
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=0,
        rid="shape",
        model=None,
        log_metrics=True,
        background=False,
    )
    check_output(out, logprobs=True)
    meta = out["meta_info"]
    assert meta["id"] == "shape" and meta["prompt_tokens"] == len(PROMPT)
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    inputs = meta["input_token_logprobs"]
    assert [t[1] for t in inputs] == PROMPT and inputs[0][0] is None
    assert all(isinstance(t[0], float) for t in inputs[1:])
    by_text = await generate(http, url, text="hello world", sampling_params=GREEDY)
    check_output(by_text)
    assert by_text["meta_info"]["prompt_tokens"] > 0
    again = await generate(http, url, input_ids=PROMPT, sampling_params=GREEDY, stream=False)
    assert again["output_ids"] == out["output_ids"]  # greedy is deterministic
    scored = await generate(http, url, input_ids=PROMPT, sampling_params={"max_new_tokens": 0},
                            return_logprob=True, logprob_start_len=0)  # fmt: skip
    assert scored["output_ids"] == [] and scored["meta_info"]["input_token_logprobs"] == inputs


async def test_echo_with_logprobs_scores_the_prompt_as_sglangs_completions_do(http, url):
    """``/v1/completions`` with ``echo`` and ``logprobs``: every prompt token, then every
    completion token (the first prompt token's log-prob is null); the prompt's are
    ``/generate``'s ``input_token_logprobs``, whole and streamed, through the real client."""
    import openai

    scored = await generate(http, url, input_ids=PROMPT, sampling_params={"max_new_tokens": 0},
                            return_logprob=True, logprob_start_len=0)  # fmt: skip
    inputs = [t[0] for t in scored["meta_info"]["input_token_logprobs"]]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    ask = {"model": "m", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True}
    whole = (await client.completions.create(**ask, logprobs=2)).choices[0].logprobs
    assert len(whole.tokens) == len(PROMPT) + 3 == len(whole.token_logprobs)
    assert whole.token_logprobs[: len(PROMPT)] == inputs and inputs[0] is None
    assert whole.top_logprobs[0] is None and len(whole.top_logprobs[1]) == 2
    chunks = [c async for c in await client.completions.create(**ask, logprobs=0, stream=True)]
    streamed = [
        x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == whole.token_logprobs
    plain = (await client.completions.create(**{**ask, "echo": False}, logprobs=0)).choices[0]
    assert plain.logprobs.token_logprobs == whole.token_logprobs[len(PROMPT) :]
    await client.close()


async def test_tokenize_and_detokenize_round_trip_in_sglangs_shapes(http, url, served):
    tokenizer = served.engine.tokenizer
    for path in ("/tokenize", "/v1/tokenize"):
        status, one = await call(http, url, path, {"prompt": "hello world"})
        assert status == 200 and one["tokens"] == tokenizer.encode("hello world")
        assert one["count"] == len(one["tokens"]) and one["max_model_len"] == 512
    _, two = await call(http, url, "/tokenize", {"prompt": ["a b", "c"], "model": "m"})
    assert two["count"] == [len(t) for t in two["tokens"]] and len(two["tokens"]) == 2
    _, back = await call(http, url, "/detokenize", {"tokens": one["tokens"]})
    assert back == {"text": "hello world"}
    _, back = await call(http, url, "/v1/detokenize", {"tokens": two["tokens"]})
    assert back == {"text": ["a b", "c"]}
    for path, body, needle in (
        ("/tokenize", {"prompt": 5}, "prompt: expected a string"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "expected a boolean"),
        ("/detokenize", {"tokens": [1, -2]}, "expected a list of token ids"),
        ("/detokenize", {"tokens": [10**9]}, "ids must be in [0,"),
    ):
        status, reply = await call(http, url, path, body)
        assert status == 400 and needle in json.dumps(reply), reply


async def test_a_model_is_retrieved_by_its_served_name_or_is_a_404(http, url, served):
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    card = await client.models.retrieve(served.served_model_name)
    assert card.id == served.served_model_name and card.owned_by == "sglang"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await client.models.retrieve("other")
    await client.close()


async def test_a_batch_and_n_samples_answer_with_a_list_of_expanded_rids(http, url):
    batch = await generate(
        http, url, text=["a b", "c d"], rid="b", sampling_params={"max_new_tokens": 3, "n": 2}
    )
    assert [o["meta_info"]["id"] for o in batch] == ["b_0", "b_1", "b_2", "b_3"]
    for out in batch:
        check_output(out)
    ids_batch = await generate(
        http,
        url,
        input_ids=[PROMPT, [7, 8]],
        sampling_params=[GREEDY, {"max_new_tokens": 2}],
        return_logprob=[True, False],
    )
    assert [len(o["output_ids"]) for o in ids_batch] == [8, 2]
    check_output(ids_batch[0], logprobs=True)
    check_output(ids_batch[1])
    samples = await generate(
        http, url, input_ids=PROMPT, rid="s", sampling_params={"max_new_tokens": 2, "n": 2}
    )
    assert [o["meta_info"]["id"] for o in samples] == ["s_0", "s_1"]


async def test_a_stream_sends_cumulative_data_events_and_ends_with_done(http, url):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {**GREEDY, "max_new_tokens": 40},
        "stream": True,
        "return_logprob": True,
    }
    async with http.post(url + "/generate", json=body) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    for before, after in itertools.pairwise(chunks):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    check_output(chunks[-1], logprobs=True)
    assert len(chunks[-1]["output_ids"]) == 40
    plain = await generate(http, url, **{**body, "stream": False})
    assert plain["output_ids"] == chunks[-1]["output_ids"]
    batch = {**body, "input_ids": [PROMPT, PROMPT], "sampling_params": GREEDY}
    async with http.post(url + "/generate", json=batch) as resp:
        chunks = [json.loads(e) for e in sse_events(await resp.text())[:-1]]
    assert {c["index"] for c in chunks} == {0, 1}


async def test_stop_tokens_and_strings_are_trimmed_from_text_unless_no_stop_trim(http, url):
    free = await generate(
        http, url, input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 24}
    )
    ids = free["output_ids"]
    k = next(i for i in range(3, len(ids)) if ids[i] > 3 and ids[i] not in ids[:i])
    stop = {**GREEDY, "max_new_tokens": 24, "stop_token_ids": [ids[k]]}
    trimmed = await generate(http, url, input_ids=PROMPT, sampling_params=stop)
    kept = await generate(
        http, url, input_ids=PROMPT, sampling_params={**stop, "no_stop_trim": True}
    )
    assert trimmed["output_ids"] == kept["output_ids"] == ids[: k + 1]
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    assert kept["text"].startswith(trimmed["text"]) and len(kept["text"]) > len(trimmed["text"])
    word = free["text"][len(free["text"]) // 2 :][:3]
    by_word = await generate(
        http, url, input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 24, "stop": word}
    )
    assert by_word["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert word not in by_word["text"] and free["text"].startswith(by_word["text"])


def middle_pattern(text: str) -> str:
    """A regex matching three characters from the middle of ``text`` (any middle one)."""
    word = text[len(text) // 2 :][:3]
    return re.escape(word[0]) + r"[\s\S]" + re.escape(word[2])


async def test_stop_regex_stops_generation_and_keeps_the_match_as_sglang_does(http, url):
    """SGLang's ``trim_matched_stop`` looks for ``matched``, the pattern, literally: a
    regex match stays in the text (a stop string is cut)."""
    sampling = {**GREEDY, "max_new_tokens": 24}
    free = await generate(http, url, input_ids=PROMPT, sampling_params=sampling)
    pattern = middle_pattern(free["text"])
    stop = {**sampling, "stop_regex": pattern}
    trimmed = await generate(http, url, input_ids=PROMPT, sampling_params=stop)
    kept = await generate(
        http, url, input_ids=PROMPT, sampling_params={**stop, "no_stop_trim": True}
    )
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    ids = trimmed["output_ids"]
    assert ids == kept["output_ids"] == free["output_ids"][: len(ids)] and len(ids) < 24
    assert re.search(pattern, trimmed["text"]) and trimmed["text"] == kept["text"]
    assert free["text"].startswith(trimmed["text"])


async def test_top_logprobs_num_adds_sglangs_top_triples_for_output_and_prompt(http, url):
    out = await generate(
        http, url, input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True,
        logprob_start_len=0, top_logprobs_num=3, return_text_in_logprobs=True,
    )  # fmt: skip
    meta = out["meta_info"]
    assert set(meta) == META_FINAL | LOGPROB_KEYS | {"input_top_logprobs", "output_top_logprobs"}
    outputs, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(tops) == len(out["output_ids"]) == 8
    for (logprob, token, text), row in zip(outputs, tops, strict=True):
        assert len(row) == 3 and all(isinstance(t, str) for _, _, t in row)
        assert [r[0] for r in row] == sorted((r[0] for r in row), reverse=True)
        assert row[0][:3] == [pytest.approx(logprob), token, text]  # greedy: the top one
    inputs = meta["input_top_logprobs"]
    assert len(inputs) == len(PROMPT) and inputs[0] is None
    for (logprob, token, _), row in zip(meta["input_token_logprobs"][1:], inputs[1:], strict=True):
        assert len(row) == 3 and logprob <= row[0][0] + 1e-6
        assert all(r[0] == pytest.approx(logprob) for r in row if r[1] == token)
    sampled = await generate(
        http, url, input_ids=PROMPT, return_logprob=True, top_logprobs_num=3,
        sampling_params={"top_k": 2, "max_new_tokens": 6, "sampling_seed": 1, "ignore_eos": True},
    )  # fmt: skip
    meta = sampled["meta_info"]
    assert meta["input_top_logprobs"] == []  # logprob_start_len -1: output only
    for (logprob, token, _), row in zip(
        meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True
    ):
        # SGLang's convention: log-probs of the full vocabulary before top-k truncation,
        # so the third is finite and the two kept ones hold less than all the mass; the
        # sampled token is one of the two kept.
        assert row[2][0] is not None and row[2][0] <= row[1][0]
        assert math.fsum(math.exp(r[0]) for r in row[:2]) < 1.0
        assert [pytest.approx(logprob), token] in [r[:2] for r in row[:2]]
    plain = await generate(http, url, input_ids=PROMPT, sampling_params=GREEDY, top_logprobs_num=3)
    assert "output_top_logprobs" not in plain["meta_info"]  # only with return_logprob


async def test_stream_interval_sends_an_event_per_interval_of_new_tokens(http, url):
    async def lengths(**sampling: Any) -> list[int]:
        params = {**GREEDY, "max_new_tokens": 24, **sampling}
        body = {"input_ids": PROMPT, "sampling_params": params, "stream": True}
        async with http.post(url + "/generate", json=body) as resp:
            return [len(json.loads(e)["output_ids"]) for e in sse_events(await resp.text())[:-1]]

    every, spaced = await lengths(), await lengths(stream_interval=8)
    assert every[-1] == spaced[-1] == 24 and len(every) > 4
    assert len(spaced) <= 4  # SGLang sends tokens 1, 9, 17 and the final 24
    assert all(b - a >= 8 for a, b in itertools.pairwise(spaced[:-1]))


async def test_cached_tokens_counts_the_prompt_tokens_the_prompt_cache_served(http, url):
    assert (await call(http, url, "/flush_cache", method="POST"))[0] == 200
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 6}}
    async with http.post(url + "/generate", json={**body, "stream": True}) as resp:
        chunks = [json.loads(e) for e in sse_events(await resp.text())[:-1]]
    assert [c["meta_info"]["cached_tokens"] for c in chunks] == [0] * len(chunks)
    partial = chunks[-1]["output_ids"]
    again = await generate(http, url, input_ids=PROMPT, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == len(PROMPT) - 1  # a group's next sample
    assert again["output_ids"][: len(partial)] == partial
    resumed = await generate(http, url, input_ids=PROMPT + partial, sampling_params=GREEDY)
    assert resumed["meta_info"]["prompt_tokens"] == len(PROMPT) + len(partial)
    assert resumed["meta_info"]["cached_tokens"] == 0  # another prompt: computed


async def test_an_abort_mid_generation_answers_200_with_the_partial_output(http, url):
    body = {
        "input_ids": PROMPT,
        "sampling_params": LONG,
        "return_logprob": True,
        "rid": "long-abort",
    }
    task = asyncio.create_task(call(http, url, "/generate", body))
    await wait_running(http, url)
    await asyncio.sleep(0.1)
    # SGLang aborts a live rid only: a bare prefix of it aborts nothing.
    assert await call(http, url, "/abort_request", {"rid": "long-ab"}) == (200, "")
    await asyncio.sleep(0.05)
    assert not task.done()
    assert await call(http, url, "/abort_request", {"rid": "long-abort"}) == (200, "")
    status, out = await task
    assert status == 200 and out["meta_info"]["finish_reason"] == ABORTED
    check_output(out, logprobs=True)
    assert 0 < len(out["output_ids"]) < 480
    assert await call(http, url, "/abort_request", {}) == (200, "")  # nothing to do: still 200


async def test_a_client_that_goes_away_has_its_request_aborted(http, url):
    body = {"input_ids": PROMPT, "sampling_params": LONG, "stream": True}
    async with http.post(url + "/generate", json=body) as resp:
        await resp.content.readline()
        await wait_running(http, url)
        resp.close()
    for _ in range(200):
        _, loads = await call(http, url, "/v1/loads", method="GET")
        if loads["loads"][0]["num_running_reqs"] == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the abandoned request is still running")


async def test_pause_abort_returns_after_every_call_is_answered_and_holds_new_ones(http, url):
    tasks = [
        asyncio.create_task(
            call(http, url, "/generate", {"input_ids": [*PROMPT, i], "sampling_params": LONG})
        )
        for i in range(3)
    ]
    await wait_running(http, url, 3)
    assert await call(http, url, "/pause_generation", {}) == (
        200,
        {"message": "Generation paused successfully.", "status": "ok"},
    )
    _, loads = await call(http, url, "/v1/loads", method="GET")
    assert loads["loads"][0]["num_running_reqs"] == loads["loads"][0]["num_waiting_reqs"] == 0
    done = await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert all(s == 200 and o["meta_info"]["finish_reason"] == ABORTED for s, o in done)
    assert (await call(http, url, "/ready", method="GET"))[0] == 503
    held = asyncio.create_task(generate(http, url, input_ids=PROMPT, sampling_params=GREEDY))
    await asyncio.sleep(0.3)
    assert not held.done()
    assert await call(http, url, "/continue_generation", {}) == (
        200,
        {"message": "Generation continued successfully.", "status": "ok"},
    )
    out = await asyncio.wait_for(held, 10)
    assert out["meta_info"]["finish_reason"]["type"] == "length"


async def test_a_duplicate_in_flight_rid_is_refused_and_the_first_call_goes_on(http, url):
    first = asyncio.create_task(
        call(
            http,
            url,
            "/generate",
            {"input_ids": PROMPT, "sampling_params": {**LONG, "max_new_tokens": 200}, "rid": "dup"},
        )
    )
    await wait_running(http, url)
    status, reply = await call(http, url, "/generate", {"input_ids": [1], "rid": "dup"})
    assert status == 400 and "Duplicate request ID" in reply["error"]["message"]
    status, text = await call(http, url, "/flush_cache", method="GET")
    assert status == 400 and "running" in text  # refused while requests run, as SGLang
    status, out = await first
    assert status == 200 and len(out["output_ids"]) == 200


@pytest.mark.parametrize(
    ("body", "raw", "needle"),
    [
        ({"input_ids": [1], "sampling_params": {"max_tokens": 3}}, None, "unknown field `max_"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1.5}}, None, "max_new_tokens"),
        ({"input_ids": [1, 2.5]}, None, "must be integers"),
        ({"input_ids": [1, -3]}, None, "must be integers"),
        ({"input_ids": [1, 99999]}, None, "must be integers"),
        ({"input_ids": []}, None, "empty"),
        ({"text": ""}, None, "empty"),
        ({"input_ids": list(range(1, 500)) * 2}, None, "context length"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, None, "top_p"),
        ({"input_ids": [1], "text": "x"}, None, "exactly one"),
        ({"input_ids": [1], "stream": "yes"}, None, "stream"),
        ({"input_ids": [1], "sampling_params": {"regex": "a", "ebnf": "r"}}, None, "Only one of"),
        (None, b"{not json", "not valid JSON"),
        (None, b"[1, 2]", "JSON object"),
        ({"input_ids": [1, 2], "logprob_start_len": 5, "return_logprob": True}, None, "prompt"),
        ({"input_ids": [1], "top_logprobs_num": -1}, None, "top_logprobs_num"),
        ({"input_ids": [1], "sampling_params": {"stop_regex": "("}}, None, "not a valid regex"),
        ({"input_ids": [1], "sampling_params": {"stream_interval": -2}}, None, "stream_interval"),
    ],
)
async def test_bad_requests_get_400_with_a_message_and_the_server_keeps_serving(
    http, url, body, raw, needle
):
    status, reply = await call(http, url, "/generate", body, raw=raw)
    assert status == 400
    error = reply.get("error", reply)
    message = error if isinstance(error, str) else error["message"]
    assert needle in message
    params = {"max_new_tokens": 2, "ignore_eos": True}  # a sampled EOS would end it at 1
    ok = await generate(http, url, input_ids=[1, 2], sampling_params=params)
    assert len(ok["output_ids"]) == 2


# ----------------------------------------------------------------------------- in process


async def test_an_in_process_generate_answers_as_http_does(url, served):
    local = InProcessGenerator([served])
    async with SGLangClient([url]) as over_http:
        a = await over_http.generate(PROMPT, GREEDY, rid="via-http")
        b = await local.generate(PROMPT, GREEDY, rid="in-process")
        assert (b.output_ids, b.logprobs, b.finish_reason) == (
            a.output_ids, a.logprobs, a.finish_reason,
        )  # fmt: skip
        assert len(b.output_ids) == 8 and b.engine == url
        errors = []
        for generator in (over_http, local):  # refused by the server: one status, one message
            with pytest.raises(SGLangError) as caught:
                await generator.generate([1, 99999], GREEDY)
            errors.append((caught.value.status, caught.value.message))
        assert errors[0] == errors[1] and errors[1][0] == 400
        assert "must be integers" in errors[1][1]
        assert local.inflight() == {url: 0}


async def test_an_in_process_call_is_counted_aborted_by_rid_and_held_by_a_pause(http, url, served):
    local = InProcessGenerator([served])
    async with SGLangClient([url]) as control:
        task = asyncio.create_task(local.generate(PROMPT, LONG, rid="local-long"))
        await wait_running(http, url)
        assert local.inflight() == {url: 1}
        await control.abort("local-long")  # over HTTP, to the server the call is inside
        out = await asyncio.wait_for(task, 10)
        assert out.finish_reason.type == "abort" and 0 < len(out.output_ids) < 480
        assert local.inflight() == {url: 0}
        await control.pause()
        held = asyncio.create_task(local.generate(PROMPT, GREEDY))
        await asyncio.sleep(0.3)
        assert not held.done()
        await control.continue_()
        assert len((await asyncio.wait_for(held, 10)).output_ids) == 8


async def test_an_in_process_generator_spreads_calls_over_its_servers(model_dir, served, url):
    other = EngineServer(TorchEngine.from_pretrained(str(model_dir)))
    await other.start("127.0.0.1", 0)
    try:
        local = InProcessGenerator([served, other])
        outs = await asyncio.gather(*(local.generate(PROMPT, GREEDY) for _ in range(4)))
        assert sorted(o.engine for o in outs) == sorted([url, other.url] * 2)
        assert {tuple(o.output_ids) for o in outs} == {tuple(outs[0].output_ids)}
    finally:
        await other.stop()


async def test_an_in_process_call_to_a_stopped_server_fails_at_once(model_dir):
    stopped = EngineServer(TorchEngine.from_pretrained(str(model_dir)))
    await stopped.start("127.0.0.1", 0)
    await stopped.stop()
    local = InProcessGenerator([stopped])
    with pytest.raises(EngineUnavailable, match="not running"):
        await local.generate(PROMPT, GREEDY)
    assert local.inflight() == {stopped.url: 0}


async def test_an_in_process_call_held_by_a_pause_is_refused_when_the_server_stops(model_dir):
    closing = EngineServer(TorchEngine.from_pretrained(str(model_dir)))
    await closing.start("127.0.0.1", 0)
    local = InProcessGenerator([closing])
    async with SGLangClient([closing.url]) as control:
        await control.pause()
    held = asyncio.create_task(local.generate(PROMPT, GREEDY))
    await asyncio.sleep(0.2)
    assert not held.done()
    await closing.stop()  # over HTTP the port closes; in process the gate refuses
    with pytest.raises(EngineUnavailable, match="shutting down"):
        await asyncio.wait_for(held, 10)
    assert local.inflight() == {closing.url: 0}


async def test_an_in_process_call_open_when_the_engine_stops_is_lost_not_held(model_dir):
    closing = EngineServer(TorchEngine.from_pretrained(str(model_dir)))
    await closing.start("127.0.0.1", 0)
    local = InProcessGenerator([closing])
    await closing.engine.pause()  # past the server's gate, held inside the engine
    held = asyncio.create_task(local.generate(PROMPT, GREEDY))
    await asyncio.sleep(0.2)
    assert not held.done() and closing.gate.calls == 1
    await closing.stop()  # no shutdown abort reaches it: the engine never saw it
    with pytest.raises(EngineUnavailable, match=r"lost: .*stopped mid-call"):
        await asyncio.wait_for(held, 10)  # accepted once, so not made again
    assert local.inflight() == {closing.url: 0}


async def test_an_engine_that_fails_ends_its_open_calls_and_refuses_new_ones(model_dir):
    engine = TorchEngine.from_pretrained(str(model_dir))
    fail, serve = asyncio.Event(), engine.run

    async def run_until_it_fails() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(serve())
            await fail.wait()
            raise RuntimeError("engine step blew up")

    engine.run = run_until_it_fails  # type: ignore[method-assign]
    server = EngineServer(engine)
    await server.start("127.0.0.1", 0)
    local = InProcessGenerator([server])
    try:
        await engine.pause()  # past the gate, held inside the engine
        held = asyncio.create_task(local.generate(PROMPT, GREEDY))
        await asyncio.sleep(0.2)
        fail.set()
        with pytest.raises(EngineUnavailable, match=r"lost: .*stopped mid-call"):
            await asyncio.wait_for(held, 10)
        assert server.gate.closed and not server.ready
        with pytest.raises(EngineUnavailable, match="not running"):
            await local.generate(PROMPT, GREEDY)
    finally:
        await server.stop()


async def test_an_in_process_call_past_its_timeout_raises_and_leaves_nothing_behind(url, served):
    local = InProcessGenerator([served], timeout_s=0.3)
    async with SGLangClient([url]) as control:
        await control.pause()  # held at the gate: past its timeout however fast the engine
        try:
            with pytest.raises(TimeoutError):
                await local.generate(PROMPT, GREEDY)
        finally:
            await control.continue_()
    assert local.inflight() == {url: 0} and served.gate.calls == 0
    assert len((await local.generate(PROMPT, GREEDY)).output_ids) == 8


# ----------------------------------------------------------------------------- weights, admin


async def test_update_weights_from_disk_changes_outputs_and_the_weight_version(
    http, url, model_dir, other_weights
):
    before = await generate(
        http, url, input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True
    )
    status, reply = await call(
        http,
        url,
        "/update_weights_from_disk",
        {
            "model_path": str(other_weights),
            "weight_version": "7",
            "flush_cache": True,
            "unknown": 1,
        },
    )
    assert status == 200 and reply["success"] is True and "7" in reply["message"]
    after = await generate(http, url, input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    assert (
        after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    )
    assert after["meta_info"]["weight_version"] == "7"
    assert after["meta_info"]["weight_versions"] == [{"version": "7", "start": 0, "end": 8}]
    assert (await call(http, url, "/get_weight_version", method="GET"))[1] == {
        "weight_version": "7"
    }
    for bad in (
        {"model_path": str(model_dir / "missing")},
        {"model_path": str(model_dir), "weight_version": True},
        {},
    ):
        status, reply = await call(http, url, "/update_weights_from_disk", bad)
        assert status == 400 and reply["success"] is False and reply["message"]
    # Any string names a version, as SGLang's weight_version is (the next int here).
    named = {"model_path": str(model_dir), "weight_version": "rollout-8"}
    status, reply = await call(http, url, "/update_weights_from_disk", named)
    assert status == 200 and reply["message"].endswith("Weight version updated to rollout-8.")
    assert (await call(http, url, "/get_weight_version", method="GET"))[1] == {
        "weight_version": "rollout-8"
    }
    out = await generate(http, url, input_ids=PROMPT, sampling_params=GREEDY)
    assert out["meta_info"]["weight_version"] == "rollout-8"
    assert out["meta_info"]["weight_versions"] == [{"version": "rollout-8", "start": 0, "end": 8}]
    await call(
        http, url, "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": 8}
    )
    restored = await generate(http, url, input_ids=PROMPT, sampling_params=GREEDY)
    assert restored["output_ids"] == before["output_ids"]
    assert restored["meta_info"]["weight_version"] == "8"


async def test_an_update_outside_a_pause_waits_for_in_flight_calls(http, url, model_dir):
    body = {"input_ids": PROMPT, "sampling_params": {**LONG, "max_new_tokens": 150}}
    running = asyncio.create_task(call(http, url, "/generate", body))
    await wait_running(http, url)
    status, _ = await call(
        http,
        url,
        "/update_weights_from_disk",
        {"model_path": str(model_dir), "weight_version": "20"},
    )
    assert status == 200 and running.done()  # SGLang's model-update lock
    _, out = running.result()
    assert (
        len(out["output_ids"]) == 150 and out["meta_info"]["weight_versions"][0]["version"] != "20"
    )


async def test_an_in_place_pause_and_update_splits_the_weight_version_spans(http, url, model_dir):
    body = {"input_ids": PROMPT, "sampling_params": {**LONG, "max_new_tokens": 120}, "stream": True}
    async with http.post(url + "/generate", json=body) as resp:
        await resp.content.readuntil(b"\n\n")
        assert (await call(http, url, "/pause_generation", {"mode": "in_place"}))[0] == 200
        status, reply = await call(
            http,
            url,
            "/update_weights_from_disk",
            {"model_path": str(model_dir), "weight_version": "30"},
        )
        assert status == 200, reply
        assert (await call(http, url, "/continue_generation", {}))[0] == 200
        final = json.loads(sse_events(await resp.text())[-2])
    spans = final["meta_info"]["weight_versions"]
    assert len(spans) == 2 and spans[1] == {"version": "30", "start": spans[0]["end"], "end": 120}


async def test_admin_routes_take_empty_bodies_and_answer_success_and_message(http, url):
    for path in ("/begin_weight_update", "/end_weight_update"):
        status, reply = await call(http, url, path)
        assert status == 200 and reply["success"] is True and isinstance(reply["message"], str)
    status, reply = await call(
        http, url, "/update_weight_version", {"new_version": "43", "abort_all_requests": True}
    )
    assert status == 200 and reply == {
        "success": True,
        "message": "Weight version updated to 43",
        "new_version": "43",
    }
    _, info = await call(http, url, "/model_info", method="GET")
    assert info["weight_version"] == "43"
    # SGLang's own default version is the string "default": any string names a version.
    status, reply = await call(http, url, "/update_weight_version", {"new_version": "default"})
    assert status == 200 and reply["new_version"] == "default"
    status, reply = await call(http, url, "/update_weight_version", {"new_version": ""})
    assert status == 400 and reply["success"] is False
    status, reply = await call(
        http, url, "/update_weights_from_tensor", {"serialized_named_tensors": ["gASV"]}
    )
    assert status == 400 and "cannot be read" in reply["message"]
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        assert await call(http, url, path) == (200, None)
        assert await call(http, url, path, {"tags": ["weights"]}) == (200, None)
    status, reply = await call(http, url, "/init_weights_update_group", {"master_port": "x"})
    assert status == 400 and reply["success"] is False
    status, reply = await call(
        http,
        url,
        "/update_weights_from_distributed",
        {"names": ["nope"], "dtypes": ["float32"], "shapes": [[1]]},
    )
    assert status == 400 and "init it first" in reply["message"]
    assert (await call(http, url, "/pause_generation", {"mode": "sideways"}))[0] == 400


async def test_destroying_an_unknown_weights_update_group_reports_failure(http, url):
    body = {"group_name": "never-joined"}
    status, reply = await call(http, url, "/destroy_weights_update_group", body)
    assert status == 400 and reply["success"] is False
    assert "does not exist" in reply["message"] and "never-joined" in reply["message"]


# ----------------------------------------------------------------------------- OpenAI routes


async def test_chat_completions_answer_with_the_openai_shapes(http, url):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "return_token_ids": True,
    }
    status, reply = await call(http, url, "/v1/chat/completions", body)
    assert status == 200 and reply["object"] == "chat.completion" and reply["model"] == "tiny"
    choice = reply["choices"][0]
    assert set(choice) >= {"index", "message", "logprobs", "finish_reason", "matched_stop"}
    assert choice["message"]["role"] == "assistant" and isinstance(
        choice["message"]["content"], str
    )
    assert len(choice["logprobs"]["content"]) == len(choice["response_token_ids"])
    assert set(choice["logprobs"]["content"][0]) == {"token", "bytes", "logprob", "top_logprobs"}
    assert reply["usage"]["total_tokens"] == reply["usage"]["prompt_tokens"] + len(
        choice["response_token_ids"]
    )
    assert isinstance(reply["metadata"]["weight_version"], str)
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    del stream["return_token_ids"]
    async with http.post(url + "/v1/chat/completions", json=stream) as resp:
        events = sse_events(await resp.text())
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == choice["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == reply["usage"]


async def test_completions_answer_with_the_openai_shapes_and_top_level_errors(http, url):
    body = {"prompt": "hello", "max_tokens": 4, "n": 2, "logprobs": 0, "temperature": 0}
    status, reply = await call(http, url, "/v1/completions", body)
    assert status == 200 and reply["object"] == "text_completion"
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    lps = reply["choices"][0]["logprobs"]
    assert set(lps) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert len(lps["tokens"]) == 4 and reply["usage"]["completion_tokens"] == 8
    ids = {"prompt": [[1, 2], [3]], "max_tokens": 2, "stream": True}
    async with http.post(url + "/v1/completions", json=ids) as resp:
        chunks = [json.loads(e) for e in sse_events(await resp.text())[:-1]]
    finished = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(c["index"] for c in finished) == [0, 1]
    for bad in ({"prompt": "x", "max_tokens": 0}, {"prompt": 5}, {"prompt": "x", "top_k": 0}):
        status, reply = await call(http, url, "/v1/completions", bad)
        assert status == 400 and reply["object"] == "error" and reply["code"] == 400
        assert reply["type"] == "BadRequestError" and reply["message"]
    status, reply = await call(http, url, "/v1/chat/completions", {"messages": []})
    assert status == 400 and reply["object"] == "error"


async def test_openai_routes_return_top_logprobs_and_honour_stop_regex(http, url):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "logprobs": True, "top_logprobs": 3}  # fmt: skip
    status, reply = await call(http, url, "/v1/chat/completions", chat)
    assert status == 200
    for entry in reply["choices"][0]["logprobs"]["content"]:
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and all(set(t) == {"token", "bytes", "logprob"} for t in tops)
        assert tops[0]["token"] == entry["token"]  # greedy: the chosen token is the top one
        assert tops[0]["logprob"] == pytest.approx(entry["logprob"])
    status, reply = await call(http, url, "/v1/chat/completions", {**chat, "logprobs": False})
    assert status == 400 and "top_logprobs needs logprobs" in reply["message"]
    completion = {"prompt": "hello", "max_tokens": 24, "temperature": 0, "logprobs": 2}
    status, reply = await call(http, url, "/v1/completions", completion)
    lps = reply["choices"][0]["logprobs"]
    assert len(lps["top_logprobs"]) == 24 and all(1 <= len(r) <= 2 for r in lps["top_logprobs"])
    async with http.post(url + "/v1/completions", json={**completion, "stream": True}) as resp:
        chunks = [json.loads(e) for e in sse_events(await resp.text())[:-1]]
    streamed = [row for c in chunks if c["choices"][0]["logprobs"]
                for row in c["choices"][0]["logprobs"]["top_logprobs"]]  # fmt: skip
    assert streamed == lps["top_logprobs"]
    pattern = middle_pattern(reply["choices"][0]["text"])
    body = {**completion, "stop_regex": pattern}
    status, stopped = await call(http, url, "/v1/completions", body)
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == pattern
    assert reply["choices"][0]["text"].startswith(choice["text"])
    assert re.search(pattern, choice["text"])  # kept, as SGLang keeps it


# ----------------------------------------------------------------------------- asyncrl serve


async def test_asyncrl_serve_refuses_a_non_loopback_host_without_a_key(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("ASYNCRL_API_KEY", raising=False)
    assert main(["serve", "--model", "/nowhere", "--host", "0.0.0.0"]) == 2
    assert "refusing to listen on 0.0.0.0 without --api-key" in capsys.readouterr().err
    # With a key the host is accepted; the missing model is what stops it now.
    assert main(["serve", "--model", "/nowhere", "--host", "0.0.0.0", "--api-key", "k"]) == 2
    assert "is not a model directory" in capsys.readouterr().err


async def test_with_an_api_key_every_route_but_health_needs_it(model_dir: Path):
    server = EngineServer(TorchEngine.from_pretrained(str(model_dir)), api_key="s3cret")
    url = await server.start("127.0.0.1", 0)
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/health") as resp:
                assert resp.status == 200  # liveness stays open for routers
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                async with http.post(f"{url}/generate", json=body, headers=headers) as resp:
                    assert resp.status == 401
                    assert "API key" in (await resp.json())["error"]["message"]
                async with http.post(f"{url}/update_weights_from_disk", json={"model_path": "/x"},
                                     headers=headers) as resp:  # fmt: skip
                    assert resp.status == 401
                async with http.get(f"{url}/v1/models", headers=headers) as resp:
                    assert resp.status == 401
                    assert (await resp.json())["type"] == "AuthenticationError"
            auth = {"Authorization": "Bearer s3cret"}
            async with http.post(f"{url}/generate", json=body, headers=auth) as resp:
                assert resp.status == 200 and len((await resp.json())["output_ids"]) == 2
        # The client sends the key when given it (SGLangTransport.Config.api_key).
        config = SGLangClient.Config(api_key="s3cret")
        async with SGLangClient([url], config=config) as client:
            assert (await client.transport.health()) == {url: True}
            assert await client.weight_version() == 0
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def serve_process(model_dir: Path, log: Path, *extra: str) -> AsyncIterator[str]:
    """``asyncrl serve`` on a free port; yields its URL once it printed it (warmed up)."""
    args = ["-c", "import sys; from asyncrl.cli import main; sys.exit(main())"]
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *args,
            "serve",
            "--model",
            str(model_dir),
            "--port",
            "0",
            "--weight-version",
            "3",
            *extra,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 90)
        assert b"ready on " in line, f"asyncrl serve did not start; see {log}"
        yield line.decode().split("ready on ")[1].strip()
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 20) == 0, f"unclean exit; see {log}"


async def test_asyncrl_serve_random_seed_fixes_the_draws_of_unseeded_requests(
    http, model_dir, tmp_path
):
    """``--random-seed`` (SGLang's flag) seeds the stream unseeded requests draw from:
    the server samples what an in-process engine with that seed samples."""
    body = {"input_ids": [[5, 9, 11], [20, 21]], "sampling_params": {"max_new_tokens": 12}}
    engine = TorchEngine.from_pretrained(str(model_dir), seed=5)
    task = asyncio.create_task(engine.run())
    try:
        expected = []
        for i, ids in enumerate(body["input_ids"]):
            request = GenerateRequest(rid=f"r{i}", input_ids=ids,
                                      sampling=SamplingParams(max_new_tokens=12))  # fmt: skip
            expected.append([o async for o in engine.generate(request)][-1].output_ids)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    async with serve_process(model_dir, tmp_path / "serve.log", "--random-seed", "5") as url:
        for ids, want in zip(body["input_ids"], expected, strict=True):
            status, reply = await call(http, url, "/generate", {**body, "input_ids": ids})
            assert status == 200 and reply["output_ids"] == want


async def test_a_distributed_update_over_gloo_reaches_an_asyncrl_serve_process(
    http, model_dir, other_weights, tmp_path
):
    """The job's path into a server: the trainer forms the group as rank 0 on its own
    store, the server joins it as SGLang does, and each bucket (a lone tensor, or several
    flattened into bytes) is announced over HTTP while the trainer broadcasts."""
    from datetime import timedelta

    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.rollout.server_group import server_buckets
    from asyncrl.weights.group import BroadcastGroup, serve_store
    from asyncrl.wire.blob import layout

    other = AutoModelForCausalLM.from_pretrained(str(other_weights))
    new = {k: v.detach() for k, v in other.state_dict().items()}
    manifest = layout(new, chunk_bytes=64 * 1024, blob="v4")  # flattened and lone buckets
    calls = server_buckets(manifest)
    assert {c.load_format for c in calls} == {None, "flattened_bucket"}
    async with serve_process(model_dir, tmp_path / "serve.log") as url:
        assert await call(http, url, "/health", method="GET") == (200, "")
        before = await generate(http, url, input_ids=PROMPT, sampling_params=GREEDY)
        assert before["meta_info"]["weight_version"] == "3"
        port = free_port()
        store = serve_store("127.0.0.1", port, timedelta(seconds=60), wait_for_workers=False)
        async with SGLangClient(url) as client:
            joined = await client.weights.init_weights_update_group(
                "127.0.0.1", port, world_size=2, rank_offsets={url: 1}, group_name="g",
                backend="gloo",
            )  # fmt: skip
            group = await asyncio.to_thread(BroadcastGroup.form, store, 0, 2, name="g")
            try:
                await joined
                sending = asyncio.create_task(asyncio.to_thread(group.send_buckets, manifest, new))
                await client.update_weights(
                    4, buckets=calls, broadcast=lambda bucket: None, group_name="g",
                    pause_mode="in_place",
                )  # fmt: skip
                await sending
            finally:
                group.abort()
            await client.weights.destroy_weights_update_group("g")
        after = await generate(http, url, input_ids=PROMPT, sampling_params=GREEDY)
        assert after["meta_info"]["weight_version"] == "4"
        assert after["output_ids"] != before["output_ids"]
    served = AutoModelForCausalLM.from_pretrained(str(model_dir))
    served.load_state_dict(new)  # what the server now holds: greedy decoding agrees
    with torch.no_grad():
        ids = served.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)
    assert ids[0, len(PROMPT) :].tolist()[: len(after["output_ids"])] == after["output_ids"]


@pytest.mark.parametrize("flattened", [False, True])
async def test_tensors_handed_over_by_reference_reach_an_asyncrl_serve_process(
    http, model_dir, other_weights, tmp_path, flattened
):
    """/update_weights_from_tensor from another process on the host: the tensors travel
    as shared memory (as CUDA tensors would as IPC handles), one by one or flattened."""
    import torch
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(str(other_weights))
    new = {k: v.detach() for k, v in other.state_dict().items()}
    async with serve_process(model_dir, tmp_path / "serve.log") as url:
        before = await generate(http, url, input_ids=PROMPT, sampling_params=GREEDY)
        async with SGLangClient(url) as client:
            replies = await client.weights.update_weights_from_tensor(
                list(new.items()), version=5, flattened=flattened
            )
        assert replies[url]["success"] is True, replies
        after = await generate(http, url, input_ids=PROMPT, sampling_params=GREEDY)
    assert after["meta_info"]["weight_version"] == "5"
    assert after["output_ids"] != before["output_ids"]
    served = AutoModelForCausalLM.from_pretrained(str(model_dir))
    served.load_state_dict(new)
    with torch.no_grad():
        ids = served.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)
    assert ids[0, len(PROMPT) :].tolist()[: len(after["output_ids"])] == after["output_ids"]


async def test_tensor_payloads_are_read_through_an_allow_list(http, url):
    import base64
    import pickle

    class Payload:
        def __reduce__(self):
            import os

            return (os.system, ("echo owned",))

    evil = base64.b64encode(pickle.dumps([("w", Payload())])).decode()
    cases = [
        ([evil], "posix.system is not allowed"),
        (["%%%"], "not base64"),
        ([evil, evil], "got 2 entries"),
        ([base64.b64encode(pickle.dumps([("w", 1)])).decode()], "list of (name, tensor)"),
    ]
    for entries, message in cases:
        body = {"serialized_named_tensors": entries}
        status, reply = await call(http, url, "/update_weights_from_tensor", body)
        assert status == 400 and message in reply["message"], reply
    assert (await call(http, url, "/health", method="GET"))[0] == 200


def test_only_a_closing_server_is_a_503_not_any_refused_connection():
    from asyncrl.engines.server.app import ServerClosed, error_reply

    assert error_reply(ServerClosed("shutting down"), "/generate") == (
        503, {"error": {"message": "shutting down"}},
    )  # fmt: skip
    status, body = error_reply(ConnectionRefusedError("a group's peer"), "/generate")
    assert status == 500 and "ConnectionRefusedError: a group's peer" in body["message"]


async def test_options_the_server_cannot_keep_are_refused_by_name_to_the_openai_client(url):
    """An unknown response format and forced tool calls are 400s naming the field, through
    the real ``openai`` client, never silently ignored; ``auto`` and ``text`` are served
    (structured outputs: tests/test_grammar.py)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    schema = {"type": "json_schema", "json_schema": {"name": "x"}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    named = {"type": "function", "function": {"name": "f"}}
    for extra, field_name in (
        ({"response_format": {"type": "xml"}}, "response_format type 'xml' is not supported"),
        ({"response_format": schema}, "response_format.json_schema.schema: expected a JSON"),
        ({"tools": [tool], "tool_choice": "required"}, "a forced tool_choice needs a tool-call"),
        ({"tools": [tool], "tool_choice": named}, "a forced tool_choice needs a tool-call"),
    ):
        with pytest.raises(openai.BadRequestError, match=field_name):
            await client.chat.completions.create(**chat, **extra)
    ok = await client.chat.completions.create(
        **chat, response_format={"type": "text"}, tools=[tool], tool_choice="auto"
    )
    assert ok.choices[0].finish_reason in ("stop", "length")
    await client.close()


async def test_a_stream_refused_by_the_tokenizer_managers_checks_is_a_200_error_event(http, url):
    """SGLang refuses a streamed request inside the stream (its tokenizer manager raises
    after the response began): one ``{"error": ...}`` event, then ``[DONE]``; a body its
    JSON contract refuses is a 400 before any stream, and a non-stream request a 400."""
    long = {"input_ids": [5] * 600, "sampling_params": {"max_new_tokens": 2}}
    async with http.post(url + "/generate", json={**long, "stream": True}) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]" and len(events) == 2
    error = json.loads(events[0])["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert "is longer than the model's context length" in error["message"]
    status, reply = await call(http, url, "/generate", long)
    assert status == 400 and "is longer than" in reply["error"]["message"]
    contract = {"input_ids": [5, 6], "stream": True, "return_logprob": "true"}
    status, reply = await call(http, url, "/generate", contract)
    assert status == 400 and reply["error"].startswith("invalid type: string")


async def test_a_tool_call_parser_turns_a_chat_reply_into_openai_tool_calls(tmp_path):
    """With --tool-call-parser (hermes), a chat call that offers tools gets the reply's
    well-formed calls as ``tool_calls``, the rest as ``content``, and ``tool_calls`` as
    the finish reason; without tools the reply is plain text."""
    from types import SimpleNamespace

    from asyncrl.engines.base import FinishReason, GenerateOutput
    from asyncrl.engines.server.openai_routes import OpenAICall
    from asyncrl.rollout.workflows import tool_call_parser
    from tests.tiny_tokenizer import build_chatml_tokenizer

    tok = build_chatml_tokenizer(tmp_path)
    server = SimpleNamespace(tool_call_parser=tool_call_parser("qwen25"), served_model_name="m",
                             engine=SimpleNamespace(tokenizer=tok))  # fmt: skip
    tool = {"type": "function", "function": {"name": "calculator", "parameters": {}}}
    text = 'Let me see. <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}'
    ids = tok(text + "</tool_call>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    eos = FinishReason(type="stop", matched=tok.eos_token_id)
    out = GenerateOutput(rid="r", output_ids=ids, logprobs=[-0.1] * len(ids),
                         versions=[0] * len(ids), finish_reason=eos)  # fmt: skip
    messages = [{"role": "user", "content": "6*7?"}]
    with_tools = OpenAICall.parse({"messages": messages, "tools": [tool]}, [[1]], server, chat=True)
    choice = with_tools.reply([out], "0")["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me see."
    (call_,) = choice["message"]["tool_calls"]
    assert call_["type"] == "function" and call_["function"]["name"] == "calculator"
    assert json.loads(call_["function"]["arguments"]) == {"expression": "6*7"}
    plain = OpenAICall.parse({"messages": messages}, [[1]], server, chat=True)
    choice = plain.reply([out], "0")["choices"][0]
    assert choice["message"]["tool_calls"] is None and "<tool_call>" in choice["message"]["content"]
    forced = {"messages": messages, "tools": [tool], "tool_choice": "required"}
    grammar = OpenAICall.parse(forced, [[1]], server, chat=True).requests[0].sampling.ebnf
    assert grammar is not None and '"<tool_call>"' in grammar and "calculator" in grammar


# ----------------------------------------------------------------------------- tool calls
# A server with --tool-call-parser over a scripted engine (tests/scripted_engine.py), so the
# model's text is known; the real ``openai`` client asks each generation twice, whole and
# streamed (one token per engine output, so the stream cuts the text at every token).

CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {}}}
USER = [{"role": "user", "content": "6*7?"}]


def hermes(name: str, arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tool_server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EngineServer]:
    from asyncrl.rollout.workflows import tool_call_parser
    from tests.scripted_engine import ScriptedServingEngine
    from tests.tiny_tokenizer import build_chatml_tokenizer

    tokenizer = build_chatml_tokenizer(tmp_path_factory.mktemp("tool_tokenizer"))
    server = EngineServer(ScriptedServingEngine(tokenizer), served_model_name="m",
                          tool_call_parser=tool_call_parser("hermes"))  # fmt: skip
    await server.start("127.0.0.1", 0)
    yield server
    await server.stop()


async def whole_and_streamed(server: EngineServer, text: str, **extra: Any) -> tuple[Any, Any]:
    """The reply to one scripted generation of ``text``, and its stream accumulated."""
    import openai

    server.engine.texts = [text, text]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    request = {"model": "m", "messages": USER, "tools": [CALCULATOR], "logprobs": True, **extra}
    whole = (await client.chat.completions.create(**request)).choices[0]
    stream = await client.chat.completions.create(**request, stream=True)
    streamed = accumulate([chunk async for chunk in stream])
    await client.close()
    return whole, streamed


def accumulate(chunks: list[Any]) -> dict[str, Any]:
    """What a client builds from stream chunks, checking OpenAI's shapes: a call's first
    chunk has its index, id, type and name; later ones only add to its arguments."""
    content, calls, reasons, logprobs = [], {}, [], []
    for chunk in chunks:
        (choice,) = chunk.choices
        content.append(choice.delta.content or "")
        reasons.append(choice.finish_reason)
        logprobs += choice.logprobs.content if choice.logprobs else []
        for part in choice.delta.tool_calls or ():
            if part.index not in calls:
                assert part.id and part.type == "function" and part.function.name, part
                calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": ""}
            else:
                assert part.id is None and part.function.name is None, part
            calls[part.index]["arguments"] += part.function.arguments or ""
    assert list(calls) == list(range(len(calls)))  # indices 0, 1, 2 in order
    assert all(r is None for r in reasons[:-1])
    return {"content": "".join(content), "calls": list(calls.values()), "reason": reasons[-1],
            "logprobs": [lp.token for lp in logprobs]}  # fmt: skip


def message_calls(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


TOOL_TEXTS = {
    "one call": (hermes("calculator", {"expression": "6*7"}), 1),
    "parallel calls": (
        hermes("calculator", {"expression": "6*7"}) + "\n"
        + hermes("calculator", {"expression": "1+1"}) + hermes("search", {"q": "</tool"}),
        3,
    ),
    "text before a call": ("Let me see. " + hermes("calculator", {"expression": "6*7"}), 1),
    "a malformed block": ("I try <tool_call>{not json}</tool_call> and stop", 0),
    "an unclosed block after a call": (
        "So " + hermes("calculator", {"expression": "2"}) + ' then <tool_call>{"name": "c', 1
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TOOL_TEXTS))
async def test_streamed_tool_calls_add_up_to_the_reply_for_the_same_generation(tool_server, case):
    text, num_calls = TOOL_TEXTS[case]
    whole, streamed = await whole_and_streamed(tool_server, text)
    calls = message_calls(whole.message)
    assert len(calls) == num_calls
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == calls
    assert streamed["content"].strip() == (whole.message.content or "").strip()
    expected = "tool_calls" if num_calls else "stop"
    assert whole.finish_reason == streamed["reason"] == expected
    # Every token's log-prob goes out once, held text's on a later chunk.
    assert streamed["logprobs"] == [lp.token for lp in whole.logprobs.content]
    if num_calls and "<tool_call>" not in (whole.message.content or ""):
        assert "<tool" not in streamed["content"]  # nothing of a call leaked into content
    if not num_calls:
        assert "<tool_call>{not json}</tool_call>" in streamed["content"]


async def test_tool_choice_none_returns_the_call_text_as_content(tool_server):
    text = "Sure. " + hermes("calculator", {"expression": "6*7"})
    whole, streamed = await whole_and_streamed(tool_server, text, tool_choice="none")
    assert whole.message.tool_calls is None and whole.message.content == text
    assert streamed["calls"] == [] and streamed["content"] == text
    assert whole.finish_reason == streamed["reason"] == "stop"


async def test_a_tool_choice_the_server_cannot_keep_is_a_400_naming_why(tool_server):
    import openai

    client = openai.AsyncOpenAI(base_url=tool_server.url + "/v1", api_key="none", max_retries=0)
    named = {"type": "function", "function": {"name": "calculator"}}
    other = {"type": "function", "function": {"name": "other"}}
    for choice, message in (
        ("required", "ebnf (constrained decoding) is not supported by the scripted engine"),
        (named, "ebnf (constrained decoding) is not supported by the scripted engine"),
        ("sometimes", "tool_choice 'sometimes' is not one of 'none', 'auto', 'required'"),
        (other, "names function 'other', which is not among tools"),
    ):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match=re.escape(message)):
                await client.chat.completions.create(
                    model="m", messages=USER, tools=[CALCULATOR], tool_choice=choice,
                    stream=stream,
                )  # fmt: skip
    await client.close()


async def test_llama3_json_calls_are_parsed_and_streamed_alike(tool_server):
    from asyncrl.rollout.multi_turn import Llama3Parser

    first = {"name": "calculator", "parameters": {"expression": "6*7"}}
    second = {"name": "calculator", "arguments": {"expression": "1+1"}}
    text = f"Sure. <|python_tag|>{json.dumps(first)}; {json.dumps(second)}"
    hermes_parser, tool_server.tool_call_parser = tool_server.tool_call_parser, Llama3Parser()
    try:
        whole, streamed = await whole_and_streamed(tool_server, text)
    finally:
        tool_server.tool_call_parser = hermes_parser
    args = [json.loads(a) for _, a in message_calls(whole.message)]
    assert args == [{"expression": "6*7"}, {"expression": "1+1"}]
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == message_calls(whole.message)
    assert whole.message.content == streamed["content"] == "Sure."
    assert whole.finish_reason == streamed["reason"] == "tool_calls"


async def test_a_body_over_the_limit_is_a_413_before_it_is_read_whole(served, http, url):
    """Declared too long, or streaming past the limit with no declared length: refused
    either way, and the server goes on serving."""
    limit, served.max_body_bytes = served.max_body_bytes, 1000
    try:
        big = json.dumps({"input_ids": [5] * 2000, "sampling_params": GREEDY}).encode()
        status, reply = await call(http, url, "/generate", raw=big)
        assert status == 413, reply
        assert "over this server's limit of 1000 bytes" in reply["error"]["message"]

        async def chunked() -> AsyncIterator[bytes]:
            for _ in range(20):
                yield b" " * 100

        async with http.post(url + "/v1/completions", data=chunked()) as resp:
            assert resp.status == 413 and resp.headers.get("Content-Length") is not None
        assert (await call(http, url, "/health", method="GET"))[0] == 200
        assert (await generate(http, url, input_ids=PROMPT, sampling_params=GREEDY))["text"]
    finally:
        served.max_body_bytes = limit


async def test_a_text_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(
    served, http, url, monkeypatch
):
    tokenizer, tokenized = served.engine.tokenizer, []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: tokenized.append(1) or encode(*a, **k))
    text = "many words " * 200_000  # 2.2 MB; the tiny model's context is 512 tokens
    bodies = {
        "/generate": {"text": text},
        "/v1/completions": {"prompt": text},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": text}]},
    }
    for path, body in bodies.items():
        status, reply = await call(http, url, path, body)
        assert status == 400, (path, reply)
        assert "is longer than the model's context length (512 tokens)" in json.dumps(reply)
    assert not tokenized
    fits = {"text": "many words", "sampling_params": GREEDY}
    status, _ = await call(http, url, "/generate", fits)
    assert status == 200 and tokenized  # a prompt that fits is tokenized as before


async def test_a_big_body_is_parsed_off_the_event_loop_while_health_answers(
    served, http, url, monkeypatch
):
    entered, release, threads = threading.Event(), threading.Event(), []
    parse = served._parse

    def slow(body: dict) -> Any:
        threads.append(threading.current_thread())
        entered.set()
        assert release.wait(10)
        return parse(body)

    monkeypatch.setattr(served, "_parse", slow)
    body = {"input_ids": [5] * 40_000, "sampling_params": GREEDY}  # > 64 KB of JSON
    pending = asyncio.create_task(call(http, url, "/generate", body))
    assert await asyncio.to_thread(entered.wait, 10)
    assert threads[0] is not threading.main_thread()
    assert (await call(http, url, "/health", method="GET"))[0] == 200
    release.set()
    status, reply = await pending
    assert status == 400 and "longer than the model's context" in json.dumps(reply)


async def test_json_nested_deeper_than_the_decoder_goes_is_a_400(http, url):
    status, reply = await call(http, url, "/generate", raw=b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nested too deeply" in json.dumps(reply), reply
