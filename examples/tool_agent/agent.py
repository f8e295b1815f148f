"""The tool agent as a plain ``openai``-client program, trained through asyncrl's proxy.

Nothing here knows about training: it streams chat completions with ``tools=`` and
``tool_choice="auto"``, gathers the streamed ``delta.tool_calls``, runs the calculator and
the Python sandbox itself, sends the results back as ``tool`` messages, and returns the
final reply. ``openai_config.yaml`` names it (``rollout.agent.path``); pointed at any
OpenAI-compatible server (``asyncrl serve --tool-call-parser hermes``), it runs the same.
"""

from __future__ import annotations

from typing import Any

from asyncrl.rollout.openai_proxy import AgentTask, Session
from asyncrl.rollout.tools import calculator_tool
from asyncrl.rollout.tools.registry import ToolRegistry
from asyncrl.rollout.tools.sandbox import python_tool

MAX_TURNS = 4
_REGISTRY: ToolRegistry | None = None


def registry() -> ToolRegistry:
    """The agent's tools (one registry a process), as the multi-turn example offers them."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = ToolRegistry([calculator_tool(), python_tool()], timeout_s=10.0)
    return _REGISTRY


async def solve(session: Session, task: AgentTask) -> str:
    """Ask, run the tools the model calls, repeat; the last reply's text is the answer."""
    tools = registry().schemas()
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
    async with session.client(max_retries=0) as client:
        for _ in range(MAX_TURNS):
            stream = await client.chat.completions.create(
                model=session.model, messages=messages, tools=tools, tool_choice="auto",
                stream=True, max_tokens=96,
            )  # fmt: skip
            message = await gather(stream)
            messages.append(message)
            if not message.get("tool_calls"):
                return message.get("content") or ""
            for call in message["tool_calls"]:
                fn = call["function"]
                result = await registry().call(fn["name"], fn["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": result.content})  # fmt: skip
    return ""


async def gather(stream: Any) -> dict[str, Any]:
    """One streamed reply as an assistant message: content and ``tool_calls`` assembled
    from their deltas (each call's id and name come first, its arguments in pieces)."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            for part in delta.tool_calls or ():
                empty = {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                call = calls.setdefault(part.index, empty)
                call["id"] = part.id or call["id"]
                if part.function is not None:
                    call["function"]["name"] += part.function.name or ""
                    call["function"]["arguments"] += part.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return message
