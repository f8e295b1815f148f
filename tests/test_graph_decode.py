"""The static decode path for CUDA graphs, checked on the CPU: the KV pool, the buckets,
and decode steps that give the engine's dynamic path's tokens and log-probs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from asyncrl.engines.base import GenerateRequest, SamplingParams
from asyncrl.engines.torch.engine import TorchEngine
from asyncrl.engines.torch.graph_decode import (
    bucket_for,
    span_for,
)
from asyncrl.engines.torch.kv_pool import KVPool, pool_max_len
from tests.tiny_model import build_tiny_model


def test_buckets_pad_a_batch_and_a_span_to_the_next_captured_size():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 17, 33, 64, 65)] == [1, 2, 4, 8, 24, 48, 64, 96]
    with pytest.raises(ValueError, match="hold 1 to 512"):
        bucket_for(513)
    with pytest.raises(ValueError):
        bucket_for(0)
    assert [span_for(p, 4096) for p in (1, 256, 257, 1000, 3000)] == [256, 256, 512, 1024, 4096]
    assert span_for(700, 600) == 600  # never past the pool


def test_the_pool_keeps_rows_compact_and_each_rows_keys_whole():
    pool = KVPool(layers=2, rows=3, kv_heads=1, max_len=8, head_dim=2, dtype=torch.float32,
                  device="cpu")  # fmt: skip

    def kv(fill: float, n: int) -> list[torch.Tensor]:
        return [torch.full((1, n, 2), fill + layer) for layer in range(2)]

    for fill, n in ((10.0, 3), (20.0, 5), (30.0, 2)):
        pool.add(kv(fill, n), kv(-fill, n), n)
    with pytest.raises(RuntimeError, match="all in use"):
        pool.add(kv(0.0, 1), kv(0.0, 1), 1)
    assert pool.remove(0) == 2  # the last row moved into the freed one
    assert pool.lengths == [2, 5, 0] and pool.live == 2
    assert torch.equal(pool.keys[1][0, :, :2], torch.full((1, 2, 2), 31.0))
    assert torch.equal(pool.values[0][1, :, :5], torch.full((1, 5, 2), -20.0))
    assert pool.remove(1) is None and pool.live == 1
    with pytest.raises(ValueError, match="do not fit"):
        pool.add(kv(0.0, 9), kv(0.0, 9), 9)
    # 1 GiB at 0.5 for 64 rows of 1 KiB positions: 8192 positions each, capped by context
    assert pool_max_len(1024, 1 << 30, 0.5, 64, 4096) == 4096
    assert pool_max_len(1024, 1 << 30, 0.5, 64, 100_000) == 8192


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("graph") / "model"
    build_tiny_model(path)
    return path


async def outputs(engine: TorchEngine, requests: list[GenerateRequest], retract: bool = False):
    """Each request's final output; with ``retract``, a pause that drops every row's KV
    (to prefill it again) once the requests are running."""
    task = asyncio.create_task(engine.run())

    async def one(request: GenerateRequest):
        return [o async for o in engine.generate(request)][-1]

    try:
        calls = [asyncio.create_task(one(r)) for r in requests]
        if retract:
            for _ in range(2000):  # until every request is decoding
                if engine.load().num_running_reqs == len(requests):
                    break
                await asyncio.sleep(0.005)
            await engine.pause("retract")
            await engine.resume()
        return await asyncio.gather(*calls)
    finally:
        task.cancel()


def requests(seeded: bool) -> list[GenerateRequest]:
    prompts = [[5, 9, 11], list(range(20, 60)), [7] * 17, [100, 101, 102, 103, 104]]
    prompts += [prompts[0], prompts[3]]  # a group's samples: one prefill, KV copied
    out = []
    for i, (prompt, budget) in enumerate(zip(prompts, [12, 5, 9, 40, 7, 20], strict=True)):
        sampling = (
            SamplingParams(temperature=0.8, max_new_tokens=budget, sampling_seed=i, ignore_eos=True)
            if seeded
            else SamplingParams(temperature=0, max_new_tokens=budget, ignore_eos=True)
        )
        out.append(GenerateRequest(rid=str(i), input_ids=prompt, sampling=sampling,
                                   return_logprob=True))  # fmt: skip
    return out


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("retract", [False, True])
async def test_the_static_path_gives_the_dynamic_paths_tokens_and_logprobs(
    model_dir: Path, seeded: bool, retract: bool
):
    """Six requests of different lengths and budgets, two repeating a prompt (rows leave,
    and the pool moves its last row into each gap), greedy or seeded at T 0.8, with or
    without a retract (every row prefilled again into the pool): the static path's tokens
    are the dynamic path's and its log-probs within 1e-5."""
    engines = [
        TorchEngine.from_pretrained(
            str(model_dir), packed=False, static_decode=static, max_running=8
        )
        for static in (False, True)
    ]
    assert engines[1].scheduler.batch.__class__.__name__ == "PoolBatch"
    dynamic, static = [await outputs(e, requests(seeded), retract) for e in engines]
    for d, s in zip(dynamic, static, strict=True):
        assert s.output_ids == d.output_ids and s.finish_reason == d.finish_reason
        assert max(abs(a - b) for a, b in zip(s.logprobs, d.logprobs, strict=True)) < 1e-5
    assert engines[1].scheduler.batch.pool.live == 0  # every row left the pool


