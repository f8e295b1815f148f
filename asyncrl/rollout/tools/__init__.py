"""Tools for multi-turn workflows: the registry and the built-in tools.

| module          | job                                                                 |
|-----------------|---------------------------------------------------------------------|
| ``registry``    | ``ToolRegistry``: names, JSON schemas, calls that never raise        |
| ``calculator``  | exact arithmetic on one expression, parsed with ``ast``              |
| ``sandbox``     | Python snippets in a subprocess with CPU, memory, output, wall limits |
| ``search``      | BM25 over a local corpus file                                        |
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
