"""Which workflow a rollout actor runs: single-turn, multi-turn tool use, an agent, or a user's.

No path: the agent workflow when ``rollout.agent`` is set (an ``openai``-client agent
trained through the proxy), the multi-turn workflow when ``rollout.tool_use`` is set, else
single-turn. A path (slime's ``--custom-generate-function-path``) is
``package.module:function`` (or ``package.module.function``) naming
``async def fn(ctx, sample) -> Sample``.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

from asyncrl.plugins import load_object
from asyncrl.rollout.base import Workflow
from asyncrl.rollout.single_turn import single_turn

if TYPE_CHECKING:
    from asyncrl.rollout.config import AgentConfig, ToolUseConfig
    from asyncrl.rollout.multi_turn import ToolCallParser


def load_workflow(
    path: str | None, tool_use: ToolUseConfig | None = None, agent: AgentConfig | None = None
) -> Workflow:
    """The workflow at ``path`` (None: see the module docstring); ``ValueError`` if unusable."""
    if agent is not None:
        return _agent(agent)
    if not path:
        return single_turn if tool_use is None else _multi_turn(tool_use)
    fn = load_object(path, what="workflow")
    # An object whose class defines ``async def __call__`` is a workflow too.
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)):
        raise ValueError(f"workflow {path!r} must be an async function (ctx, sample) -> Sample")
    return fn


def _multi_turn(cfg: ToolUseConfig) -> Workflow:
    from asyncrl.rollout.multi_turn import MultiTurn, MultiTurnConfig

    limits = MultiTurnConfig(cfg.max_turns, cfg.max_tokens_per_turn)
    return MultiTurn(limits, tool_call_parser(cfg.parser))


def _agent(cfg: AgentConfig) -> Workflow:
    from asyncrl.rollout.agent_workflow import AgentWorkflow
    from asyncrl.rollout.openai_proxy import ProxyConfig

    agent = load_object(cfg.path, what="agent")
    if not inspect.iscoroutinefunction(agent):
        raise ValueError(f"agent {cfg.path!r} must be an async function (session, task)")
    proxy = ProxyConfig(max_calls=cfg.max_calls, timeout_s=cfg.timeout_s)
    return AgentWorkflow(agent, proxy, tool_call_parser(cfg.parser))


#: Parser names as SGLang's --tool-call-parser spells those of the <tool_call> JSON format.
HERMES_NAMES = ("hermes", "qwen25")
#: SGLang's name of the Llama 3.x JSON format (``<|python_tag|>``, ``;``-separated calls).
LLAMA3_NAMES = ("llama3",)


def tool_call_parser(name: str) -> ToolCallParser:
    """The parser ``name`` gives: Hermes/Qwen's ``<tool_call>`` JSON, Llama 3's JSON, or
    ``module:Class``."""
    from asyncrl.rollout.multi_turn import HermesParser, Llama3Parser

    if name in HERMES_NAMES:
        parser: ToolCallParser = HermesParser()
    elif name in LLAMA3_NAMES:
        parser = Llama3Parser()
    else:
        parser = load_object(name, what="parser")()
    if not callable(getattr(parser, "parse", None)):
        raise ValueError(f"tool-call parser {name!r} has no parse(text) method")
    return parser
