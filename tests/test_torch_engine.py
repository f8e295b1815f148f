"""TorchEngine on a tiny Qwen2: exact log-probs, greedy equal to HF generate, continuous
batching, aborts and resumes, pause modes and weight swaps at step boundaries."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from asyncrl.engines.base import FinishReason, GenerateOutput, GenerateRequest, SamplingParams
from asyncrl.engines.torch import cpu_linear as cpu_linear
from asyncrl.engines.torch.engine import EngineError, TorchEngine
from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("tiny")
    model, tokenizer = build_tiny_model(directory)
    return directory, model, tokenizer


@pytest.fixture
async def engine(tiny) -> AsyncIterator[TorchEngine]:
    directory, _, _ = tiny
    eng = TorchEngine.from_pretrained(str(directory))
    task = asyncio.create_task(eng.run())
    yield eng
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def run(engine: TorchEngine, rid: str, ids: list[int], **sampling) -> GenerateOutput:
    request = GenerateRequest(rid=rid, input_ids=ids, sampling=SamplingParams(**sampling))
    return await final(engine, request)


async def final(engine: TorchEngine, request: GenerateRequest) -> GenerateOutput:
    out = None
    async for snapshot in engine.generate(request):
        out = snapshot
    assert out is not None and out.finish_reason is not None
    return out


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def teacher_forced(model, ids: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids + output])).logits[0].float()
    logp = torch.log_softmax(logits, -1)[len(ids) - 1 : -1]
    return logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


PROMPTS = [[5, 9, 11], list(range(20, 47)), [300], list(range(100, 108))]


async def test_greedy_equals_hf_generate_for_staggered_requests(engine, tiny):
    _, model, _ = tiny

    async def later(i: int, ids: list[int]) -> GenerateOutput:
        await asyncio.sleep(0.02 * i)  # join a running batch at different steps
        return await run(
            engine, f"g{i}", ids, temperature=0, max_new_tokens=8 + 9 * i, ignore_eos=True
        )

    outs = await asyncio.gather(*(later(i, p) for i, p in enumerate(PROMPTS)))
    for ids, out in zip(PROMPTS, outs, strict=True):
        assert out.output_ids == hf_greedy(model, ids, len(out.output_ids))
        assert (
            out.finish_reason.type == "length" and len(out.output_ids) == out.finish_reason.length
        )


async def test_sampled_logprobs_equal_teacher_forced_logprobs(engine, tiny):
    _, model, _ = tiny
    outs = await asyncio.gather(
        *(run(engine, f"s{i}", p, max_new_tokens=24, sampling_seed=i, ignore_eos=True)
          for i, p in enumerate(PROMPTS))
    )  # fmt: skip
    for ids, out in zip(PROMPTS, outs, strict=True):
        expected = teacher_forced(model, ids, out.output_ids)
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)
        assert out.versions == [0] * len(out.output_ids)


async def test_a_seeded_request_samples_the_same_tokens_alone_or_in_a_batch(engine):
    alone = await run(engine, "alone", PROMPTS[1], max_new_tokens=16, sampling_seed=7)
    crowd = await asyncio.gather(
        run(engine, "crowd", PROMPTS[1], max_new_tokens=16, sampling_seed=7),
        *(run(engine, f"other{i}", p, max_new_tokens=30) for i, p in enumerate(PROMPTS)),
    )
    assert crowd[0].output_ids == alone.output_ids


async def test_a_groups_equal_prompts_share_one_prefill_and_sample_as_if_alone(engine, tiny):
    """n samples of one prompt admitted together: one prefill row, KV copied to the rest,
    and every sample's tokens and log-probs as if it ran alone; later ones take the
    prompt's KV from the prompt cache, with the same result."""
    _, model, _ = tiny
    prompt = PROMPTS[1]

    def request(rid: str, seed: int, start: int = 0) -> GenerateRequest:
        sampling = SamplingParams(max_new_tokens=12, sampling_seed=seed, ignore_eos=True)
        return GenerateRequest(
            rid=rid, input_ids=prompt, logprob_start_len=start, sampling=sampling
        )

    alone = [await final(engine, request(f"solo{i}", 40 + i)) for i in range(4)]
    reused = engine.stats["prefill_reused_rows"]
    await engine.pause("abort")  # hold the group so that one step admits all of it
    group = [asyncio.create_task(final(engine, request(f"group{i}", 40 + i))) for i in range(4)]
    await asyncio.sleep(0.05)
    await engine.resume()
    outs = await asyncio.gather(*group)
    assert engine.stats["prefill_reused_rows"] - reused == 3
    # prompt log-probs from position 0: SGLang counts no cached token before it
    assert [o.cached_tokens for o in (*alone, *outs)] == [0] * 8
    for solo, out in zip(alone, outs, strict=True):
        assert out.output_ids == solo.output_ids
        assert out.logprobs == pytest.approx(solo.logprobs, abs=1e-5)
        assert out.input_logprobs[1:] == pytest.approx(solo.input_logprobs[1:], abs=1e-5)
        expected = teacher_forced(model, prompt, out.output_ids)
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)
    assert len({tuple(o.output_ids) for o in outs}) > 1  # the copies drew their own streams
    for i, solo in enumerate(alone):  # one by one, as rows free: from the prompt cache
        out = await final(engine, request(f"late{i}", 40 + i, start=-1))
        assert out.cached_tokens == len(prompt) - 1  # SGLang: the last token is computed
        assert out.output_ids == solo.output_ids
        assert out.logprobs == pytest.approx(solo.logprobs, abs=1e-5)


