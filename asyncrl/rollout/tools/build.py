"""From ``rollout.tool_use`` (``ToolUseConfig``) to a ``ToolRegistry`` and a tool-call parser.

The controller builds the registry too, before launch: its schemas render the prompts, and
building it there refuses a missing corpus or a bad custom path before any process starts.
"""

from __future__ import annotations

from asyncrl.plugins import load_object
from asyncrl.rollout.config import ToolConfig, ToolUseConfig
from asyncrl.rollout.tools.calculator import calculator_tool
from asyncrl.rollout.tools.registry import Tool, ToolRegistry
from asyncrl.rollout.tools.sandbox import SandboxLimits, python_tool
from asyncrl.rollout.tools.search import search_tool


def build_tool(cfg: ToolConfig) -> Tool:
    """One tool from its config; ``ValueError`` (or ``DataError``) names what is wrong."""
    if cfg.type == "calculator":
        return calculator_tool()
    if cfg.type == "python":
        limits = SandboxLimits(cfg.cpu_s, cfg.memory_mb, cfg.wall_s, cfg.output_bytes)
        return python_tool(limits, isolate=cfg.isolate)
    if cfg.type == "search":
        assert cfg.corpus is not None  # ToolConfig refuses a search tool without one
        return search_tool(cfg.corpus, cfg.k, cfg.max_chars)
    assert cfg.path is not None
    tool = load_object(cfg.path, what="tool factory")()
    if not all(hasattr(tool, a) for a in ("name", "description", "parameters")):
        raise ValueError(f"tool factory {cfg.path!r} must return a Tool (name, description, ...)")
    return tool


def build_registry(cfg: ToolUseConfig) -> ToolRegistry:
    """The registry of every configured tool, with the configured call limits."""
    tools = [build_tool(t) for t in cfg.tools]
    return ToolRegistry(tools, timeout_s=cfg.timeout_s, max_output_chars=cfg.max_output_chars)
