"""SimEngine (asyncrl/engines/sim/engine.py): response lengths follow the latency model,
modelled time follows its step formula, versions, aborts and pauses behave as in every
engine, and it serves SGLang's API through the real server and client."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest

from asyncrl.engines.base import GenerateOutput, GenerateRequest, SamplingParams
from asyncrl.engines.sim.engine import SimEngine
from asyncrl.engines.sim.latency import LatencyModel
from asyncrl.errors import EngineError

FAST = {"time_scale": 1e4}  # modelled seconds run 10,000 times faster than real ones


async def running(engine: SimEngine) -> AsyncIterator[SimEngine]:
    task = asyncio.create_task(engine.run())
    try:
        yield engine
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def final(engine: SimEngine, rid: str, max_new_tokens: int | None = 4096) -> GenerateOutput:
    request = GenerateRequest(rid=rid, input_ids=[1, 2, 3],
                              sampling=SamplingParams(max_new_tokens=max_new_tokens))  # fmt: skip
    outputs = [out async for out in engine.generate(request)]
    return outputs[-1]


def test_lengths_follow_the_lognormal_median_and_tail():
    model = LatencyModel(length_median=200, length_p99_ratio=6.0, length_max=100_000)
    rng = np.random.default_rng(0)
    lengths = np.array([model.sample_length(rng) for _ in range(20_000)])
    median, p99 = np.median(lengths), np.percentile(lengths, 99)
    assert abs(median / 200 - 1) < 0.03
    assert abs(p99 / median / 6.0 - 1) < 0.08
    capped = LatencyModel(length_median=200, length_p99_ratio=6.0, length_max=300)
    assert max(capped.sample_length(rng) for _ in range(5000)) == 300
    fixed = LatencyModel(length_median=37, length_p99_ratio=1.0)
    assert {fixed.sample_length(rng) for _ in range(100)} == {37}


async def test_responses_end_with_eos_or_at_the_cap():
    engine = SimEngine(LatencyModel(length_median=50, length_p99_ratio=1.0, **FAST), eos_token_id=7)
    async for e in running(engine):
        free = await final(e, "free")
        assert len(free.output_ids) == 50 and free.output_ids[-1] == 7
        assert free.finish_reason is not None and free.finish_reason.type == "stop"
        cut = await final(e, "cut", max_new_tokens=20)
        assert len(cut.output_ids) == 20 and cut.finish_reason.type == "length"
        assert all(lp <= 0 for lp in cut.logprobs) and cut.versions == [0] * 20


async def test_modelled_time_grows_with_the_running_batch():
    latency = LatencyModel(decode_base_s=0.01, decode_s_per_seq=0.001, prefill_s_per_token=0.0,
                           length_median=100, length_p99_ratio=1.0, **FAST)  # fmt: skip
    alone = SimEngine(latency)
    async for e in running(alone):
        await final(e, "only")
    batched = SimEngine(latency, max_running=32)
    async for e in running(batched):
        await asyncio.gather(*(final(e, f"r{i}") for i in range(32)))
    # 100 steps either way: one request costs 0.011 s a step, 32 together 0.042 s.
    assert alone.steps == batched.steps == 100
    assert math.isclose(alone.clock, 100 * 0.011) and math.isclose(batched.clock, 100 * 0.042)


async def test_prefill_and_the_running_cap_are_modelled():
    latency = LatencyModel(decode_base_s=0.0, decode_s_per_seq=0.0, prefill_s_per_token=0.5,
                           length_median=1, length_p99_ratio=1.0, **FAST)  # fmt: skip
    engine = SimEngine(latency, max_running=2)
    async for e in running(engine):
        await asyncio.gather(*(final(e, f"r{i}") for i in range(5)))
    assert engine.steps == 3 and math.isclose(engine.clock, 5 * 3 * 0.5)  # 2 + 2 + 1 admitted


async def test_tokens_carry_the_version_they_were_sampled_with():
    # 100,000 tokens at 0.02 modelled s take 2 s of wall time at scale 1,000: the update
    # lands mid-response, and the abort returns what was decoded on both sides of it.
    latency = LatencyModel(length_median=100_000, length_max=100_000, length_p99_ratio=1.0,
                           weight_update_s=2.0, time_scale=1e3)  # fmt: skip
    engine = SimEngine(latency)
    async for e in running(engine):
        generation = asyncio.create_task(final(e, "long", max_new_tokens=None))
        await asyncio.sleep(0.05)
        await engine.update_weights_from_tensors({}, 5)
        await asyncio.sleep(0.05)
        engine.abort("long")
        out = await generation
    assert engine.version == 5 and out.versions[0] == 0 and out.versions[-1] == 5
    assert out.versions == sorted(out.versions) and set(out.versions) == {0, 5}
    assert len(out.output_ids) == len(out.logprobs) == len(out.versions) < 100_000


async def test_abort_and_pause_return_partial_outputs():
    # 10,000 tokens at 0.02 modelled s take 2 s of wall time at scale 100.
    engine = SimEngine(LatencyModel(length_median=10_000, length_p99_ratio=1.0, time_scale=100))
    async for e in running(engine):
        first = asyncio.create_task(final(e, "job-1", max_new_tokens=None))
        second = asyncio.create_task(final(e, "job-2", max_new_tokens=None))
        other = asyncio.create_task(final(e, "other", max_new_tokens=None))
        await asyncio.sleep(0.05)
        assert engine.abort("job-", prefix=True) == 2  # a group cancel, by id prefix
        for out in await asyncio.gather(first, second):
            assert out.finish_reason.type == "abort" and 1 <= len(out.output_ids) < 10_000
            assert out.output_ids[-1] != e.eos_token_id  # an aborted response has no EOS
        await engine.pause("abort")
        assert (await other).finish_reason.type == "abort"
        held = asyncio.create_task(final(e, "after", max_new_tokens=3))
        await asyncio.sleep(0.01)
        assert not held.done()  # a paused engine holds new requests
        await engine.resume()
        assert len((await held).output_ids) == 3


def test_what_it_cannot_simulate_is_refused():
    engine = SimEngine(vocab_size=100)
    bad = {
        "integers in": GenerateRequest(rid="a", input_ids=[100]),
        "no text": GenerateRequest(rid="b", input_ids=[1], sampling=SamplingParams(stop="x")),
        "no top or chosen": GenerateRequest(rid="c", input_ids=[1], top_logprobs_num=2),
        "chosen tokens": GenerateRequest(rid="d", input_ids=[1], token_ids_logprob=[3]),
        "json_schema .constrained": GenerateRequest(
            rid="e", input_ids=[1], sampling=SamplingParams(json_schema="{}")
        ),
    }
    for message, request in bad.items():
        with pytest.raises(EngineError, match=message):
            engine.check(request)


async def test_it_serves_sglangs_api_through_the_server_and_client():
    from asyncrl.engines.client.sglang import SGLangClient
    from asyncrl.engines.server.app import EngineServer

    engine = SimEngine(LatencyModel(length_median=8, length_p99_ratio=1.0, **FAST))
    server = EngineServer(engine)
    url = await server.start("127.0.0.1", 0)
    try:
        async with SGLangClient([url]) as client:
            out = await client.generate([5, 6, 7], {"max_new_tokens": 16, "temperature": 1.0})
            assert len(out.output_ids) == 8 and out.finish_reason.type == "stop"
            assert out.logprobs is not None and len(out.logprobs) == 8 and out.versions == [0] * 8
            await client.update_weights(3, path="/nonexistent")  # pause, flush, load, continue
            again = await client.generate([5], {"max_new_tokens": 4})
            assert again.weight_version == 3 and again.versions == [3] * 4
            assert again.finish_reason.type == "length"
            # The engine seam: an engine that joins no weight group is refused by name.
            async with aiohttp.ClientSession() as http:
                body = {"master_port": 1, "world_size": 2}
                async with http.post(f"{url}/init_weights_update_group", json=body) as reply:
                    assert reply.status == 400
                    assert "SimEngine does not join weight groups" in await reply.text()
    finally:
        await server.stop()


async def test_a_rollout_actors_engine_host_embeds_it_with_the_models_vocab(tmp_path):
    import json

    from asyncrl.engines.config import EngineConfig
    from asyncrl.rollout.engines import EngineHost

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300, "eos_token_id": [9]}))
    sim = {"length_median": 6, "length_p99_ratio": 1.0, "time_scale": 1e4}
    config = EngineConfig(type="sim", model_path=str(tmp_path), sim=sim, max_running=8)
    async with EngineHost(config) as host:
        assert host.engine is not None and host.engine.vocab_size == 300
        assert host.client is not None
        out = await host.client.generate([1, 2], {"max_new_tokens": 32})
        assert len(out.output_ids) == 6 and out.output_ids[-1] == 9
        assert all(0 <= t < 300 for t in out.output_ids)
        await host.load_tensors({}, 4)  # what the weight receiver does with a version
        assert (await host.client.generate([1], {"max_new_tokens": 2})).versions == [4, 4]
    with pytest.raises(ValueError, match="sim engine runs embedded"):
        EngineConfig(type="sim", urls=["http://127.0.0.1:1"])


async def test_one_host_runs_several_sim_engines_and_updates_them_together():
    from asyncrl.engines.config import EngineConfig
    from asyncrl.rollout.engines import EngineHost

    sim = {"length_median": 5, "length_p99_ratio": 1.0, "time_scale": 1e4}
    config = EngineConfig(type="sim", sim=sim, sim_engines=3, max_running=4)
    async with EngineHost(config) as host:
        assert len(host.sims) == 3 and host.client is not None
        outs = await asyncio.gather(*(host.client.generate([1], {}) for _ in range(12)))
        assert all(len(o.output_ids) == 5 for o in outs)
        assert all(e.steps > 0 for e in host.sims)  # the client spread the requests
        await host.load_tensors({}, 2)
        assert [e.version for e in host.sims] == [2, 2, 2]


@pytest.mark.parametrize("in_process", [True, False])
async def test_an_engine_host_calls_its_engines_in_process_unless_told_not_to(
    monkeypatch, in_process
):
    from asyncrl.engines.config import EngineConfig
    from asyncrl.engines.server.app import EngineServer
    from asyncrl.rollout.engines import EngineHost

    over_http: list[str] = []
    generate = EngineServer.generate

    async def counted(self: EngineServer, request: Any) -> Any:
        over_http.append(request.path)
        return await generate(self, request)

    monkeypatch.setattr(EngineServer, "generate", counted)  # the route binds it per server
    sim = {"length_median": 5, "length_p99_ratio": 1.0, "time_scale": 1e4}
    config = EngineConfig(type="sim", sim=sim, sim_engines=2, in_process=in_process)
    async with EngineHost(config) as host:
        assert host.generator is not None
        outs = [await host.generator.generate([1], {}) for _ in range(4)]
    assert all(len(o.output_ids) == 5 for o in outs)
    assert over_http == ([] if in_process else ["/generate"] * 4)
    assert len({o.engine for o in outs}) == 2  # both sims served, either way


async def test_callers_wake_at_the_end_or_every_stream_interval_tokens():
    # 10 tokens take 2 ms of wall time at scale 100: the reader keeps up.
    engine = SimEngine(LatencyModel(length_median=50, length_p99_ratio=1.0, time_scale=100))

    async def outputs(every: int | None) -> list[int]:
        sampling = SamplingParams(max_new_tokens=100, stream_interval=every)
        request = GenerateRequest(rid=f"s{every}", input_ids=[1], sampling=sampling)
        return [len(out.output_ids) async for out in engine.generate(request)]

    async for _ in running(engine):
        assert await outputs(None) == [50]  # one copy of the output, not one per token
        # Every 10 tokens; a reader slower than the engine gets the latest (as from SGLang).
        every = await outputs(10)
        assert every[-1] == 50 and len(every) > 1 and all(n % 10 == 0 for n in every)


async def test_a_late_event_loop_does_not_slow_modelled_time():
    # 1,000 tokens at 0.02 modelled s: 20 modelled s, 0.2 s of wall time at scale 100. A
    # loop blocked for 0.4 s wakes the engine late; the steps it owes are laid from its
    # anchor, so the response is due already and ends at once, not 0.2 s later.
    import time

    engine = SimEngine(LatencyModel(length_median=1000, length_p99_ratio=1.0, time_scale=100))
    async for e in running(engine):
        generation = asyncio.create_task(final(e, "late", max_new_tokens=None))
        await asyncio.sleep(0.01)
        time.sleep(0.4)  # noqa: ASYNC251 - the whole loop stalls, on purpose
        for _ in range(20):
            await asyncio.sleep(0)
        assert generation.done()
        assert len(generation.result().output_ids) == 1000
    assert engine.steps == 1000 and math.isclose(engine.clock, 1000 * 0.0201 + 3 * 2e-5)


async def test_a_token_stride_carries_one_id_for_k_modelled_tokens():
    latency = LatencyModel(decode_base_s=0.01, decode_s_per_seq=0.0, prefill_s_per_token=0.0,
                           length_median=1000, length_p99_ratio=1.0, token_stride=64,
                           switch_s=3.0, **FAST)  # fmt: skip
    engine = SimEngine(latency)
    async for e in running(engine):
        out = await final(e, "long", max_new_tokens=None)
        await e.release_memory(None)
        await e.resume_memory(None)
    # ceil(1000 / 64) = 16 ids, 16 steps of 64 modelled decode steps each, then the switch.
    assert len(out.output_ids) == 16 and out.output_ids[-1] == e.eos_token_id
    assert engine.steps == 16 and math.isclose(engine.clock, 16 * 64 * 0.01 + 3.0)


async def test_a_resumed_partial_decodes_what_its_length_has_left_on_any_engine():
    # 10,000 tokens at 0.02 modelled s: 2 s of wall time at scale 100; cut after 0.05 s.
    latency = LatencyModel(length_median=10_000, length_p99_ratio=1.0, time_scale=100)
    first, other = SimEngine(latency, seed=1), SimEngine(latency.model_copy(update=FAST), seed=2)
    prompt = [5, 6, 7]
    async for e in running(first):
        request = GenerateRequest(rid="r", input_ids=prompt,
                                  sampling=SamplingParams(max_new_tokens=None))  # fmt: skip
        generation = asyncio.create_task(_last(e.generate(request)))
        await asyncio.sleep(0.05)
        e.abort("r")
        partial = await generation
    assert partial.finish_reason.type == "abort" and 3 < len(partial.output_ids) < 10_000
    async for e in running(other):  # another engine, another seed: no state is shared
        rest = GenerateRequest(rid="r2", input_ids=prompt + partial.output_ids,
                               sampling=SamplingParams(max_new_tokens=None))  # fmt: skip
        capped = GenerateRequest(rid="r3", input_ids=prompt,  # cut at its cap, after `rest`
                                 sampling=SamplingParams(max_new_tokens=10_000))  # fmt: skip
        out, cut = await asyncio.gather(_last(e.generate(rest)), _last(e.generate(capped)))
    # Beside a continuation, a capped response ends by length with a plain int (numpy's,
    # from the continuation's length, broke the server's JSON reply).
    assert cut.finish_reason.type == "length" and type(cut.finish_reason.length) is int
    assert len(partial.output_ids) + len(out.output_ids) == 10_000
    assert out.finish_reason.type == "stop" and out.output_ids[-1] == e.eos_token_id


async def _last(outputs: AsyncIterator[GenerateOutput]) -> GenerateOutput:
    return [out async for out in outputs][-1]
