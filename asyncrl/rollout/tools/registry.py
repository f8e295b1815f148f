"""The tool registry of multi-turn workflows: names, JSON-schema descriptions, safe calls.

A tool is a name, a description, the JSON schema of its arguments (an object) and an async
body that returns the observation text. Nothing a tool does can fail the episode: an
unknown name, malformed JSON, arguments the schema refuses, a raise or a timeout each
become a ``ToolResult`` with ``error`` set, whose ``content`` the model reads next turn.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import jsonschema

NO_ARGUMENTS: Mapping[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What one call gave the model: ``content`` (the observation) and ``error`` if any;
    ``timed_out`` when the error is the registry's timeout."""

    name: str
    content: str
    error: str | None = None
    seconds: float = 0.0
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


class Tool(Protocol):
    """A callable tool: ``await tool(**arguments)`` returns the observation text."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def __call__(self, **arguments: Any) -> Awaitable[str]: ...


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A tool from a plain function (sync or async) returning anything ``str()`` can show.

    A sync body runs in a worker thread so it cannot stall the event loop; a timeout then
    abandons the thread (it cannot be killed): give long-running work to a subprocess, as
    ``PythonSandbox`` does.
    """

    name: str
    description: str
    fn: Callable[..., Any]
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(NO_ARGUMENTS))

    async def __call__(self, **arguments: Any) -> str:
        if inspect.iscoroutinefunction(self.fn):
            return str(await self.fn(**arguments))
        return str(await asyncio.to_thread(self.fn, **arguments))


def openai_schema(tool: Tool) -> dict[str, Any]:
    """``{"type": "function", "function": {name, description, parameters}}``."""
    function = {"name": tool.name, "description": tool.description}
    return {"type": "function", "function": function | {"parameters": dict(tool.parameters)}}


class ToolRegistry:
    """Tools by name, with their schemas, called safely (see the module docstring)."""

    def __init__(
        self, tools: Iterable[Tool] = (), *, timeout_s: float = 10.0, max_output_chars: int = 4096
    ) -> None:
        if timeout_s <= 0 or max_output_chars < 1:
            raise ValueError("timeout_s must be > 0 and max_output_chars >= 1")
        self.timeout_s, self.max_output_chars = timeout_s, max_output_chars
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        """Add ``tool``; a duplicate name or an invalid JSON schema is a ``ValueError``."""
        if not tool.name or tool.name in self._tools:
            raise ValueError(f"tool name {tool.name!r} is empty or already registered")
        _check_schema(tool.name, tool.parameters)
        self._tools[tool.name] = tool

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI-style description of every tool, in registration order."""
        return [openai_schema(t) for t in self._tools.values()]

    def for_row(self, specs: Iterable[Mapping[str, Any]]) -> ToolRegistry:
        """The tools a data row's ``tools`` column names, with the row's descriptions.

        Each spec is OpenAI-style (``{"type": "function", "function": {...}}``) or the bare
        function object. The implementation comes from this registry; a name it lacks is a
        ``ValueError`` naming it.
        """
        chosen: list[Tool] = []
        for spec in specs:
            fn = spec.get("function", spec)
            name = fn.get("name")
            if name not in self._tools:
                raise ValueError(f"the data names tool {name!r}; registered: {self.names}")
            base = self._tools[name]
            chosen.append(
                _Described(
                    base,
                    str(fn.get("description", base.description)),
                    fn.get("parameters", base.parameters),
                )
            )
        return ToolRegistry(
            chosen, timeout_s=self.timeout_s, max_output_chars=self.max_output_chars
        )

    async def call(self, name: str, arguments: str | Mapping[str, Any] | None) -> ToolResult:
        """Run one call: ``arguments`` (JSON text or a mapping) checked against the schema,
        the body under ``timeout_s``, its output cut to ``max_output_chars``. Every
        failure is an error observation, never an exception."""
        start = time.monotonic()
        tool = self._tools.get(name)
        try:
            if tool is None:
                raise _CallError(f"unknown tool {name!r}; available: {', '.join(self.names)}")
            args = _parse_arguments(arguments)
            _validate(tool, args)
            async with asyncio.timeout(self.timeout_s):
                content = await tool(**args)
            if not isinstance(content, str):
                raise _CallError(f"tool {name!r} returned {type(content).__name__}, not text")
        except _CallError as exc:
            return self._error(name, str(exc), start)
        except TimeoutError:
            message = f"tool {name!r} timed out after {self.timeout_s:g} s"
            return self._error(name, message, start, timed_out=True)
        except Exception as exc:  # the tool's own code raised: the model sees why
            return self._error(name, f"{type(exc).__name__}: {exc}", start)
        return ToolResult(name, self._cut(content), None, time.monotonic() - start)

    def _error(self, name: str, message: str, start: float, timed_out: bool = False) -> ToolResult:
        text = self._cut(f"Error: {message}")
        return ToolResult(name, text, text, time.monotonic() - start, timed_out)

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        cut = len(text) - self.max_output_chars
        return f"{text[: self.max_output_chars]}\n[... {cut} more characters cut]"


@dataclass(frozen=True, slots=True)
class _Described:
    """A registered tool under the description and schema a data row gives it."""

    base: Tool
    description: str
    parameters: Mapping[str, Any]

    @property
    def name(self) -> str:
        return self.base.name

    def __call__(self, **arguments: Any) -> Awaitable[str]:
        return self.base(**arguments)


class _CallError(Exception):
    """A call the registry refused before running the tool (its text is the reason)."""


def _check_schema(name: str, schema: Mapping[str, Any]) -> None:
    try:
        jsonschema.Draft202012Validator.check_schema(dict(schema))
    except jsonschema.SchemaError as exc:
        raise ValueError(f"tool {name!r}: invalid JSON schema: {exc.message}") from None
    if schema.get("type") != "object":
        raise ValueError(f"tool {name!r}: the arguments schema must have type 'object'")


def _parse_arguments(arguments: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise _CallError(f"arguments are not valid JSON: {exc}") from None
    if not isinstance(arguments, Mapping):
        raise _CallError(f"arguments must be a JSON object, not {type(arguments).__name__}")
    return dict(arguments)


def _validate(tool: Tool, args: dict[str, Any]) -> None:
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(dict(tool.parameters)).iter_errors(args)
    )
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "arguments"
        raise _CallError(f"invalid arguments for {tool.name!r} at {where}: {error.message}")


__all__ = ["NO_ARGUMENTS", "FunctionTool", "Tool", "ToolRegistry", "ToolResult", "openai_schema"]