async def test_a_request_past_the_pools_length_is_refused_and_one_at_it_stops(model_dir: Path):
    engine = TorchEngine.from_pretrained(str(model_dir), packed=False, static_decode=True,
                                         max_running=2, max_total_tokens=2 * 64)  # fmt: skip
    assert engine.context_length == 64
    with pytest.raises(ValueError, match="context length"):
        engine.check(GenerateRequest(rid="long", input_ids=[5] * 80))
    long = SamplingParams(temperature=0, max_new_tokens=None, ignore_eos=True)
    (out,) = await outputs(engine, [GenerateRequest(rid="fill", input_ids=[5] * 60, sampling=long)])
    assert out.finish_reason.type == "length" and len(out.output_ids) == 4


async def test_every_row_count_up_to_the_pool_has_a_bucket(model_dir: Path):
    engine = TorchEngine.from_pretrained(str(model_dir), packed=False, static_decode=True,
                                         max_running=10)  # fmt: skip
    decoder = engine.scheduler.batch.decoder
    assert decoder.buckets == (1, 2, 4, 8, 10)
    ten = [GenerateRequest(rid=str(i), input_ids=[5 + i, 6], sampling=SamplingParams(
        temperature=0, max_new_tokens=3, ignore_eos=True)) for i in range(10)]  # fmt: skip
    assert all(len(o.output_ids) == 3 for o in await outputs(engine, ten))


async def test_released_memory_comes_back_and_decodes_the_same(model_dir: Path):
    """``release_memory`` frees the idle pool (and moves the weights); after
    ``resume_memory`` the same requests give the same tokens."""
    engine = TorchEngine.from_pretrained(str(model_dir), packed=False, static_decode=True,
                                         max_running=8)  # fmt: skip
    before = await outputs(engine, requests(seeded=False))
    decoder, dropped = engine.scheduler.batch.decoder, []
    decoder.invalidate = lambda: dropped.append(1)  # CUDA graphs read what moved
    await_all = asyncio.create_task(engine.run())
    try:
        await engine.release_memory(None)
        assert engine.scheduler.batch.pool.keys == []
        await engine.resume_memory(None)
        assert len(dropped) == 2
    finally:
        await_all.cancel()
    after = await outputs(engine, requests(seeded=False))
    assert [o.output_ids for o in after] == [o.output_ids for o in before]


@pytest.mark.parametrize("static", [False, True])
async def test_a_retract_requeues_the_running_rows_oldest_first(model_dir: Path, static: bool):
    """The first row finishes and the last takes its place; a retract then queues the
    survivors in arrival order, not the batch's."""
    engine = TorchEngine.from_pretrained(str(model_dir), packed=False, static_decode=static,
                                         max_running=8)  # fmt: skip
    task = asyncio.create_task(engine.run())

    async def one(i: int, budget: int):
        sampling = SamplingParams(temperature=0, max_new_tokens=budget, ignore_eos=True)
        request = GenerateRequest(rid=str(i), input_ids=[5 + i, 6], sampling=sampling)
        return [o async for o in engine.generate(request)][-1]

    try:
        calls = [asyncio.create_task(one(i, b)) for i, b in enumerate([2, *[120] * 5])]
        await calls[0]
        await engine.pause("retract")
        assert [s.req.rid for s in engine.scheduler.waiting] == ["1", "2", "3", "4", "5"]
        await engine.resume()
        assert [len(o.output_ids) for o in await asyncio.gather(*calls)] == [2, *[120] * 5]
    finally:
        task.cancel()
