"""``VLLMEngine``'s own logic, without vLLM: the request it sends, how it reads vLLM's
version spans and finish reasons, and the refusal of a server not started for asyncrl
(against a stand-in that answers as vLLM 0.32 does). ``tests/test_vllm.py`` runs the
engine against a real vLLM server."""

from __future__ import annotations

import pytest
from aiohttp import web

from asyncrl.engines.base import GenerateRequest, SamplingParams
from asyncrl.engines.vllm.engine import VLLMEngine, _body, _Call, _finish
from asyncrl.errors import EngineError


def test_the_request_names_vllms_sampling_keys_and_asks_for_the_sampled_logprob():
    sampling = SamplingParams(max_new_tokens=9, temperature=0.7, top_k=-1, stop=["\n"],
                              stop_token_ids=[2], sampling_seed=5, min_new_tokens=1)  # fmt: skip
    body = _body(GenerateRequest(rid="g/1", input_ids=[4, 5], sampling=sampling))
    params = body["sampling_params"]
    assert body["request_id"] == "g/1" and body["token_ids"] == [4, 5]
    assert body["output_mode"] == "tokens"
    assert params["max_tokens"] == 9 and params["min_tokens"] == 1 and params["seed"] == 5
    assert params["top_k"] == 0 and params["logprobs"] == 0  # 0: the sampled token's only
    assert params["stop"] == ["\n"] and params["include_stop_str_in_output"]
    assert params["stop_token_ids"] == [2]


def test_greedy_is_temperature_zero_for_vllm():
    """SGLang's greedy (top_k 1 at any temperature) is vLLM's temperature 0: vLLM would
    sample top_k 1 at T > 0 and report log-prob 0 instead of log_softmax(z)."""
    body = _body(GenerateRequest(rid="g", input_ids=[1], sampling=SamplingParams(top_k=1)))
    assert body["sampling_params"]["temperature"] == 0.0
    assert body["sampling_params"]["top_k"] == 0


def test_versions_come_from_vllms_spans_and_its_first_version_is_ours_zero():
    engine = VLLMEngine("http://x")
    engine.version = 7
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 5}]
    assert list(engine._versions(spans, 6)) == [0, 0, 3, 3, 3, 7]  # past the spans: ours


def test_finish_reasons_read_as_sglangs():
    call = _Call("r")
    assert _finish({"finish_reason": "stop", "stop_reason": None}, [5, 2], call).matched == 2
    assert _finish({"finish_reason": "stop", "stop_reason": "\n"}, [5], call).matched == "\n"
    assert _finish({"finish_reason": "length"}, [5, 6], call).length == 2
    assert _finish({"finish_reason": "abort"}, [], call).type == "abort"


async def test_a_server_not_started_for_asyncrl_is_refused_with_the_arguments_it_lacks():
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "root": "m", "max_model_len": 64}]})

    async def rpc(request: web.Request) -> web.Response:  # vLLM's answer: no such method
        message = "Worker failed: 'CPUWorker' object has no attribute 'asyncrl_settings'"
        return web.json_response({"error": {"message": message, "code": 500}}, status=500)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/collective_rpc", rpc)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    engine = VLLMEngine(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(EngineError, match=r"not started for asyncrl \(\{'logprobs_mode': None"):
            await engine.start()
    finally:
        await engine.close()
        await runner.cleanup()