async def test_one_admission_mixes_cached_shared_and_new_prompts_of_any_length(engine, tiny):
    """Prompts of several lengths in one prefill, some from the cache, some twice, some
    new: each row decodes its own prompt (greedy equals HF generate)."""
    _, model, _ = tiny
    for i in (0, 3):
        await run(engine, f"prime{i}", PROMPTS[i], temperature=0, max_new_tokens=1)
    prompts = [PROMPTS[3], PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    await engine.pause("abort")
    tasks = [
        asyncio.create_task(
            run(engine, f"mix{i}", p, temperature=0, max_new_tokens=10, ignore_eos=True)
        )
        for i, p in enumerate(prompts)
    ]
    await asyncio.sleep(0.05)
    await engine.resume()
    outs = await asyncio.gather(*tasks)
    for ids, out in zip(prompts, outs, strict=True):
        assert out.output_ids == hf_greedy(model, ids, 10)
    assert [o.cached_tokens for o in outs] == [7, 0, 2, 26, 0, 7]


async def test_the_prompt_cache_off_computes_every_prompt(tiny):
    eng = TorchEngine.from_pretrained(str(tiny[0]), prompt_cache_tokens=0)
    task = asyncio.create_task(eng.run())
    try:
        first = await run(eng, "a", PROMPTS[3], temperature=0, max_new_tokens=6)
        again = await run(eng, "b", PROMPTS[3], temperature=0, max_new_tokens=6)
        assert (first.cached_tokens, again.cached_tokens) == (0, 0)
        assert again.output_ids == first.output_ids and len(eng.scheduler.prompts) == 0
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    # with no step loop running, a flush or a KV release clears at once (nothing waits)
    assert await asyncio.wait_for(eng.flush_cache(), 5)
    await asyncio.wait_for(eng.release_memory(["kv_cache"]), 5)


async def draws(tiny, seed: int | str | None) -> list[list[int]]:
    """Unseeded requests one after another on a fresh engine seeded with ``seed``."""
    eng = TorchEngine.from_pretrained(str(tiny[0]), seed=seed)
    task = asyncio.create_task(eng.run())
    try:
        return [(await run(eng, f"r{i}", p, max_new_tokens=12)).output_ids
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_unseeded_requests_draw_from_the_engines_stream(tiny):
    """The same engine seed replays its draws; another seed, or none, draws others (a
    fixed count made every engine and every run of a job sample in lockstep)."""
    first = await draws(tiny, "0/rollout-0")
    assert await draws(tiny, "0/rollout-0") == first
    assert await draws(tiny, "0/rollout-1") != first
    assert await draws(tiny, "1/rollout-0") != first
    assert await draws(tiny, None) != await draws(tiny, None)


def pit(
    model, ids: list[int], output: list[int], temperature: float, gen: torch.Generator
) -> torch.Tensor:
    """The randomised probability integral transform ``F(x-) + V p(x)`` (V uniform) of
    each sampled token under ``softmax(z / T)``: uniform on [0, 1) when x was drawn
    from that distribution."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + output])).logits[0, len(ids) - 1 : -1].double()
    p = torch.softmax(logits / temperature, -1)
    x = torch.tensor(output)[:, None]
    px = p.gather(-1, x).squeeze(-1)
    below = p.cumsum(-1).gather(-1, x).squeeze(-1) - px
    return below + torch.rand(len(output), generator=gen, dtype=torch.double) * px


def chi2_of_deciles(u: torch.Tensor) -> float:
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    expected = len(u) / 10
    return float(((counts - expected) ** 2 / expected).sum())


async def test_sampled_tokens_follow_the_distribution_their_logprobs_come_from(tiny):
    """The engine's draws at T = 0.7 against the model's own ``softmax(z / 0.7)``: the
    PIT's deciles pass a chi-square test (9 degrees of freedom, 27.9 is p = 0.001), and
    fail it under T = 1 (the control: the test sees a wrong distribution). The logits are
    sharpened x3 so the temperature matters (a random tiny model's are nearly flat)."""
    model = copy.deepcopy(tiny[1])
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3)
    eng = TorchEngine(model, seed="pit")
    task = asyncio.create_task(eng.run())
    try:
        outs = await asyncio.gather(
            *(run(eng, f"p{i}", PROMPTS[i % 4], max_new_tokens=32, temperature=0.7,
                  ignore_eos=True) for i in range(64))
        )  # fmt: skip
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    gen = torch.Generator().manual_seed(0)
    at = {t: torch.cat([pit(model, PROMPTS[i % 4], o.output_ids, t, gen)
                        for i, o in enumerate(outs)]) for t in (0.7, 1.0)}  # fmt: skip
    assert chi2_of_deciles(at[0.7]) < 27.9 < chi2_of_deciles(at[1.0]), {
        t: chi2_of_deciles(u) for t, u in at.items()
    }


async def test_stop_token_ids_stop_strings_and_min_new_tokens(engine, tiny):
    tokenizer = tiny[2]
    same = {"max_new_tokens": 16, "sampling_seed": 3, "ignore_eos": True}
    free = await run(engine, "free", PROMPTS[0], **same)
    ids = free.output_ids
    cut = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # a token new there
    stopped = await run(engine, "st", PROMPTS[0], stop_token_ids=[ids[cut]], **same)
    assert stopped.output_ids == ids[: cut + 1]
    assert stopped.finish_reason.type == "stop" and stopped.finish_reason.matched == ids[cut]
    text = tokenizer.decode(ids)
    word = text[len(text) // 2 :][:3]
    by_text = await run(engine, "ss", PROMPTS[0], stop=[word], **same)
    assert by_text.finish_reason.type == "stop" and by_text.finish_reason.matched == word
    assert word in tokenizer.decode(by_text.output_ids)
    assert word not in tokenizer.decode(by_text.output_ids[:-1])
    late = await run(engine, "min", PROMPTS[0], min_new_tokens=cut + 3,
                     stop_token_ids=[ids[cut]], **same)  # fmt: skip
    assert len(late.output_ids) >= cut + 3 and ids[cut] not in late.output_ids[: cut + 3]


async def test_abort_returns_the_partial_and_resuming_it_continues_the_same_sequence(engine):
    full = await run(engine, "full", PROMPTS[1], temperature=0, max_new_tokens=200, ignore_eos=True)
    request = GenerateRequest(
        rid="cut", input_ids=PROMPTS[1],
        sampling=SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True),
    )  # fmt: skip
    partial = None
    async for partial in engine.generate(request):
        if len(partial.output_ids) >= 10 and partial.finish_reason is None:
            engine.abort("cut")
    assert partial.finish_reason.type == "abort" and partial.finish_reason.message == "Aborted"
    n = len(partial.output_ids)
    assert 10 <= n < 200 and len(partial.logprobs) == n
    assert partial.output_ids == full.output_ids[:n]
    rest = await run(engine, "resume", PROMPTS[1] + partial.output_ids, temperature=0,
                     max_new_tokens=200 - n, ignore_eos=True)  # fmt: skip
    assert partial.output_ids + rest.output_ids == full.output_ids


async def test_in_place_pause_and_weight_swap_stamps_new_tokens_with_the_new_version(engine, tiny):
    _, model, _ = tiny
    request = GenerateRequest(
        rid="swap", input_ids=PROMPTS[0],
        sampling=SamplingParams(max_new_tokens=60, ignore_eos=True, sampling_seed=1),
    )  # fmt: skip
    new_weights = {k: v + 0.01 for k, v in model.state_dict().items() if "norm" not in k}
    swapped = False
    async for out in engine.generate(request):
        if not swapped and len(out.output_ids) >= 5:
            await engine.pause("in_place")
            await engine.update_weights_from_tensors(new_weights, version=3)
            await engine.resume()
            swapped = True
    assert out.finish_reason.type == "length" and len(out.output_ids) == 60
    first_new = out.versions.index(3)
    assert first_new >= 5 and set(out.versions[:first_new]) == {0}
    assert set(out.versions[first_new:]) == {3} and engine.version == 3


async def test_an_in_place_update_writes_the_model_while_no_step_runs(engine, tiny):
    _, model, _ = tiny
    new_weights = {k: v + 0.01 for k, v in model.state_dict().items() if "norm" not in k}
    from asyncrl.wire.blob import layout

    assert engine.takes_in_place(layout(new_weights, 1 << 20, "b"))
    assert not engine.takes_in_place(layout({"nope": torch.zeros(2)}, 1 << 20, "b"))
    steps_during: list[float] = []

    async def fill(params: dict[str, torch.Tensor]) -> None:
        before = engine.stats["steps"]
        for name, t in new_weights.items():
            params[name].copy_(t)
            await asyncio.sleep(0)  # a transfer takes turns of the loop: no step may run
        steps_during.append(engine.stats["steps"] - before)

    request = GenerateRequest(
        rid="in-place", input_ids=PROMPTS[0],
        sampling=SamplingParams(max_new_tokens=60, ignore_eos=True, sampling_seed=1),
    )  # fmt: skip
    updated = False
    async for out in engine.generate(request):
        if not updated and len(out.output_ids) >= 5:
            await engine.update_weights_in_place(fill, version=4)
            updated = True
    assert steps_during == [0] and not engine.paused and engine.stats["update_pause_s"] > 0
    first_new = out.versions.index(4)
    assert first_new >= 5 and set(out.versions[first_new:]) == {4} and len(out.versions) == 60
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in new_weights.items())


def wide_qwen2() -> torch.nn.Module:
    """Wide enough that its linears are packed and q/k/v and gate/up fused
    (``cpu_linear.MIN_ELEMENTS``); the tiny model's are all below it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                         max_position_embeddings=256, initializer_range=0.05)  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def copies(engine: TorchEngine) -> int:
    """The packed or fused copies of weights the engine holds now."""
    plain = sum(getattr(m, "_packed", None) is not None for m in engine.model.modules())
    lean = engine.runner.lean.layers if engine.runner.lean is not None else []
    return plain + sum(f._fused is not None for layer in lean for f in (layer.qkv, layer.gate_up))


@pytest.mark.parametrize("lean", [True, False])
async def test_an_update_written_around_torchs_version_counter_reaches_the_packed_weights(lean):
    """The pull transport writes a version into the model's memory through numpy, unseen
    by torch's version counters: the engine's packed and fused copies
    (engines/torch/cpu_linear.py) must still be made again from the new weights; and
    release_memory frees them."""
    model = wide_qwen2()
    reference = copy.deepcopy(model)
    engine = TorchEngine(model, lean=lean)
    prompt, n = [5, 17, 42, 99], 12
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(engine.run())
        old = await run(engine, "old", prompt, max_new_tokens=n, temperature=0)  # packs them
        assert copies(engine) > 0 or not cpu_linear.packable(torch.float32)
        gen = torch.Generator().manual_seed(7)
        new = {k: v + 0.05 * torch.randn(v.shape, generator=gen)
               for k, v in reference.state_dict().items()}  # fmt: skip
        reference.load_state_dict(new)

        async def fill(params: dict[str, torch.Tensor]) -> None:
            for name, t in new.items():
                params[name].numpy()[:] = t.numpy()

        await engine.update_weights_in_place(fill, version=2)
        got = await run(engine, "new", prompt, max_new_tokens=n, temperature=0)
        assert got.output_ids == hf_greedy(reference, prompt, n) != old.output_ids
        await engine.release_memory(None)
        assert copies(engine) == 0
        await engine.resume_memory(None)
        again = await run(engine, "again", prompt, max_new_tokens=n, temperature=0)
        assert again.output_ids == got.output_ids
        task.cancel()


async def test_a_failed_in_place_update_aborts_requests_until_an_update_completes(engine, tiny):
    _, model, _ = tiny
    old = {k: v.clone() for k, v in model.state_dict().items()}
    long = asyncio.create_task(run(engine, "long", PROMPTS[1], max_new_tokens=400, ignore_eos=True))
    while engine.stats["generated_tokens"] < 3:  # noqa: ASYNC110 (no event to wait on)
        await asyncio.sleep(0.01)

    async def half(params: dict[str, torch.Tensor]) -> None:
        params["lm_head.weight"].add_(1.0)  # part of a version, then the trainer is gone
        raise ConnectionResetError("trainer lost mid-transfer")

    with pytest.raises(ConnectionResetError):
        await engine.update_weights_in_place(half, version=5)
    assert engine.torn and engine.version == 0
    # The request in flight returns its partial output; a new one is aborted at once:
    # nothing is sampled from the mix of two versions.
    cut = await asyncio.wait_for(long, 30)
    assert cut.finish_reason.type == "abort" and set(cut.versions) == {0}
    fresh = await asyncio.wait_for(run(engine, "fresh", PROMPTS[0], max_new_tokens=3), 30)
    assert fresh.finish_reason.type == "abort" and fresh.output_ids == []
    await engine.resume()  # refused: the weights are still a mix
    assert engine.torn
    await engine.update_weights_from_tensors(old, version=6)  # a complete one mends it
    assert not engine.torn
    after = await asyncio.wait_for(run(engine, "after", PROMPTS[0], max_new_tokens=3), 30)
    assert after.versions == [6, 6, 6]


async def test_pause_abort_answers_every_caller_and_holds_new_ones_until_resume(engine):
    longs = [
        asyncio.create_task(run(engine, f"l{i}", p, max_new_tokens=400, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
    await asyncio.sleep(0.2)
    await engine.pause("abort")
    assert all(t.done() for t in longs)  # pause returned only after every caller's output
    assert {t.result().finish_reason.type for t in longs} == {"abort"}
    held = asyncio.create_task(run(engine, "held", PROMPTS[0], max_new_tokens=3))
    await asyncio.sleep(0.2)
    assert not held.done()
    await engine.resume()
    assert len((await held).output_ids) == 3


async def test_retract_pause_recomputes_the_kv_and_continues_exactly(engine):
    full = await run(engine, "f", PROMPTS[3], temperature=0, max_new_tokens=40, ignore_eos=True)
    task = asyncio.create_task(
        run(engine, "r", PROMPTS[3], temperature=0, max_new_tokens=40, ignore_eos=True)
    )
    await asyncio.sleep(0.05)
    await engine.pause("retract")
    assert engine.load().num_running_reqs == 0
    await engine.resume()
    assert (await task).output_ids == full.output_ids


async def test_update_weights_from_disk_changes_outputs_and_version(engine, tmp_path: Path):
    before = await run(engine, "b", PROMPTS[1], temperature=0, max_new_tokens=10, ignore_eos=True)
    build_tiny_model(tmp_path, seed=1)
    await engine.update_weights_from_disk(str(tmp_path), version=7)
    after = await run(engine, "a", PROMPTS[1], temperature=0, max_new_tokens=10, ignore_eos=True)
    assert after.logprobs != before.logprobs and after.versions == [7] * 10
    # the prompt's KV from version 0 is not reused: every log-prob is the new model's
    assert after.cached_tokens == 0
    new_model, _ = build_tiny_model(tmp_path / "again", seed=1)
    expected = teacher_forced(new_model, PROMPTS[1], after.output_ids)
    assert torch.allclose(torch.tensor(after.logprobs), expected, atol=1e-4)
    with pytest.raises(EngineError, match=r"no \*\.safetensors"):
        await engine.update_weights_from_disk(str(tmp_path / "missing"), version=8)
    assert engine.version == 7


@pytest.mark.parametrize(
    ("ids", "sampling", "match"),
    [
        ([], {}, "input_ids is empty"),
        ([1, 99999], {}, "must be integers in"),
        ([1, 2.5], {}, "must be integers in"),
        (list(range(1, 500)) * 2, {}, "longer than the model's context length"),
        ([1] * 500, {"max_new_tokens": 13}, "You requested a total of 513 tokens: 500 tokens"),
        ([1], {"top_p": 0}, "top_p"),
        ([1], {"regex": "a+", "json_schema": "{}"}, "Only one of regex, json_schema"),
        ([1], {"stop_token_ids": [99999]}, "stop_token_ids: 99999 is not in"),
        ([1], {"logit_bias": {"99999": 1.0}}, "logit_bias: token 99999 is not in"),
        ([1], {"logit_bias": {"eos": 1.0}}, "logit_bias: key 'eos' is not a token id"),
    ],
)
async def test_bad_requests_are_refused_and_the_engine_keeps_serving(engine, ids, sampling, match):
    with pytest.raises(ValueError, match=match):
        await run(engine, "bad", ids, **sampling)
    assert len((await run(engine, "good", [1, 2], max_new_tokens=2)).output_ids) == 2


async def test_a_duplicate_in_flight_rid_is_refused(engine):
    first = asyncio.create_task(run(engine, "dup", PROMPTS[0], max_new_tokens=100))
    await asyncio.sleep(0.05)
    with pytest.raises(EngineError, match="Duplicate request ID"):
        await run(engine, "dup", PROMPTS[0], max_new_tokens=2)
    await first


def full_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Teacher-forced log-softmax at every position of ``ids`` (row i predicts ids[i + 1])."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def check_top_rows(rows, logp: torch.Tensor, k: int) -> None:
    """Each row is the k most likely (logprob, id) pairs of the matching ``logp`` row."""
    assert len(rows) == logp.shape[0]
    for row, expected in zip(rows, logp, strict=True):
        values = [v for v, _ in row]
        assert len(row) == k and values == sorted(values, reverse=True)
        ids = torch.tensor([t for _, t in row])
        assert torch.allclose(torch.tensor(values), expected[ids], atol=1e-4)
        assert torch.allclose(torch.tensor(values), torch.topk(expected, k).values, atol=1e-4)


async def test_top_logprobs_are_the_top_k_of_the_distribution_each_token_was_sampled_from(
    engine, tiny
):
    _, model, _ = tiny
    prompt = PROMPTS[1]
    request = GenerateRequest(
        rid="top", input_ids=prompt, top_logprobs_num=4, logprob_start_len=0,
        sampling=SamplingParams(max_new_tokens=12, sampling_seed=5, ignore_eos=True),
    )  # fmt: skip
    out = await final(engine, request)
    logp = full_logprobs(model, prompt + out.output_ids)
    check_top_rows(out.top_logprobs, logp[len(prompt) - 1 : -1], 4)
    for token, logprob, row in zip(out.output_ids, out.logprobs, out.top_logprobs, strict=True):
        for value, alternative in row:  # the same log-softmax the token was drawn from
            if alternative == token:
                assert value == pytest.approx(logprob, abs=1e-6)
    assert out.input_top_logprobs is not None and out.input_top_logprobs[0] is None
    check_top_rows(out.input_top_logprobs[1:], logp[: len(prompt) - 1], 4)
    greedy = GenerateRequest(
        rid="top-greedy", input_ids=prompt, top_logprobs_num=2,
        sampling=SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True),
    )  # fmt: skip
    out = await final(engine, greedy)
    assert out.input_top_logprobs is None  # logprob_start_len -1: output only
    for token, logprob, row in zip(out.output_ids, out.logprobs, out.top_logprobs, strict=True):
        assert row[0][1] == token and row[0][0] == pytest.approx(logprob, abs=1e-6)


async def test_no_top_logprobs_are_computed_unless_asked_for(engine):
    out = await run(engine, "no-top", PROMPTS[0], max_new_tokens=3)
    assert out.top_logprobs is None and out.input_top_logprobs is None


async def test_stop_regex_stops_at_the_first_match_in_the_decoded_output(engine, tiny):
    tokenizer = tiny[2]
    same = {"max_new_tokens": 16, "sampling_seed": 3, "ignore_eos": True}
    free = await run(engine, "free-re", PROMPTS[0], **same)
    text = tokenizer.decode(free.output_ids)
    word = text[len(text) // 2 :][:3]
    pattern = re.escape(word[0]) + r"[\s\S]" + re.escape(word[2])
    out = await run(engine, "re", PROMPTS[0], stop_regex=[pattern], **same)
    assert out.finish_reason == FinishReason(type="stop", matched=pattern)
    assert out.output_ids == free.output_ids[: len(out.output_ids)]
    assert re.search(pattern, tokenizer.decode(out.output_ids))
    assert not re.search(pattern, tokenizer.decode(out.output_ids[:-1]))


async def test_a_stop_string_is_not_held_back_by_min_new_tokens(engine, tiny):
    """SGLang's string check has no min_new_tokens gate (only EOS and stop tokens are
    held back): a stop string sampled early ends the request there."""
    tokenizer = tiny[2]
    same = {"max_new_tokens": 16, "sampling_seed": 3, "ignore_eos": True}
    free = await run(engine, "free-min", PROMPTS[0], **same)
    early = tokenizer.decode(free.output_ids[:2])[-2:]  # in the text by token 2
    out = await run(engine, "min", PROMPTS[0], stop=early, min_new_tokens=8, **same)
    assert out.finish_reason == FinishReason(type="stop", matched=early)
    n = len(out.output_ids)
    assert 1 <= n <= 2 and out.output_ids == free.output_ids[:n]


async def test_stop_strings_and_regexes_are_refused_without_a_tokenizer(tiny):
    engine = TorchEngine(tiny[1])  # token-in/token-out only
    for sampling in ({"stop": "x"}, {"stop_regex": "x+"}):
        request = GenerateRequest(rid="t", input_ids=[1], sampling=SamplingParams(**sampling))
        with pytest.raises(EngineError, match="no tokenizer"):
            engine.check(request)


async def test_cached_tokens_counts_a_prompt_served_from_the_prompt_cache(engine):
    partial = await run(engine, "c0", PROMPTS[3], temperature=0, max_new_tokens=5)
    resumed = await run(engine, "c1", PROMPTS[3] + partial.output_ids, max_new_tokens=5)
    assert (partial.cached_tokens, resumed.cached_tokens) == (0, 0)  # new prompts
    assert resumed.prompt_tokens == len(PROMPTS[3]) + 5
    again = await run(engine, "c2", PROMPTS[3], temperature=0, max_new_tokens=5)
    assert again.cached_tokens == len(PROMPTS[3]) - 1 and again.output_ids == partial.output_ids
    assert await engine.flush_cache()
    flushed = await run(engine, "c3", PROMPTS[3], temperature=0, max_new_tokens=5)
    assert flushed.cached_tokens == 0 and flushed.output_ids == partial.output_ids
    task = asyncio.create_task(run(engine, "c4", PROMPTS[2], max_new_tokens=60, ignore_eos=True))
    await asyncio.sleep(0.05)
    await engine.pause("retract")  # its prompt and output are recomputed, from no cache
    await engine.resume()
    assert (await task).cached_tokens == 0
    await engine.pause("abort")
    await engine.release_memory(["weights"])  # a weight move drops the cache at once
    assert len(engine.scheduler.prompts) == 0
    await engine.resume_memory(["weights"])
    await engine.resume()


async def test_destroying_a_weights_update_group_that_was_never_joined_fails(engine):
    with pytest.raises(EngineError, match="does not exist"):
        await engine.destroy_weights_update_group("weight_update_group")


async def test_a_request_whose_sampling_breaks_fails_alone_and_tiny_temperatures_are_greedy(
    engine, tiny
):
    _, model, _ = tiny
    vocab = model.config.vocab_size
    # A bias of -1e39 is -inf in fp32: no token is left to sample (a 1e-300 temperature
    # did the same, dividing the logits to inf, before it counted as greedy).
    broken = {str(i): -1e39 for i in range(vocab)}
    ids = PROMPTS[0]
    normal, tiny_t, bad, greedy = await asyncio.gather(
        run(engine, "ok", ids, max_new_tokens=16, ignore_eos=True, sampling_seed=1),
        run(engine, "eps", ids, temperature=1e-300, max_new_tokens=16, ignore_eos=True),
        run(engine, "bad", ids, max_new_tokens=16, logit_bias=broken),
        run(engine, "t0", ids, temperature=0, max_new_tokens=16, ignore_eos=True),
    )
    assert bad.finish_reason.status_code == 400 and bad.output_ids == []
    assert "sampling failed" in bad.finish_reason.message
    assert len(normal.output_ids) == 16 and normal.finish_reason.type == "length"
    assert tiny_t.output_ids == greedy.output_ids == hf_greedy(model, ids, 16)
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(temperature=float("inf")).verify()
    with pytest.raises(ValueError, match=r"n must be in \[1, 256\]"):
        SamplingParams(n=100_000).verify()


def test_abort_by_rid_matches_sglang_a_live_rid_and_the_ids_it_begins():
    """SGLang 0.5.23: a rid that names no live request aborts nothing (exact lookup), a
    live one aborts itself and every id that starts with it; asyncrl's own group cancel
    (``prefix=True``) takes every id with the prefix."""
    from asyncrl.engines.base import mark_aborted

    class Rec:
        aborted = False

    def live() -> dict[str, Rec]:
        return {rid: Rec() for rid in ("g1/0#1#", "g1/1#1#", "g1/0#1#x", "g2/0#1#")}

    reqs = live()
    assert mark_aborted(reqs, "g1/", False) == 0  # a prefix that is no request's id
    assert not any(r.aborted for r in reqs.values())
    assert mark_aborted(reqs, "g1/0#1#", False) == 2  # itself and the id it begins
    assert [k for k, r in reqs.items() if r.aborted] == ["g1/0#1#", "g1/0#1#x"]
    reqs = live()
    assert mark_aborted(reqs, "g1/", False, prefix=True) == 3
    assert mark_aborted(live(), "", False, prefix=True) == 0  # never everything by accident
    assert mark_aborted(live(), "", True) == 4


async def test_a_context_bound_generator_cuts_the_budget_to_the_room_left(tiny):
    """SGLang refuses input + max_new_tokens past the context; asyncrl's generator asks
    for what fits, and a prompt with no room left ends at once with a length finish."""
    from asyncrl.engines.client.sglang import SGLangClient
    from asyncrl.engines.context_bound import ContextBound
    from asyncrl.engines.server.app import EngineServer

    engine = TorchEngine.from_pretrained(str(tiny[0]))
    server = EngineServer(engine)  # it runs the engine
    url = await server.start("127.0.0.1", 0)
    try:
        async with SGLangClient(url) as client:
            bound = ContextBound(client, engine.context_length)
            near = [1] * (engine.context_length - 5)
            out = await bound.generate(near, {"max_new_tokens": 64, "ignore_eos": True})
            assert len(out.output_ids) == 5 and out.finish_reason.type == "length"
            full = await bound.generate([1] * engine.context_length, {"max_new_tokens": 8})
            assert full.output_ids == [] and full.finish_reason.type == "length"
            with pytest.raises(Exception, match="Requested token count exceeds"):
                await client.generate(near, {"max_new_tokens": 64})
    finally:
        await server.stop()


async def test_set_threads_reaches_the_step_thread(engine: TorchEngine) -> None:
    """OpenMP keeps a thread count per calling thread: the step thread, already started,
    takes the new count (the eval actor's final eval gets every core this way)."""
    before = torch.get_num_threads()
    greedy = await run(engine, "a", [1, 2, 3], max_new_tokens=4, temperature=0.0)
    assert engine._steps is not None
    loop = asyncio.get_running_loop()
    try:
        for threads in (1, 3):
            await engine.set_threads(threads)
            seen = await loop.run_in_executor(engine._steps, torch.get_num_threads)
            assert seen == threads
        again = await run(engine, "b", [1, 2, 3], max_new_tokens=4, temperature=0.0)
        assert again.output_ids == greedy.output_ids
    finally:
        torch.set_num_threads(before)


def test_the_kv_budget_is_what_the_free_memory_holds_at_its_peak():
    from transformers import LlamaConfig

    from asyncrl.engines.torch.kv_batch import (
        PEAK_COPIES,
        kv_bytes_per_position,
        kv_position_budget,
    )

    smollm2 = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3)  # fmt: skip
    per = kv_bytes_per_position(smollm2, torch.float32)
    assert per == 2 * 30 * 3 * 64 * 4  # 46 kB: keys and values of 30 layers in fp32
    assert kv_bytes_per_position(smollm2, torch.bfloat16) == per // 2
    budget = kv_position_budget(per, memory=20 * 2**30, fraction=0.2)
    assert budget == int(0.2 * 20 * 2**30 / (per * PEAK_COPIES))  # 31,068 positions
    assert kv_position_budget(per, memory=0, fraction=0.2) == 1


