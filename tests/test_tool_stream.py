"""``ToolStream`` (asyncrl/engines/server/tool_stream.py): a turn's text cut anywhere streams the
same content and calls as the text in one piece, which are the non-streamed reply's.

The parsers are the real ones (Hermes and Llama 3); the texts hold one call, parallel
calls, text around calls, malformed blocks and partial tags.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from asyncrl.engines.server.tool_stream import ToolStream, content_of
from asyncrl.rollout.multi_turn import HermesParser, Llama3Parser, ToolCall


def hermes(name: str, arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def llama3(name: str, parameters: Any) -> str:
    return json.dumps({"name": name, "parameters": parameters})


TAG = Llama3Parser.TAG
CASES = {
    "hermes, one call": (HermesParser(), hermes("calculator", {"expression": "6*7"})),
    "hermes, parallel calls": (
        HermesParser(),
        hermes("a", {"x": 1}) + "\n" + hermes("b", {"y": "</tool"}) + hermes("c", "{}"),
    ),
    "hermes, text around calls": (HermesParser(), f"Let me see. {hermes('a', {})} then done "),
    "hermes, bad JSON": (HermesParser(), "try <tool_call>{not json}</tool_call> <tool_call>[1]"),
    "hermes, never closed": (HermesParser(), f'x {hermes("a", {})} <tool_call>{{"name": "b'),
    "hermes, a partial tag at the end": (HermesParser(), "a < b and <tool_"),
    "llama3, one call": (Llama3Parser(), TAG + llama3("f", {"x": 1})),
    "llama3, parallel calls": (
        Llama3Parser(),
        f"Sure. {TAG}{llama3('f', {'x': 1})}; {json.dumps({'name': 'g', 'arguments': {}})}",
    ),
    "llama3, no tag": (Llama3Parser(), f"  {llama3('f', {})};{llama3('g', {})} thanks"),
    "llama3, bad JSON after a call": (Llama3Parser(), f"{TAG}{llama3('f', {})};{{bad"),
    "llama3, plain JSON": (Llama3Parser(), '{"answer": 42} is it'),
    "llama3, a partial tag at the end": (Llama3Parser(), "hi <|python_t"),
}


def streamed(parser: Any, text: str, cuts: Any = ()) -> tuple[str, list[Any], list[Any]]:
    """Feed ``text`` cut at ``cuts``, then finish: the content, the calls (name, arguments
    as sent) and every delta."""
    stream = ToolStream(parser, call_id=lambda k: f"call_{k}")
    deltas = [d for cut in cuts for d in stream.feed(text[:cut])] + stream.finish(text)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for part in (p for d in deltas for p in d.get("tool_calls", ())):
        call = calls.setdefault(part["index"], ["", ""])
        call[0] += part["function"].get("name", "")
        call[1] += part["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], deltas


def reply(parser: Any, text: str) -> tuple[str, list[Any]]:
    """The non-streamed reply's content and calls."""
    calls = [c for c in parser.parse(text) if c.error is None]
    args = [c.arguments if isinstance(c.arguments, str) else json.dumps(c.arguments or {})
            for c in calls]  # fmt: skip
    return content_of(parser, text), [(c.name, a) for c, a in zip(calls, args, strict=True)]


@pytest.mark.parametrize("case", list(CASES))
def test_a_text_cut_anywhere_streams_what_the_whole_text_replies(case):
    parser, text = CASES[case]
    whole = streamed(parser, text)
    assert whole[:2] == reply(parser, text)
    for cut in range(len(text) + 1):
        assert streamed(parser, text, [cut])[:2] == whole[:2], f"cut at {cut}: {text[:cut]!r}"
    assert streamed(parser, text, range(len(text) + 1))[:2] == whole[:2]  # a char a time


@pytest.mark.parametrize("case", [c for c in CASES if "partial" not in c])
def test_no_text_of_a_well_formed_call_goes_out_as_content(case):
    parser, text = CASES[case]
    content, calls, _ = streamed(parser, text, range(len(text) + 1))
    for name, _ in calls:
        assert f'"name": "{name}"' not in content
    malformed = "bad JSON" in case or "never closed" in case
    if isinstance(parser, HermesParser):
        assert ("<tool_call>" in content) == malformed  # a malformed block stays content
    else:
        assert TAG not in content and ("{bad" in content) == malformed


def test_a_call_goes_out_as_its_name_then_its_arguments():
    _, _, deltas = streamed(HermesParser(), "Hi " + hermes("calculator", {"x": 1}))
    assert deltas == [
        {"content": "Hi"},
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": "calculator", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": 1}'}}]},
    ]  # fmt: skip


def test_an_open_block_and_a_partial_tag_are_held_back_until_they_settle():
    stream = ToolStream(HermesParser())
    assert stream.feed("Hi <tool_") == [{"content": "Hi"}]  # the space waits for more text
    assert stream.feed("Hi <tool_call>{") == []
    assert stream.feed("Hi <tool_x") == [{"content": " <tool_x"}]  # not a tag after all
    llama = ToolStream(Llama3Parser())
    assert llama.feed(f'{TAG}{{"name": "f", "param') == []
    assert [d.get("tool_calls") is not None for d in llama.feed(TAG + llama3("f", {}))] == [
        True, True]  # fmt: skip
    assert llama.feed(TAG + llama3("f", {}) + "; ") == []  # maybe another call


def test_a_parser_without_the_hook_streams_everything_at_the_end():
    class Plain:
        def parse(self, text: str) -> list[ToolCall]:
            return HermesParser().parse(text)

    text = "Hi " + hermes("f", {})
    stream = ToolStream(Plain())
    assert all(stream.feed(text[:cut]) == [] for cut in range(len(text) + 1))
    content, calls, _ = streamed(Plain(), text)
    assert calls == [("f", "{}")] and content == text  # no content(): the whole text


def test_the_hermes_hook_points_at_the_open_block_or_the_partial_tag():
    parser = HermesParser()
    assert parser.unsettled_start("plain") == 5
    assert parser.unsettled_start("a <tool") == 2
    assert parser.unsettled_start("a <tool_call>{") == 2
    closed = "a " + hermes("f", {})
    assert parser.unsettled_start(closed) == len(closed)
    assert parser.unsettled_start(closed + " b <tool_call>") == len(closed) + 3
