"""The calculator task as a plain ``openai``-client agent, trained unchanged through the proxy.

This is the loop anyone writes against the OpenAI API: send the conversation with the
tools, run the calls the model asks for, send the results back, stop at an answer. Nothing
in it knows about RL. ``asyncrl train examples/openai_agent/config.yaml`` names it
(``rollout.agent.path``); the proxy hands it a session per episode and records every
token the engine samples for it.

It runs against any OpenAI-compatible server too: ``python examples/openai_agent/agent.py
--base-url http://127.0.0.1:30000/v1 "347*86"`` (an SGLang server, for instance).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import openai

from asyncrl.rollout.openai_proxy import AgentTask, Session
from asyncrl.rollout.tools.calculator import CALCULATOR_PARAMETERS, CalculatorError, calculator

#: The tool as the OpenAI API describes tools; the agent runs it itself (``run_tool``).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression exactly and return its value.",
            "parameters": CALCULATOR_PARAMETERS,
        },
    }
]
MAX_TURNS = 3


def run_tool(name: str, arguments: str) -> str:
    """The agent's own tool: the answer, or an error the model reads."""
    if name != "calculator":
        return f"Error: no tool named {name!r}"
    try:
        return calculator(**json.loads(arguments))
    except (ValueError, TypeError, CalculatorError) as exc:
        return f"Error: {exc}"


async def solve(client: openai.AsyncOpenAI, model: str, question: str) -> str:
    """Ask, run the calculator when told to, return the final answer's text."""
    messages: list[Any] = [{"role": "user", "content": question}]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=80
        )
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


async def calculator_agent(session: Session, task: AgentTask) -> str:
    """The entry point the proxy calls: one episode per training sample.

    ``session.client()`` is ``openai.AsyncOpenAI(base_url=session.base_url,
    api_key=session.api_key)`` sharing one connection pool across episodes; building a
    fresh client per episode works the same, but costs about 27 ms of SSL set-up each.
    """
    async with session.client() as client:
        return await solve(client, session.model, str(task.prompt))


def main() -> None:
    """Run the agent once against an OpenAI-compatible server."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question")
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model", default="default")
    args = parser.parse_args()

    async def once() -> str:
        async with openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key) as client:
            return await solve(client, args.model, args.question)

    print(asyncio.run(once()))


if __name__ == "__main__":
    main()