async def test_admission_keeps_the_padded_cache_within_max_total_tokens(tiny):
    """Rows x the longest final length stays within the budget at every step (every row
    is padded to the longest), an empty batch admits even a request over it, and every
    request runs to its end."""
    directory, _, _ = tiny
    eng = TorchEngine.from_pretrained(str(directory), max_total_tokens=160)
    widths: list[int] = []
    sched = eng.scheduler
    decode = sched._decode

    def watched() -> None:  # the padded cache after each step, as the step thread sees it
        decode()
        widths.append(len(sched.batch) * max(map(sched.final_length, sched.batch.seqs), default=0))

    sched._decode = watched  # type: ignore[method-assign]
    task = asyncio.create_task(eng.run())
    lengths = [(3, 20), (40, 12), (5, 8), (60, 30), (7, 20), (2, 200)]  # the last: over it
    try:
        outs = await asyncio.gather(*(
            run(eng, f"r{i}", list(range(10, 10 + n)), temperature=0, max_new_tokens=m,
                ignore_eos=True)
            for i, (n, m) in enumerate(lengths)
        ))  # fmt: skip
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert [len(o.output_ids) for o in outs] == [m for _, m in lengths]
    assert all(w <= 160 or w == 202 for w in widths) and 202 in widths  # alone, over it
    assert eng.stats["prefills"] >= 3  # the budget split the six into several admissions


async def test_the_engine_on_cpu_gives_freed_heap_back_as_it_steps(engine: TorchEngine):
    from asyncrl.engines.torch.heap_trim import HeapTrimmer

    assert isinstance(engine._heap, HeapTrimmer)  # on CPU, where the KV lives in the heap
    engine._heap, steps = HeapTrimmer(interval_s=0.0), engine.stats["steps"]
    await run(engine, "r", [1, 2, 3], max_new_tokens=4, temperature=0.0)
    assert engine._heap.trims == engine.stats["steps"] - steps >= 2  # one after each step
