"""What the OpenAI proxy costs per episode: the same two-call tool episodes, side by side.

    python bench/agent_proxy.py [--episodes 400] [--concurrency 64] [--rounds 3] [--out FILE]

Each episode is the calculator example's: the model asks for the calculator, reads the
result, answers. The "model" is a scripted engine that returns fixed tokens at once, so
what is timed is everything around it. Two ways, alternating, ``--rounds`` times each:

- ``multi_turn``: the multi-turn workflow (``rollout.tool_use``) with the calculator tool;
- ``proxy``: ``examples/openai_agent/agent.py`` through the ``OpenAIProxy``
  (``rollout.agent``), with ``session.client()`` (one connection pool for all episodes);
- ``proxy_new_client``: the same agent building ``openai.AsyncOpenAI(base_url, api_key)``
  afresh per episode, as a plain agent would.

Prints episodes/s for each (median of the rounds) and the ratios, and writes JSON (default
``bench/results/agent_proxy.json``). Both run in this one process and event loop, as in a
rollout actor, where the engine shares the CPU with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.rollout.agent_workflow import AgentWorkflow
from asyncrl.rollout.base import RolloutContext
from asyncrl.rollout.multi_turn import MultiTurn, MultiTurnConfig
from asyncrl.rollout.tools import ToolRegistry, calculator_tool
from asyncrl.types import Sample, pack_int32
from examples.openai_agent.agent import calculator_agent, solve
from tests.scripted_engine import ScriptedEngine, Step
from tests.tiny_tokenizer import build_chatml_tokenizer

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "347*86"}}</tool_call>'


class Endless(ScriptedEngine):
    """The scripted engine: the first call of each episode asks for the calculator, the
    next one answers."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, [])
        self.calls: dict[str, int] = {}

    async def generate(self, input_ids: Any, sampling_params: Any = None, *, rid: Any = None):
        uid = str(rid).split("#")[0]
        self.calls[uid] = self.calls.get(uid, 0) + 1
        self.steps = [Step(CALL if self.calls[uid] == 1 else "#### 29842")]
        self.inputs.clear()  # nothing is kept: the bench runs thousands of episodes
        self.sampled.clear()
        return await super().generate(input_ids, sampling_params, rid=rid)


async def new_client_agent(session: Any, task: Any) -> str:
    """The example's agent, with a fresh ``openai.AsyncOpenAI`` per episode."""
    import openai

    async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as client:
        return await solve(client, session.model, str(task.prompt))


async def score(sample: Sample) -> float:
    return float(sample.response_text.strip().endswith("#### 29842"))


def samples(tokenizer: Any, n: int, tag: str) -> list[Sample]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "347*86"}], tokenize=False, add_generation_prompt=True
    )
    ids = pack_int32(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [
        Sample(uid=f"{tag}/{i}", group_id=tag, prompt="347*86", packed_prompt=ids, label="29842")
        for i in range(n)
    ]


async def run(workflow: Any, ctx: RolloutContext, batch: list[Sample], concurrency: int) -> float:
    """Episodes per second over ``batch``, ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(sample: Sample) -> None:
        async with gate:
            await workflow(ctx, sample)
            assert sample.reward == 1.0, (sample.status, sample.response_text)

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for sample in batch:
            tg.create_task(one(sample))
    return len(batch) / (time.perf_counter() - start)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = build_chatml_tokenizer(Path(tempfile.mkdtemp()))
    sampling = {"max_new_tokens": 200, "temperature": 1.0}
    ctx = RolloutContext(
        Endless(tokenizer), score, sampling, tokenizer=tokenizer,
        tools=ToolRegistry([calculator_tool()]),
    )  # fmt: skip
    ways = {
        "multi_turn": MultiTurn(MultiTurnConfig(max_turns=3)),
        "proxy": AgentWorkflow(calculator_agent),
        "proxy_new_client": AgentWorkflow(new_client_agent),
    }
    rates: dict[str, list[float]] = {name: [] for name in ways}
    async with ways["proxy"].resources(ctx), ways["proxy_new_client"].resources(ctx):
        for r in range(args.rounds):
            for name, workflow in ways.items():
                batch = samples(tokenizer, args.episodes, f"{name}{r}")
                rates[name].append(await run(workflow, ctx, batch, args.concurrency))
    medians = {k: statistics.median(v) for k, v in rates.items()}
    base = medians["multi_turn"]
    return {
        "episodes": args.episodes, "concurrency": args.concurrency, "rounds": args.rounds,
        "episodes_per_s": rates, "median": medians,
        "vs_multi_turn": {k: v / base for k, v in medians.items()},
        # Two calls an episode; one process, so 1/rate is the CPU time of an episode.
        "ms_per_call_over_multi_turn": {k: 1000 * (1 / v - 1 / base) / 2
                                        for k, v in medians.items()},
    }  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/agent_proxy.json"))
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print(f"{'way':<18}{'episodes/s':>12}{'vs multi_turn':>15}{'+ms/call':>10}   runs")
    for name, runs in result["episodes_per_s"].items():
        shown = ", ".join(f"{x:.0f}" for x in runs)
        ratio, extra = result["vs_multi_turn"][name], result["ms_per_call_over_multi_turn"][name]
        print(f"{name:<18}{result['median'][name]:>12.1f}{ratio:>14.3f}x{extra:>10.2f}   {shown}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
