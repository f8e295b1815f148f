"""SGLangClient against recorded SGLang wire shapes (``docs/sglang_api.md``).

A small aiohttp app replays SGLang's reply shapes for several SGLang versions
(normal output, every abort shape, cumulative and delta streams, each error envelope,
text replies of ``/flush_cache``, renamed endpoints) and records what the client sent, so
each test checks both directions of the contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import resource
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from asyncrl.engines.base import SamplingParams
from asyncrl.engines.client.sglang import (
    EngineUnavailable,
    SGLangClient,
    SGLangError,
    WeightBucket,
    error_message,
    parse_generate_output,
)
from asyncrl.engines.client.transport import pool_size

# ----------------------------------------------------------------------------- recorded shapes

TRIPLES = [
    [-0.0123, 17, None],
    [-0.2001, 10, None],
    [-0.0009, 17, None],
    [-1.3, 374, None],
    [-0.02, 220, None],
    [-0.001, 19, None],
    [-0.4, 13, None],
    [-0.0002, 151645, None],
]
IDS = [t[1] for t in TRIPLES]

#: Section 1.3, verbatim.
NORMAL = {
    "text": "2+2 is 4.<|im_end|>",
    "output_ids": IDS,
    "meta_info": {
        "id": "rollout17-g3-s1",
        "finish_reason": {"type": "stop", "matched": 151645},
        "prompt_tokens": 15,
        "weight_version": "default",
        "num_retractions": 0,
        "input_token_logprobs": [],
        "output_token_logprobs": TRIPLES,
        "output_token_logprobs_length": 8,
        "reasoning_tokens": 0,
        "completion_tokens": 8,
        "cached_tokens": 12,
        "weight_versions": [{"version": "default", "start": 0, "end": 8}],
        "e2e_latency": 0.0831,
        "response_sent_to_client_ts": 1763790000.123,
    },
}
#: Section 5.1.1: a running request aborted, with its partial output.
RUNNING_ABORT = {
    "text": "2+2",
    "output_ids": IDS[:3],
    "meta_info": {
        "id": "r1",
        "prompt_tokens": 15,
        "cached_tokens": 0,
        "completion_tokens": 3,
        "weight_version": "5",
        "output_token_logprobs": TRIPLES[:3],
        "finish_reason": {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        },
    },
}
#: Section 5.1.2, >= 0.5.5: aborted while queued; no prompt_tokens / cached_tokens.
QUEUED_ABORT = {
    "text": "",
    "output_ids": [],
    "meta_info": {
        "id": "r2",
        "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": "3",
        "e2e_latency": 0.01,
        "completion_tokens": 0,
        "output_token_logprobs": [],
    },
}
#: Section 5.1.2, <= 0.5.4: no output_ids, no output_token_logprobs, no weight_version.
OLD_QUEUED_ABORT = {
    "text": "",
    "meta_info": {
        "id": "r3",
        "finish_reason": {"type": "abort", "message": "Abort before prefill"},
        "prompt_tokens": 0,
        "completion_tokens": 0,
    },
}

#: Section 1.7 / 3.5 / 4.2 error envelopes and the message each must yield.
ERROR_SHAPES = [
    (
        400,
        {
            "object": "error",
            "message": "1 validation error for GenerateReqInput",
            "type": "Bad Request",
            "param": None,
            "code": 400,
        },
        "1 validation error for GenerateReqInput",
    ),
    (
        400,
        {"error": "unknown field `max_tokens`, expected one of `max_new_tokens`"},
        "unknown field `max_tokens`, expected one of `max_new_tokens`",
    ),
    (
        400,
        {"error": {"message": "Duplicate request ID detected: r1"}},
        "Duplicate request ID detected: r1",
    ),
    (
        500,
        {"object": "error", "message": "Out of memory", "type": "500", "param": None, "code": 500},
        "Out of memory",
    ),
    (
        400,
        "The input (600 tokens) is longer than the model's context length (512 tokens).\n",
        "The input (600 tokens) is longer than the model's context length (512 tokens).",
    ),
]

ROUTER_NO_WORKERS = {
    "error": {
        "type": "Service Unavailable",
        "code": "no_available_workers",
        "message": "No available workers (all circuits open or unhealthy)",
    }
}

FAST = SGLangClient.Config(
    backoff_s=0.01,
    max_backoff_s=0.05,
    recheck_s=0.05,
    control_timeout_s=5.0,
    load_refresh_s=3600.0,
)


def sse(*payloads: Any) -> bytes:
    """SGLang's framing: ``data: <compact JSON>\\n\\n`` per chunk, then ``data: [DONE]``."""
    chunks = [b"data: " + json.dumps(p, separators=(",", ":")).encode() + b"\n\n" for p in payloads]
    return b"".join(chunks) + b"data: [DONE]\n\n"


