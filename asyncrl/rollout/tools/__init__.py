"""Tools for multi-turn workflows: the registry (``registry``) and the built-in tools
(``calculator``, the Python ``sandbox``, BM25 ``search``); ``build`` makes them from
``rollout.tool_use``.
"""

from asyncrl.rollout.tools.calculator import calculator_tool
from asyncrl.rollout.tools.registry import FunctionTool, Tool, ToolRegistry, ToolResult
from asyncrl.rollout.tools.sandbox import PythonSandbox, SandboxLimits, python_tool
from asyncrl.rollout.tools.search import search_tool

__all__ = [
    "FunctionTool",
    "PythonSandbox",
    "SandboxLimits",
    "Tool",
    "ToolRegistry",
    "ToolResult",
    "calculator_tool",
    "python_tool",
    "search_tool",
]
