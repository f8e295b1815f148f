"""Long agent episodes in a real job: 8+ turns and 4k+ tokens trained across weight
versions; tools that raise, hang past their timeout or return a megabyte become tool
messages and the episode goes on; an episode that fills the model's context ends
``truncated`` with finish_reason "context", not an error.

The random tiny model never writes a real call, so a parser that reads every turn as a
call (``EveryTurnCalls``) drives the episodes, and a ``custom`` tool (``flaky_tool``)
cycles through its failure modes.
"""

from __future__ import annotations

import asyncio
import itertools
import json

from asyncrl.buffer.dump import batch_files, read_batch
from asyncrl.config import load_config
from asyncrl.job import run_job
from asyncrl.rollout.multi_turn import ToolCall
from asyncrl.rollout.tools.registry import FunctionTool
from tests.test_train import accounted, job_flags, last_buffer_metrics, write_prompts
from tests.tiny_model import build_tiny_model

#: What the tool does on its k-th call, in turn (a cycle of four).
MODES = ("ok", "raise", "hang", "huge")


class EveryTurnCalls:
    """Every turn is one call of the flaky tool."""

    def parse(self, text: str) -> list[ToolCall]:
        return [ToolCall("flaky", {})]


def flaky_tool() -> FunctionTool:
    """A tool whose calls cycle through ``MODES``; each healthy call takes 0.3 s, so an
    episode outlasts a training step and weight versions change under it."""
    calls = itertools.count()

    async def run() -> str:
        mode = MODES[next(calls) % len(MODES)]
        if mode == "raise":
            raise RuntimeError("the flaky tool broke")
        if mode == "hang":
            await asyncio.sleep(3600)
        await asyncio.sleep(0.3)
        return "y" * 1_000_000 if mode == "huge" else "result " * 60

    return FunctionTool("flaky", "a tool that fails in every way", run)


def long_flags(tmp_path, *, steps: int, budget: int, turns: int) -> list[str]:
    flags = [*job_flags(tmp_path, steps=steps), "--apply-chat-template", "true"]
    # A stop can land inside a 6k-token prefill; under a loaded suite the rollout actor
    # once took over the default 10 s to stop (the job then fails "did not stop cleanly").
    flags += ["--runtime.stop-timeout", "30"]
    flags += ["--rollout.max-groups", "2", "--buffer.filters", "[]"]
    flags += ["--rollout.sampling", json.dumps({"temperature": 1.0, "max_new_tokens": budget})]
    tool = {"type": "custom", "path": "tests.test_long_episodes:flaky_tool"}
    return [
        *flags, "--rollout.tool-use.tools", json.dumps([tool]),
        "--rollout.tool-use.max-turns", str(turns),
        "--rollout.tool-use.max-tokens-per-turn", "300",
        "--rollout.tool-use.parser", "tests.test_long_episodes:EveryTurnCalls",
        "--rollout.tool-use.timeout-s", "0.5", "--rollout.tool-use.max-output-chars", "600",
        "--save-debug-rollout-data", str(tmp_path / "dump"),
    ]  # fmt: skip


def trained(tmp_path) -> list:
    dump = tmp_path / "dump"
    return [s for path in batch_files(dump) for g in read_batch(path).groups for s in g.samples]


def observations(tokenizer, sample) -> list[str]:
    return [tokenizer.decode(sample.response_tokens[t.start : t.end].tolist())
            for t in sample.spans if t.role == "tool"]  # fmt: skip


async def test_an_8_turn_4k_token_episode_trains_across_weight_versions(tmp_path):
    _, tokenizer = build_tiny_model(tmp_path / "model", max_position_embeddings=8192)
    write_prompts(tmp_path / "prompts.jsonl", n=8)
    cfg = load_config(overrides=long_flags(tmp_path, steps=2, budget=6000, turns=12))
    result = await run_job(cfg)
    assert result.ok and result.steps == 2, result.error
    assert accounted(last_buffer_metrics(tmp_path / "run"))
    samples = trained(tmp_path)
    turns = [sum(t.role == "assistant" for t in s.spans) for s in samples]
    long = [s for s, n in zip(samples, turns, strict=True) if n >= 8 and s.response_length >= 4000]
    assert long, [(n, s.response_length) for s, n in zip(samples, turns, strict=True)]
    # Episodes outlast a step: some trained episode holds tokens of two weight versions.
    spanning = [s for s in long if len(set(s.token_versions[s.loss_mask > 0].tolist())) >= 2]
    assert spanning, [sorted(set(s.token_versions.tolist())) for s in long]
    # Each failure came back as a tool message, and a turn followed it (the calls of
    # concurrent episodes share the tool's cycle, so each kind shows in some episode).
    after = [o for s in long for o in observations(tokenizer, s)[:-1]]
    assert any("Error: RuntimeError: the flaky tool broke" in o for o in after), after
    assert any("Error: tool 'flaky' timed out after 0.5 s" in o for o in after), after
    assert any("more characters cut]" in o for o in after), after  # the megabyte, cut
    assert all(len(s.metadata["tool_calls"]) >= 8 for s in long)
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("actor") == "trainer"]
    assert all(r["agent/turns"] >= 8 and r["agent/tool_timeouts"] > 0 for r in steps), steps
    assert max(r["staleness/max"] for r in steps) >= 1


async def test_an_episode_that_fills_the_context_ends_truncated_by_it(tmp_path):
    build_tiny_model(tmp_path / "model", max_position_embeddings=1024)
    write_prompts(tmp_path / "prompts.jsonl", n=8)
    cfg = load_config(overrides=long_flags(tmp_path, steps=1, budget=4000, turns=20))
    result = await run_job(cfg)
    assert result.ok and result.steps == 1, result.error
    samples = trained(tmp_path)
    assert samples and all((s.status, s.finish_reason) == ("truncated", "context") for s in samples)
    assert all(len(s.prompt_tokens) + s.response_length <= 1024 for s in samples)
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["agent/context_ended"] for r in rows if r.get("actor") == "trainer"] == [1.0]