def chunk(
    ids: list[int],
    total: int,
    *,
    version: str = "default",
    finish: Any = None,
    triples: list[Any] | None = None,
    **meta: Any,
) -> dict[str, Any]:
    out = {
        "text": "...",
        "output_ids": ids,
        "meta_info": {
            "id": "s1",
            "finish_reason": finish,
            "prompt_tokens": 15,
            "weight_version": version,
            "completion_tokens": total,
            **meta,
        },
    }
    if triples is not None:
        out["meta_info"]["output_token_logprobs"] = triples
    return out


# ----------------------------------------------------------------------------- fake engine

Reply = Callable[[web.Request], Awaitable[web.StreamResponse]]


def reply(status: int, body: Any) -> Reply:
    """A canned answer: JSON for dicts and lists, text/plain for strings."""

    async def answer(request: web.Request) -> web.StreamResponse:
        if isinstance(body, str):
            return web.Response(status=status, text=body)
        return web.json_response(body, status=status)

    return answer


def stream(data: bytes, *, pieces: int = 1) -> Reply:
    """An SSE answer written in ``pieces`` separate TCP writes (splits land mid-line)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        step = max(1, len(data) // pieces)
        for start in range(0, len(data), step):
            await resp.write(data[start : start + step])
            await asyncio.sleep(0.005)
        await resp.write_eof()
        return resp

    return answer


@dataclass
class Call:
    method: str
    path: str
    raw: bytes
    content_type: str

    @property
    def body(self) -> Any:
        return json.loads(self.raw) if self.raw else None


@dataclass
class Fake:
    """An SGLang server of a given version that records every request."""

    version: str = "0.5.15.post1"
    weight_version: str = "default"
    tp_size: int = 1
    load: int = 0
    loads: list[int] = field(default_factory=list)
    legacy_loads: bool = False
    weight_version_route: bool = True
    generate: list[Reply] = field(default_factory=list)
    fail: dict[str, list[tuple[int, Any]]] = field(default_factory=dict)
    hold: asyncio.Event | None = None
    received: asyncio.Event = field(default_factory=asyncio.Event)
    calls: list[Call] = field(default_factory=list)
    url: str = ""

    def paths(self, *, skip: tuple[str, ...] = ("/v1/loads", "/health")) -> list[str]:
        return [c.path for c in self.calls if c.path not in skip]

    def bodies(self, path: str) -> list[Any]:
        return [c.body for c in self.calls if c.path == path]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.calls.append(Call(request.method, request.path, raw, request.content_type))
        if self.fail.get(request.path):
            return await reply(*self.fail[request.path].pop(0))(request)
        if request.path in ("/generate", "/update_weights_from_distributed"):
            self.received.set()
            if self.hold is not None:
                await self.hold.wait()
        if request.path == "/generate":
            return await (self.generate.pop(0) if self.generate else reply(200, NORMAL))(request)
        return await self.control(request.path)(request)

    def control(self, path: str) -> Reply:
        ok = {"success": True, "message": "Succeeded."}
        if path in ("/get_server_info", "/server_info"):
            return reply(
                200,
                {
                    "version": self.version,
                    "tp_size": self.tp_size,
                    "dp_size": 1,
                    "model_path": "tiny",
                    "internal_states": [],
                },
            )
        if path == "/get_weight_version" and self.weight_version_route:
            return reply(200, {"weight_version": self.weight_version})
        if path in ("/model_info", "/get_model_info"):
            return reply(200, {"model_path": "tiny", "weight_version": self.weight_version})
        if path == "/v1/loads" and not self.legacy_loads:
            n = self.loads.pop(0) if self.loads else self.load
            return reply(
                200, {"loads": [{"dp_rank": 0, "num_running_reqs": n, "num_waiting_reqs": 0}]}
            )
        if path == "/get_load":
            n = self.loads.pop(0) if self.loads else self.load
            return reply(200, [{"dp_rank": 0, "num_reqs": n, "num_waiting_reqs": 0}])
        if path in ("/begin_weight_update", "/end_weight_update") and self.version < "0.5.21":
            return reply(404, {"detail": "Not Found"})
        if path.startswith(
            ("/update_weights", "/init_weights", "/destroy_weights", "/begin_", "/end_")
        ):
            return reply(200, ok)
        if path in ("/pause_generation", "/continue_generation"):
            return reply(200, {"message": "Generation paused successfully.", "status": "ok"})
        if path == "/flush_cache":
            return reply(200, "Cache flushed.\nPlease check backend logs for more details.\n")
        if path in ("/abort_request", "/health"):
            return reply(200, "")
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            return reply(200, None)
        return reply(404, {"detail": "Not Found"})


@contextlib.asynccontextmanager
async def serving(fake: Fake, port: int | None = None) -> AsyncIterator[Fake]:
    server = TestServer(fake.app(), host="127.0.0.1", port=port)
    await server.start_server()
    fake.url = str(server.make_url("")).rstrip("/")
    try:
        yield fake
    finally:
        await server.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
async def fake() -> AsyncIterator[Fake]:
    async with serving(Fake()) as server:
        yield server


@pytest.fixture
async def client(fake: Fake) -> AsyncIterator[SGLangClient]:
    async with SGLangClient(fake.url, config=FAST) as c:
        yield c


# ----------------------------------------------------------------------------- parsing


def test_normal_output_gives_tokens_logprobs_and_versions_from_the_triples():
    result = parse_generate_output(NORMAL)
    assert result.output_ids == IDS
    assert result.logprobs == [t[0] for t in TRIPLES]
    assert result.versions == [0] * 8  # "default" is version 0
    assert result.finish_reason is not None and result.finish_reason.type == "stop"
    assert result.finish_reason.matched == 151645
    assert (result.prompt_tokens, result.cached_tokens, result.rid) == (15, 12, "rollout17-g3-s1")
    assert not result.aborted and not result.queued


def test_stop_string_length_and_id_list_finish_reasons_parse():
    def finish(reason: dict[str, Any]) -> Any:
        return parse_generate_output({"output_ids": [], "meta_info": {"finish_reason": reason}})

    assert finish({"type": "stop", "matched": "</answer>"}).finish_reason.matched == "</answer>"
    assert finish({"type": "length", "length": 64}).finish_reason.length == 64
    assert finish({"type": "stop", "matched": [7, 9], "extra": 1}).finish_reason.matched == 9


def test_weight_version_spans_stamp_each_token_with_an_int_version():
    payload = json.loads(json.dumps(NORMAL))
    payload["meta_info"]["weight_version"] = "42"
    payload["meta_info"]["weight_versions"] = [
        {"version": "41", "start": 0, "end": 3},
        {"version": "42", "start": 3, "end": 8},
    ]
    result = parse_generate_output(payload)
    assert result.versions == [41, 41, 41, 42, 42, 42, 42, 42]
    assert result.weight_version == 42


def test_weight_version_without_spans_is_stamped_on_every_token():
    payload = json.loads(json.dumps(RUNNING_ABORT))
    assert parse_generate_output(payload).versions == [5, 5, 5]


def test_running_abort_is_a_partial_result_with_its_logprobs():
    result = parse_generate_output(RUNNING_ABORT)
    assert result.aborted and not result.queued
    assert result.output_ids == IDS[:3] and result.logprobs == [t[0] for t in TRIPLES[:3]]
    assert result.finish_reason.message == "Aborted" and result.finish_reason.status_code is None
    assert result.prompt_tokens == 15


def test_queued_abort_of_new_servers_lacks_prompt_tokens():
    result = parse_generate_output(QUEUED_ABORT)
    assert result.aborted and result.queued
    assert result.output_ids == [] and result.logprobs == [] and result.versions == []
    assert result.prompt_tokens is None and result.cached_tokens is None
    assert result.weight_version == 3


def test_abort_before_prefill_of_old_servers_lacks_output_ids_and_logprobs():
    result = parse_generate_output(OLD_QUEUED_ABORT)
    assert result.aborted and result.queued
    assert result.output_ids == [] and result.logprobs == [] and result.versions == []
    assert result.weight_version is None and result.prompt_tokens == 0


def test_output_ids_are_used_when_the_server_sent_no_logprobs():
    payload = {
        "output_ids": [4, 5],
        "meta_info": {"weight_version": "2", "finish_reason": {"type": "length", "length": 2}},
    }
    result = parse_generate_output(payload)
    assert result.output_ids == [4, 5] and result.logprobs is None and result.versions == [2, 2]


@pytest.mark.parametrize(("status", "body", "message"), ERROR_SHAPES)
def test_error_message_finds_the_servers_text_in_every_envelope(status, body, message):
    assert error_message(body) == message


def test_a_non_numeric_weight_version_is_refused_with_a_hint():
    with pytest.raises(ValueError, match="--weight-version"):
        parse_generate_output({"output_ids": [1], "meta_info": {"weight_version": "v1"}})


# ----------------------------------------------------------------------------- generate


async def test_generate_sends_input_ids_and_only_the_sampling_keys_given(fake, client):
    params = SamplingParams(max_new_tokens=8, temperature=0.5, stop_token_ids=[151645])
    result = await client.generate([1, 2, 3], params, rid="r-1")
    assert result.output_ids == IDS and result.engine == fake.url
    (call,) = [c for c in fake.calls if c.path == "/generate"]
    assert call.content_type == "application/json"
    assert call.body == {
        "input_ids": [1, 2, 3],
        "rid": "r-1",
        "return_logprob": True,
        "stream": False,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.5, "stop_token_ids": [151645]},
    }


async def test_a_sampling_mapping_is_sent_as_given_and_made_up_keys_never_leave(fake, client):
    await client.generate([1], {"temperature": 0, "max_new_tokens": 4})
    assert fake.bodies("/generate")[0]["sampling_params"] == {"temperature": 0, "max_new_tokens": 4}
    with pytest.raises(ValueError, match="max_tokens"):
        await client.generate([1], {"max_tokens": 4})
    with pytest.raises(ValueError, match="top_p"):
        await client.generate([1], {"top_p": 0})
    with pytest.raises(ValueError, match="distinct rids"):
        await client.generate([1], {"n": 2})
    assert len(fake.bodies("/generate")) == 1


@pytest.mark.parametrize(
    "shape", [RUNNING_ABORT, QUEUED_ABORT, OLD_QUEUED_ABORT], ids=["running", "queued", "old"]
)
async def test_every_abort_shape_is_a_normal_200_result(fake, client, shape):
    fake.generate.append(reply(200, shape))
    result = await client.generate([1, 2])
    assert result.aborted and len(result.output_ids) == len(result.versions)


@pytest.mark.parametrize(("status", "body", "message"), ERROR_SHAPES)
async def test_generate_errors_carry_the_status_and_the_servers_message(
    fake, client, status, body, message
):
    fake.generate.append(reply(status, body))
    with pytest.raises(SGLangError) as info:
        await client.generate([1])
    assert (info.value.status, info.value.message) == (status, message)
    assert info.value.url == fake.url


async def test_a_400_is_never_retried(fake, client):
    fake.fail["/generate"] = [(400, {"error": {"message": "bad"}})] * 3
    fake.fail["/pause_generation"] = [(400, {"error": {"message": "bad"}})] * 3
    with pytest.raises(SGLangError):
        await client.generate([1])
    with pytest.raises(SGLangError):
        await client.pause()
    assert fake.paths() == ["/generate", "/pause_generation"]


async def test_a_503_is_retried_on_queries_but_not_on_an_accepted_generate(fake, client):
    fake.fail["/generate"] = [(503, {"object": "error", "message": "SLA timeout", "code": 503})]
    fake.fail["/get_weight_version"] = [(503, {"error": {"message": "starting"}})] * 2
    fake.weight_version = "4"
    with pytest.raises(SGLangError, match="SLA timeout"):
        await client.generate([1])
    assert await client.weight_version() == 4
    assert fake.paths() == ["/generate"] + ["/get_weight_version"] * 3


async def test_an_empty_200_reply_to_generate_raises_and_is_never_sent_again(fake, client):
    fake.generate = [reply(200, "")]  # accepted: a retry could run it twice
    with pytest.raises(SGLangError, match="empty body"):
        await client.generate([1])
    assert fake.paths() == ["/generate"]


async def test_a_routers_no_available_workers_503_is_retried_for_generate(fake, client):
    fake.fail["/generate"] = [(503, ROUTER_NO_WORKERS)]
    result = await client.generate([1])
    assert result.output_ids == IDS and fake.paths() == ["/generate", "/generate"]


async def test_connection_refused_then_success_is_retried():
    port = free_port()
    config = SGLangClient.Config(backoff_s=0.05, max_backoff_s=0.2, retries=8, recheck_s=0.01)
    async with SGLangClient(f"http://127.0.0.1:{port}", config=config) as c:
        call = asyncio.create_task(c.generate([1]))
        query = asyncio.create_task(c.weight_version())
        await asyncio.sleep(0.15)
        assert not call.done() and not query.done()
        async with serving(Fake(weight_version="6"), port=port) as fake:
            assert (await call).output_ids == IDS
            assert await query == 6
            assert fake.paths().count("/generate") == 1


async def test_an_unreachable_engine_raises_engine_unavailable_after_the_retries():
    config = SGLangClient.Config(backoff_s=0.01, retries=2)
    async with SGLangClient(f"http://127.0.0.1:{free_port()}", config=config) as c:
        with pytest.raises(EngineUnavailable):
            await c.generate([1])
        with pytest.raises(EngineUnavailable):
            await c.pause()


# ----------------------------------------------------------------------------- streaming


async def test_cumulative_stream_yields_growing_results_and_trusts_the_final_chunk(fake, client):
    chunks = [
        chunk(IDS[:1], 1, triples=TRIPLES[:1]),
        chunk(IDS[:3], 3, triples=TRIPLES[:3]),
        chunk(IDS, 8, triples=TRIPLES, finish={"type": "stop", "matched": 151645}),
    ]
    # Blank lines, a comment and CRLF endings around SGLang's framing, split across writes.
    data = b"\n: keep-alive\r\n" + sse(*chunks).replace(b"\n\n", b"\r\n\r\n\n")
    fake.generate.append(stream(data, pieces=17))
    results = [r async for r in client.generate_stream([1, 2], {"max_new_tokens": 8})]
    assert [len(r.output_ids) for r in results] == [1, 3, 8]
    assert results[-1].output_ids == IDS and results[-1].logprobs == [t[0] for t in TRIPLES]
    assert results[-1].finished and not results[0].finished
    assert fake.bodies("/generate")[0]["stream"] is True


async def test_delta_stream_of_old_servers_is_accumulated(fake, client):
    # <= 0.5.5: text cumulative, output_ids a delta; no logprobs were asked for.
    chunks = [
        chunk(IDS[:1], 1, version="3"),
        chunk(IDS[1:3], 3, version="4"),
        chunk(IDS[3:], 8, version="4", finish={"type": "stop", "matched": 151645}),
    ]
    fake.generate.append(stream(sse(*chunks), pieces=5))
    results = [r async for r in client.generate_stream([1], return_logprob=False)]
    assert results[-1].output_ids == IDS and results[-1].logprobs is None
    assert results[-1].versions == [3, 4, 4, 4, 4, 4, 4, 4]


async def test_incremental_stream_slices_logprobs_and_final_spans_win(fake, client):
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 8}]
    chunks = [
        chunk(IDS[:3], 3, version="3", triples=TRIPLES[:3]),
        chunk(
            IDS[3:],
            8,
            version="4",
            triples=TRIPLES[3:],
            weight_versions=spans,
            finish={"type": "abort", "message": "Aborted", "status_code": None},
        ),
    ]
    fake.generate.append(stream(sse(*chunks)))
    final = await client.generate([1], stream=True)
    assert final.output_ids == IDS and final.logprobs == [t[0] for t in TRIPLES]
    assert final.versions == [3, 3, 4, 4, 4, 4, 4, 4] and final.aborted


@pytest.mark.parametrize(
    "error",
    [
        {
            "error": {
                "message": "bad logprob_start_len",
                "type": "invalid_request_error",
                "code": 400,
                "retryable": False,
            }
        },
        {"error": {"message": "bad logprob_start_len"}},
    ],
    ids=["0.5.15", "0.5.10"],
)
async def test_an_error_chunk_in_a_stream_raises_sglang_error(fake, client, error):
    fake.generate.append(stream(sse(chunk(IDS[:1], 1), error)))
    with pytest.raises(SGLangError, match="bad logprob_start_len") as info:
        [r async for r in client.generate_stream([1])]
    assert info.value.status == 400


async def test_a_stream_abort_with_a_status_code_raises_like_the_http_error(fake, client):
    finish = {"type": "abort", "message": "SLA timeout", "status_code": 503, "err_type": "x"}
    fake.generate.append(stream(sse(chunk([], 0, finish=finish))))
    with pytest.raises(SGLangError, match="SLA timeout") as info:
        await client.generate([1], stream=True)
    assert info.value.status == 503


async def test_a_stream_that_ends_without_a_final_chunk_raises(fake, client):
    fake.generate.append(stream(b"data: " + json.dumps(chunk(IDS[:1], 1)).encode() + b"\n\n"))
    with pytest.raises(EngineUnavailable, match="final chunk"):
        await client.generate([1], stream=True)
    assert client.transport.inflight() == {fake.url: 0}


# ----------------------------------------------------------------------------- control


async def test_body_less_control_posts_send_an_empty_json_object(fake, client):
    await client.pause()
    await client.pause("in_place")
    await client.continue_()
    await client.abort(abort_all=True)
    await client.abort("r7")
    await client.release_memory()
    await client.resume_memory(["weights"])
    posts = [(c.path, c.raw, c.content_type) for c in fake.calls if c.method == "POST"]
    assert posts == [
        ("/pause_generation", b"{}", "application/json"),
        ("/pause_generation", b'{"mode":"in_place"}', "application/json"),
        ("/continue_generation", b"{}", "application/json"),
        ("/abort_request", b'{"abort_all":true}', "application/json"),
        ("/abort_request", b'{"rid":"r7"}', "application/json"),
        ("/release_memory_occupation", b"{}", "application/json"),
        ("/resume_memory_occupation", b'{"tags":["weights"]}', "application/json"),
    ]


async def test_flush_cache_retries_its_text_400_until_the_engine_is_idle(fake, client):
    busy = "Cache not flushed: there are running or waiting requests.\n"
    fake.fail["/flush_cache"] = [(400, busy), (400, busy)]
    await client.flush_cache(retries=5, interval_s=0.01)
    assert fake.paths() == ["/flush_cache"] * 3
    fake.fail["/flush_cache"] = [(400, busy)] * 3
    with pytest.raises(SGLangError) as info:
        await client.flush_cache(retries=1, interval_s=0.01)
    assert info.value.status == 400 and info.value.message == busy.strip()


async def test_weight_version_falls_back_to_model_info_when_the_route_is_gone(fake, client):
    fake.weight_version_route, fake.weight_version = False, "7"
    assert await client.weight_version() == 7
    assert fake.paths() == ["/get_weight_version", "/model_info"]
    fake.weight_version_route, fake.weight_version = True, "default"
    assert await client.weight_version() == 0


async def test_wait_idle_polls_v1_loads_until_the_engine_drains(fake, client):
    fake.loads = [3, 1, 0]
    await client.wait_idle(poll_s=0.01)
    assert [c.path for c in fake.calls] == ["/v1/loads"] * 3


async def test_wait_idle_falls_back_to_get_load_on_old_servers(fake, client):
    fake.legacy_loads, fake.loads = True, [2, 0]
    await client.wait_idle(poll_s=0.01)
    assert [c.path for c in fake.calls] == ["/v1/loads", "/get_load", "/get_load"]


async def test_wait_idle_re_aborts_lingering_requests_and_times_out(fake, client):
    # Ten busy polls at least 10 ms apart: at least 4 re-aborts at a 20 ms period however
    # slow the machine is (a poll re-aborts at most once; a loaded one sooner, not later).
    fake.loads = [2] * 10 + [0]
    await client.wait_idle(poll_s=0.01, reabort_s=0.02)
    assert len(fake.bodies("/abort_request")) >= 4
    assert fake.bodies("/abort_request")[0] == {"abort_all": True}
    fake.load = 2
    with pytest.raises(TimeoutError, match="not idle"):
        await client.wait_idle(timeout_s=0.05, poll_s=0.01)


async def test_abort_all_and_wait_aborts_then_waits_for_the_drain(fake, client):
    fake.loads = [1, 0]
    await client.abort_all_and_wait(reabort_s=60.0)
    assert fake.paths(skip=()) == ["/abort_request", "/v1/loads", "/v1/loads"]


async def test_abort_waits_for_nothing_but_the_aborted_call_returns_its_partial_output(
    fake, client
):
    fake.hold = asyncio.Event()
    fake.generate.append(reply(200, RUNNING_ABORT))
    call = asyncio.create_task(client.generate([1], rid="r1"))
    await fake.received.wait()
    await client.abort("r1")
    fake.hold.set()  # the server answers the original call once the abort landed
    result = await call
    assert result.aborted and result.output_ids == IDS[:3]
    assert fake.bodies("/abort_request") == [{"rid": "r1"}]


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize(("version", "session"), [("0.5.15.post1", False), ("0.5.21", True)])
async def test_begin_and_end_wrap_distributed_updates_only_from_0_5_21(version, session):
    async with serving(Fake(version=version)) as fake, SGLangClient(fake.url, config=FAST) as c:
        pending = await c.weights.update_weights_from_distributed(
            ["w"], ["torch.bfloat16"], [[4, 2]], version=7
        )
        await pending
    updates = ["/update_weights_from_distributed"]
    expected = ["/begin_weight_update", *updates, "/end_weight_update"] if session else updates
    assert fake.paths() == ["/get_server_info", *expected]
    assert fake.bodies("/update_weights_from_distributed") == [
        {
            "names": ["w"],
            "dtypes": ["bfloat16"],
            "shapes": [[4, 2]],
            "group_name": "weight_update_group",
            "weight_version": "7",
        }
    ]


async def test_a_distributed_update_returns_while_the_server_waits_for_the_broadcast(fake, client):
    fake.hold = asyncio.Event()  # the server sits in its broadcast until "the trainer" sends
    pending = await client.weights.update_weights_from_distributed(["w"], ["float32"], [[2]])
    assert not pending.done()
    await asyncio.wait_for(fake.received.wait(), 5)  # the announcement reached the server
    fake.hold.set()  # the broadcast
    replies = await pending
    assert replies[fake.url]["success"] is True


async def test_update_weights_from_disk_runs_the_slime_sequence_on_every_engine():
    async with serving(Fake()) as a, serving(Fake()) as b:
        async with SGLangClient([a.url, b.url], config=FAST) as c:
            await c.update_weights(3, path="/ckpt/3")
    for fake in (a, b):
        assert fake.paths() == [
            "/pause_generation",
            "/flush_cache",
            "/update_weights_from_disk",
            "/continue_generation",
        ]
        assert fake.bodies("/pause_generation") == [{}]
        assert fake.bodies("/update_weights_from_disk") == [
            {"model_path": "/ckpt/3", "weight_version": "3", "flush_cache": False}
        ]


async def test_update_weights_distributed_announces_each_bucket_before_its_broadcast():
    fake = Fake(version="0.5.23")
    buckets = [WeightBucket(names=[f"w{i}"], dtypes=["float32"], shapes=[[i + 1]]) for i in (0, 1)]
    order = []

    async def broadcast(bucket: WeightBucket) -> None:
        await asyncio.wait_for(fake.received.wait(), 5)
        fake.received.clear()
        order.append(bucket.names[0])

    async with serving(fake), SGLangClient(fake.url, config=FAST) as c:
        await c.update_weights(9, buckets=buckets, broadcast=broadcast, pause_mode="retract")
    assert order == ["w0", "w1"]
    assert fake.paths() == [
        "/pause_generation",
        "/get_server_info",
        "/begin_weight_update",
        "/update_weights_from_distributed",
        "/update_weights_from_distributed",
        "/end_weight_update",
        "/continue_generation",
    ]
    assert fake.bodies("/pause_generation") == [{"mode": "retract"}]  # no flush: requests stay
    sent = fake.bodies("/update_weights_from_distributed")
    assert ["weight_version" in body for body in sent] == [False, True]
    assert sent[1]["weight_version"] == "9" and sent[1]["flush_cache"] is False


async def test_init_weights_update_group_offsets_ranks_by_each_engines_tp_size():
    async with serving(Fake(tp_size=2)) as a, serving(Fake(tp_size=1)) as b:
        async with SGLangClient([a.url, b.url], config=FAST) as c:
            offsets, world = await c.weights.group_layout()
            pending = await c.weights.init_weights_update_group(
                "127.0.0.1",
                "29500",
                backend="gloo",  # type: ignore[arg-type]
            )
            await pending
    assert offsets == {a.url: 1, b.url: 3} and world == 4
    body = a.bodies("/init_weights_update_group")[0]
    assert body == {
        "master_address": "127.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 4,
        "group_name": "weight_update_group",
        "backend": "gloo",
    }
    assert b.bodies("/init_weights_update_group")[0]["rank_offset"] == 3


async def test_a_failed_admin_reply_raises_even_with_status_200(fake, client):
    fake.fail["/update_weights_from_disk"] = [(200, {"success": False, "message": "no file"})]
    with pytest.raises(SGLangError, match="no file"):
        await client.weights.update_weights_from_disk("/missing", 1)


# ----------------------------------------------------------------------------- several engines


async def test_requests_go_to_the_engine_with_the_fewest_in_flight():
    hold = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        fakes = [await stack.enter_async_context(serving(Fake(hold=hold))) for _ in range(3)]
        c = await stack.enter_async_context(SGLangClient([f.url for f in fakes], config=FAST))
        calls = [asyncio.create_task(c.generate([i])) for i in range(6)]
        await asyncio.sleep(0.1)
        assert c.transport.inflight() == {f.url: 2 for f in fakes}
        hold.set()
        await asyncio.gather(*calls)
        assert c.transport.inflight() == {f.url: 0 for f in fakes}


async def test_load_reported_by_an_engine_steers_requests_away_from_it():
    hold = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        busy = await stack.enter_async_context(serving(Fake(hold=hold, load=10)))
        idle = [await stack.enter_async_context(serving(Fake(hold=hold))) for _ in range(2)]
        c = await stack.enter_async_context(
            SGLangClient([busy.url] + [f.url for f in idle], config=FAST)
        )
        await c.transport.refresh_loads()
        calls = [asyncio.create_task(c.generate([i])) for i in range(4)]
        await asyncio.sleep(0.1)
        assert c.transport.inflight() == {busy.url: 0, idle[0].url: 2, idle[1].url: 2}
        hold.set()
        await asyncio.gather(*calls)


async def test_an_unreachable_engine_leaves_the_rotation_until_its_health_answers():
    dead_port = free_port()
    dead = f"http://127.0.0.1:{dead_port}"
    async with serving(Fake()) as live, SGLangClient([dead, live.url], config=FAST) as c:
        results = [await c.generate([i]) for i in range(3)]
        assert {r.engine for r in results} == {live.url}
        assert c.transport.in_rotation() == [live.url]
        assert await c.transport.health() == {dead: False, live.url: True}
        async with serving(Fake(), port=dead_port):
            assert await c.transport.health() == {dead: True, live.url: True}
            assert c.transport.in_rotation() == [dead, live.url]


async def test_requests_waiting_on_engines_out_of_rotation_share_one_probe_each():
    """With every engine out, each request used to probe every engine itself: at 20,000
    in flight that flood of probes kept the engines out (docs/benchmarks.md)."""
    async with serving(Fake()) as a, serving(Fake()) as b:
        async with SGLangClient([a.url, b.url], config=FAST) as c:
            for url in (a.url, b.url):
                c.transport.mark_down(c.transport._engine(url), "test")
            results = await asyncio.gather(*(c.generate([i]) for i in range(200)))
    assert len(results) == 200
    assert [call.path for call in a.calls].count("/health") == 1
    assert [call.path for call in b.calls].count("/health") == 1


async def test_generations_past_the_pool_wait_for_it_and_control_calls_never_queue_behind():
    """A bounded pool (the open-file limit's, ``pool_size``) queues generations in the
    client; pauses, aborts and probes have their own pool and get through at once."""
    hold = asyncio.Event()
    config = dataclasses.replace(FAST, max_connections=2)
    async with serving(Fake(hold=hold)) as fake, SGLangClient(fake.url, config=config) as c:
        calls = [asyncio.create_task(c.generate([i])) for i in range(6)]
        await asyncio.sleep(0.3)
        assert fake.paths().count("/generate") == 2  # the rest wait in the client
        async with asyncio.timeout(5):  # would time out queued behind the held generations
            assert await c.transport.health() == {fake.url: True}
            await c.abort("r0")
        hold.set()
        results = await asyncio.gather(*calls)
    assert len(results) == 6 and fake.paths().count("/generate") == 6
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:  # by default: within half the open-file limit
        assert 64 <= pool_size(None) <= soft // 2


async def test_prefer_pins_a_request_to_its_engine(fake):
    async with serving(Fake()) as other, SGLangClient([fake.url, other.url], config=FAST) as c:
        results = [await c.generate([1], prefer=other.url) for _ in range(3)]
    assert {r.engine for r in results} == {other.url}


async def test_abort_by_rid_goes_to_the_engine_serving_it():
    hold = asyncio.Event()
    async with serving(Fake(hold=hold)) as a, serving(Fake(hold=hold)) as b:
        async with SGLangClient([a.url, b.url], config=FAST) as c:
            call = asyncio.create_task(c.generate([1], rid="keep-0", prefer=b.url))
            await asyncio.wait_for(b.received.wait(), 5)
            await c.abort("keep-0")
            await c.abort("never-sent")
            hold.set()
            await call
    assert b.bodies("/abort_request") == [{"rid": "keep-0"}, {"rid": "never-sent"}]
    assert a.bodies("/abort_request") == [{"rid": "never-sent"}]


async def test_control_calls_fan_out_to_every_engine_and_the_oldest_version_wins():
    async with serving(Fake(weight_version="4")) as a, serving(Fake(weight_version="3")) as b:
        async with SGLangClient([a.url, b.url], config=FAST) as c:
            await c.abort(abort_all=True)
            assert await c.weight_version() == 3
            assert await c.weight_version(a.url) == 4
    assert a.bodies("/abort_request") == b.bodies("/abort_request") == [{"abort_all": True}]


# ----------------------------------------------------------------------------- router helpers


@dataclass
class FakeRouter:
    """The REST worker API of sglang-router >= 0.2.2 (section 4.2), over fake workers."""

    workers: dict[str, str] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    # Like the real router, a DELETE is accepted at once and takes effect a few lists later.
    removal_lag: int = 0
    pending: dict[str, int] = field(default_factory=dict)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/workers", self.add)
        app.router.add_get("/workers", self.list)
        app.router.add_delete("/workers/{id}", self.remove)
        return app

    async def add(self, request: web.Request) -> web.Response:
        body = await request.json()
        worker_id = f"id-{len(self.workers)}"
        self.workers[worker_id] = body["url"]
        self.calls.append(("POST", body["url"]))
        return web.json_response(
            {"status": "accepted", "worker_id": worker_id, "url": body["url"]}, status=202
        )

    async def list(self, request: web.Request) -> web.Response:
        for worker_id, lists_left in list(self.pending.items()):
            if lists_left <= 0:
                del self.pending[worker_id], self.workers[worker_id]
            else:
                self.pending[worker_id] = lists_left - 1
        workers = [{"id": i, "url": u, "is_healthy": True} for i, u in self.workers.items()]
        return web.json_response({"workers": workers, "total": len(workers)})

    async def remove(self, request: web.Request) -> web.Response:
        self.calls.append(("DELETE", request.match_info["id"]))
        self.pending[request.match_info["id"]] = self.removal_lag
        return web.json_response({"status": "accepted"}, status=202)


async def test_router_helpers_register_list_and_remove_workers_and_control_reaches_them():
    router = FakeRouter(removal_lag=3)
    server = TestServer(router.app(), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        async with serving(Fake()) as a, serving(Fake(weight_version="2")) as b:
            async with SGLangClient(url, router=True, config=FAST) as c:
                assert await c.add_worker(a.url) == "id-0"
                assert await c.add_worker(b.url + "/") == "id-1"
                assert [w["url"] for w in await c.list_workers()] == [a.url, b.url]
                await c.abort(abort_all=True)
                await c.pause()
                assert await c.weight_version() == 0
                await c.remove_worker(a.url)
                assert [w["url"] for w in await c.list_workers()] == [b.url]
            for fake in (a, b):
                assert fake.bodies("/abort_request") == [{"abort_all": True}]
                assert fake.bodies("/pause_generation") == [{}]
    finally:
        await server.close()
    assert router.calls == [("POST", a.url), ("POST", b.url), ("DELETE", "id-0")]


async def test_worker_helpers_need_a_router_client(client):
    with pytest.raises(ValueError, match="router=True"):
        await client.list_workers()
