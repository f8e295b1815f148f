"""Tool calls on the OpenAI wire: ``tool_choice``'s rules and streamed ``delta.tool_calls``.

Shared by the server's ``/v1/chat/completions`` and the agent proxy. A tool-call parser is
duck-typed here (engines do not import rollout): ``parse(text)`` gives calls with
``name``, ``arguments`` and ``error``; ``content(text)``, optional, gives the text without
the well-formed calls; ``unsettled_start(text)``, optional, gives where the text that more
text could still change starts (an open call block, a partial opening tag).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from asyncrl.engines.server.generate_wire import Json, bad_request

_CHOICES = "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"


def parses_tool_calls(body: Json) -> bool:
    """Whether a chat call's tool calls are parsed, by its ``tool_choice``: ``none`` no (a
    call's text is content); ``auto`` (or none given), ``required`` and a named function
    yes. Anything else, or a function not among ``tools``, is a 400 naming it."""
    forced_tools(body)  # a bad choice is a 400 here
    return body.get("tool_choice") != "none"


def forced_tools(body: Json) -> list[str] | None:
    """The functions one of which ``tool_choice`` forces (``required``: any offered; a
    named one: it), or None when the model may answer in text."""
    choice = body.get("tool_choice")
    if choice in (None, "auto", "none"):
        return None
    if isinstance(choice, dict):
        return [_named(choice, body.get("tools"))]
    if choice != "required":
        raise bad_request(f"tool_choice {choice!r} is not one of {_CHOICES}")
    names = _offered(body.get("tools"))
    if not names:
        raise bad_request("tool_choice 'required' needs tools")
    return names


def forced_call_grammar(body: Json, parser: Any) -> str | None:
    """EBNF for exactly one call of a forced function in ``parser``'s format (its
    ``call_format``: opening text, closing text, the arguments key), the arguments held
    to the function's ``parameters`` schema; None when nothing is forced."""
    names = forced_tools(body)
    if names is None:
        return None
    fmt = getattr(parser, "call_format", None)
    if fmt is None:
        raise bad_request(
            "a forced tool_choice needs a tool-call parser with a call format "
            "(asyncrl serve --tool-call-parser hermes, qwen25 or llama3)"
        )
    opening, closing, key = fmt
    params = {
        t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
        for t in body.get("tools") or ()
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    }
    return _call_grammar(opening, [_call_schema(n, params[n], key) for n in names], closing)


def _call_schema(name: str, params: Json, key: str) -> str:
    """One call of ``name`` as a root schema: its parameters' ``$defs`` (pydantic's)
    lifted to the root, where their ``#/$defs/...`` references point."""
    if not isinstance(params, dict):
        raise bad_request(f"tool {name!r}: parameters must be a JSON schema object")
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    args = {k: v for k, v in params.items() if k not in defs}
    schema = {
        "type": "object",
        "properties": {"name": {"const": name}, key: args},
        "required": ["name", key],
        **defs,
    }
    return json.dumps(schema)


def _call_grammar(opening: str, schemas: list[str], closing: str) -> str:
    try:
        import xgrammar as xgr
    except ImportError:
        raise bad_request("a forced tool_choice needs xgrammar (constrained decoding)") from None
    try:
        calls = [xgr.Grammar.from_json_schema(s, any_whitespace=False) for s in schemas]
    except RuntimeError as exc:
        raise bad_request(f"a tool's parameters are not a usable JSON schema: {exc}") from None
    call = xgr.Grammar.union(*calls) if len(calls) > 1 else calls[0]
    text = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(t)}") for t in (opening, closing)]
    pieces = [*text[:1] * bool(opening), call, *text[1:] * bool(closing)]
    return str(xgr.Grammar.concat(*pieces)) if len(pieces) > 1 else str(call)


def _offered(tools: Any) -> list[str]:
    return [
        t["function"].get("name")
        for t in tools or ()
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    ]


def _named(choice: Json, tools: Any) -> str:
    """The function a named ``tool_choice`` asks for; a 400 unless ``tools`` offers it."""
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(f"tool_choice {choice!r} is not one of {_CHOICES}")
    offered = _offered(tools)
    if name not in offered:
        raise bad_request(
            f"tool_choice names function {name!r}, which is not among tools {offered}"
        )
    return name


def new_call_id(index: int) -> str:
    """A fresh OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_text(call: Any) -> str:
    """A call's ``function.arguments``: a string as given, else its JSON (None: ``{}``)."""
    args = call.arguments
    return args if isinstance(args, str) else json.dumps(args if args is not None else {})


def content_of(parser: Any, text: str) -> str:
    """The reply's content with ``parser``: its ``content(text)``, else the stripped text."""
    content = getattr(parser, "content", None)
    return str(content(text)) if content is not None else text.strip()


class ToolStream:
    """One choice's text as OpenAI stream deltas, calls parsed.

    ``feed(text)`` with all of the text so far, then ``finish(text)`` once; each returns
    the deltas to send. Only the settled prefix ``text[:parser.unsettled_start(text)]`` is
    parsed (all of it at ``finish``, none before without the hook, which must keep
    ``parse`` and ``content`` of a prefix a prefix of those of the whole text). What it
    adds goes out: new content, then each new well-formed call as two ``tool_calls``
    deltas (its head with empty arguments, then the arguments); a block left open or
    holding bad JSON ends as content, as in the non-streamed reply. ``calls`` and
    ``call_ids`` hold the calls sent and their ids (``call_id(index)``).
    """

    def __init__(self, parser: Any, call_id: Callable[[int], str] = new_call_id) -> None:
        self.parser, self.call_id = parser, call_id
        self.content = ""  # the content sent so far
        self.calls: list[Any] = []
        self.call_ids: list[str] = []
        self._settled = 0  # the length of the text parsed last

    def feed(self, text: str) -> list[Json]:
        """The deltas that ``text`` (the whole text so far) settles."""
        hook = getattr(self.parser, "unsettled_start", None)
        settled = text[: hook(text)] if hook is not None else ""
        if len(settled) == self._settled:  # an open call grew: nothing to parse again
            return []
        return self._send(settled)

    def finish(self, text: str) -> list[Json]:
        """The deltas left once ``text`` is final: all of it is settled."""
        return self._send(text)

    def _send(self, settled: str) -> list[Json]:
        self._settled = len(settled)
        deltas: list[Json] = []
        content = content_of(self.parser, settled)
        # A final text cut shorter (a stop string) cannot take back what went out.
        if len(content) > len(self.content) and content.startswith(self.content):
            deltas.append({"content": content[len(self.content) :]})
            self.content = content
        found = [c for c in self.parser.parse(settled) if c.error is None]
        for call in found[len(self.calls) :]:
            deltas += self._call_deltas(call)
        return deltas

    def _call_deltas(self, call: Any) -> list[Json]:
        index, cid = len(self.calls), self.call_id(len(self.calls))
        self.calls.append(call)
        self.call_ids.append(cid)
        head = {
            "index": index,
            "id": cid,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        args = {"index": index, "function": {"arguments": arguments_text(call)}}
        return [{"tool_calls": [head]}, {"tool_calls": [args]}]
