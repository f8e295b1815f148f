"""Multi-turn tool use: generate, parse tool calls, run the tools, append what they said, repeat.

One sample is one episode, token-exact: the engine always continues from every token so
far (never re-encoded text). Assistant turns are appended with ``loss_mask = 1``, their
behaviour log-probs and weight versions; the tools' observations (the calls run
concurrently) with ``loss_mask = 0``, log-prob 0 and the version of the turn that asked for
them, so they never change a sample's head staleness. A failing tool is an error
observation, never a failed episode.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from asyncrl.rollout.base import RolloutContext
from asyncrl.rollout.tools.registry import ToolRegistry, ToolResult
from asyncrl.types import Sample, SampleStatus

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call; ``error`` says why a malformed one cannot run (the model is told)."""

    name: str
    arguments: dict[str, Any] | str | None
    error: str | None = None


class ToolCallParser(Protocol):
    """Finds the tool calls in an assistant turn's text.

    A parser may also define ``content(text) -> str``, the text without the calls (what the
    OpenAI server and proxy return as the message's ``content``; without it, the whole
    text), and ``unsettled_start(text) -> int``, where the text that more text could still
    change starts (an open call, a partial tag; ``len(text)``: none), which lets a stream
    send content and calls as they settle (``asyncrl/engines/server/tool_stream.py``; without it,
    a stream holds everything back to the end). The calls and content of
    ``text[:unsettled_start(text)]`` must begin those of every longer text.
    """

    def parse(self, text: str) -> list[ToolCall]: ...


class HermesParser:
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any number per turn.

    A body that is not a JSON object with a string ``name``, or an opening tag never
    closed, gives a ``ToolCall`` with ``error`` set: the model sees what was wrong.
    """

    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    #: One call's opening and closing text and its arguments key (forced calls' grammar).
    call_format = ("<tool_call>", "</tool_call>", "arguments")

    def parse(self, text: str) -> list[ToolCall]:
        calls = [self._call(m.group(1)) for m in self._CALL.finditer(text)]
        close = text.rfind("</tool_call>")
        tail = text if close < 0 else text[close + len("</tool_call>") :]
        if "<tool_call>" in tail:
            calls.append(ToolCall("", None, "a <tool_call> was opened but never closed"))
        return calls

    def content(self, text: str) -> str:
        """``text`` without its well-formed ``<tool_call>`` blocks, stripped."""
        return self._CALL.sub(
            lambda m: "" if not self._call(m.group(1)).error else m.group(0), text
        ).strip()

    def unsettled_start(self, text: str) -> int:
        """Where a ``<tool_call>`` not yet closed starts, or a partial one at the end."""
        closed = max((m.end() for m in self._CALL.finditer(text)), default=0)
        opened = text.find("<tool_call>", closed)
        return opened if opened >= 0 else len(text) - partial_suffix(text, "<tool_call>")

    @staticmethod
    def _call(body: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." too deep
            return ToolCall("", None, f"the tool call is not valid JSON: {exc}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall("", None, 'a tool call must be {"name": ..., "arguments": {...}}')
        return ToolCall(obj["name"], obj.get("arguments"))


class Llama3Parser:
    """Llama 3.x JSON calls (SGLang's ``llama3``): ``<|python_tag|>`` (optional when the turn
    starts with ``{``), then ``{"name": "f", "parameters": {...}}`` objects (``"arguments"``
    too) separated by ``;``.

    Text before the tag is content, and so is text after the last call. After the tag, an
    object that is not JSON or has no string ``name`` gives a ``ToolCall`` with ``error``
    set and ends the calls (its text stays content, and so does what follows); a turn that
    only starts with ``{`` and holds no such object is plain text.
    """

    TAG = "<|python_tag|>"
    call_format = (TAG, "", "parameters")

    def parse(self, text: str) -> list[ToolCall]:
        scan = self._scan(text)
        return scan.calls + ([scan.error] if scan.error and scan.tagged else [])

    def content(self, text: str) -> str:
        """``text`` without the tag and the well-formed calls, stripped."""
        scan = self._scan(text)
        return (text[: scan.start] + text[scan.rest :] if scan.calls else text).strip()

    def unsettled_start(self, text: str) -> int:
        """The end of the last whole call (more may follow), else the calls' start."""
        scan = self._scan(text)
        return scan.settled if scan.start >= 0 else len(text) - partial_suffix(text, self.TAG)

    def _scan(self, text: str) -> _Llama3Scan:
        lead = len(text) - len(text.lstrip())
        if text.startswith("{", lead):
            scan = _Llama3Scan(start=lead, settled=lead, rest=lead, tagged=False)
        elif (tag := text.find(self.TAG)) >= 0:
            scan = _Llama3Scan(start=tag, settled=tag, rest=tag + len(self.TAG), tagged=True)
        else:
            return _Llama3Scan(start=-1, settled=len(text), rest=len(text), tagged=False)
        pos = _skip_space(text, scan.rest)
        while text.startswith("{", pos):
            try:
                obj, end = _JSON.raw_decode(text, pos)
            except (ValueError, RecursionError) as exc:  # cut short, or "[[[[..." too deep
                scan.error = ToolCall("", None, f"the tool call is not valid JSON: {exc}")
                break
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                scan.error = ToolCall("", None, _LLAMA3_SHAPE)
                break
            scan.calls.append(ToolCall(obj["name"], obj.get("parameters", obj.get("arguments"))))
            pos = _skip_space(text, end)
            if text.startswith(";", pos):
                pos = _skip_space(text, pos + 1)
            scan.settled, scan.rest = end, pos
        return scan


@dataclass(slots=True)
class _Llama3Scan:
    """Where a Llama 3 turn's calls start (-1: none), where the settled text ends, where
    content resumes after the last whole call, and what was found."""

    start: int
    settled: int
    rest: int
    tagged: bool
    calls: list[ToolCall] = field(default_factory=list)
    error: ToolCall | None = None


_JSON = json.JSONDecoder()
_LLAMA3_SHAPE = 'a tool call must be {"name": ..., "parameters": {...}}'


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` begin ``tag`` (0: none; never all of it)."""
    return next(
        (k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0
    )


_STAND_IN = (
    {"role": "user", "content": "question"},
    {"role": "assistant", "content": "asyncrl-stand-in-answer"},
)


class ObservationRenderer:
    """Token ids that follow an assistant turn: the tool messages and the next header.

    With ``m`` a stand-in user message and ``a`` a stand-in assistant message::

        base  = template([m, a])
        full  = template([m, a, *tool_messages], add_generation_prompt=True)
        delta = full[cut:]   with cut = just after the end-of-turn token closing ``a`` in base

    ``full`` must start with ``base`` (a prefix-stable template), else ``ValueError``.
    When the sampled turn did not end with the end-of-turn token, the delta starts with it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.eos_token is None:
            raise ValueError("multi-turn rollouts need a tokenizer with an end-of-turn token")
        self.tokenizer, self.eos = tokenizer, str(tokenizer.eos_token)
        # The stand-in part is the same for every call: rendered and located once.
        self._base = self._template(_STAND_IN, generation_prompt=False)
        self._end = self._base.rfind(self.eos, self._base.index(_STAND_IN[1]["content"]))
        if self._end < 0:
            raise ValueError(
                f"the template does not close an assistant turn with eos_token {self.eos!r}: "
                "set eos_token to the token the model ends its turns with"
            )

    def render(self, messages: Sequence[dict[str, Any]], *, turn_closed: bool) -> list[int]:
        full = self._template([*_STAND_IN, *messages], generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError("the chat template is not prefix-stable for tool messages")
        delta = full[self._end + len(self.eos) if turn_closed else self._end :]
        return list(self.tokenizer(delta, add_special_tokens=False)["input_ids"])

    def _template(self, messages: Sequence[dict[str, Any]], *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )
        return str(text)


@dataclass(frozen=True, slots=True)
class MultiTurnConfig:
    """``max_turns`` assistant turns at most; ``max_tokens_per_turn`` (None: the budget)."""

    max_turns: int = 8
    max_tokens_per_turn: int | None = None

    def __post_init__(self) -> None:
        if self.max_turns < 1 or (self.max_tokens_per_turn or 1) < 1:
            raise ValueError(f"max_turns and max_tokens_per_turn must be >= 1: {self}")


class MultiTurn:
    """The multi-turn tool-use workflow (module docstring); ``ctx.tools`` is the registry.

    A turn gets at most ``min(max_tokens_per_turn, budget left)`` tokens. The episode ends
    at a final answer (``completed``); at ``max_turns`` assistant turns, a spent budget
    (``max_new_tokens``: turns and observations) or a full context (``truncated``,
    ``finish_reason`` ``max_turns``, ``length`` or ``context``; a turn cut at its limit
    still has its calls run, and ends the episode if it has none); or on an abort
    (``aborted``: resumed from its tokens, an unfinished turn continuing as the same turn).
    ``metadata["tool_calls"]`` has every call's name, error, seconds and timeout flag.
    """

    def __init__(
        self, config: MultiTurnConfig | None = None, parser: ToolCallParser | None = None
    ) -> None:
        self.config = config or MultiTurnConfig()
        self.parser = parser or HermesParser()
        self._renderers: dict[int, ObservationRenderer] = {}  # by id(tokenizer)

    def renderer(self, tokenizer: PreTrainedTokenizerBase) -> ObservationRenderer:
        """One renderer per tokenizer (an actor has one), built at its first episode."""
        key = id(tokenizer)
        if key not in self._renderers:
            self._renderers[key] = ObservationRenderer(tokenizer)
        return self._renderers[key]

    async def __call__(self, ctx: RolloutContext, sample: Sample) -> Sample:
        tokenizer, registry = _needs(ctx)
        if sample.tools:
            registry = registry.for_row(sample.tools)
        sample.metadata.setdefault("tool_calls", [])  # an agent episode, even without calls
        episode = _Episode(ctx, sample, tokenizer, registry, self)
        await episode.run()
        if sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
            sample.reward = await ctx.score(sample)
        return sample


class _Episode:
    """The state of one sample's episode while the workflow runs it."""

    def __init__(
        self,
        ctx: RolloutContext,
        sample: Sample,
        tokenizer: PreTrainedTokenizerBase,
        registry: ToolRegistry,
        workflow: MultiTurn,
    ) -> None:
        self.ctx, self.sample, self.tokenizer, self.registry = ctx, sample, tokenizer, registry
        self.config, self.parser = workflow.config, workflow.parser
        self.renderer = workflow.renderer(tokenizer)
        self.budget = ctx.budget
        # The engines' context (``ContextBound``), None when unknown: a context that fills
        # up ends the episode ``truncated`` with finish_reason "context", not an error.
        context = getattr(ctx.engine, "context_length", None)
        self.context = context if isinstance(context, int) else None
        self.aborts_at_start = ctx.aborts()

    @property
    def turns(self) -> int:
        return sum(span.role == "assistant" for span in self.sample.spans)

    async def run(self) -> None:
        s = self.sample
        spans = s.spans
        resuming = (
            s.status is SampleStatus.ABORTED and bool(spans) and spans[-1].role == "assistant"
        )
        while True:
            cut = await self._generate(resume_turn=resuming)
            resuming = False
            if s.status is not SampleStatus.PENDING:
                break
            start = s.spans[-1].start
            calls = self.parser.parse(self._decode(s.response_tokens[start:], skip_special=False))
            if not calls:
                self._end(*((SampleStatus.TRUNCATED, "length") if cut else _FINAL))
                break
            if self.turns >= self.config.max_turns:
                self._end(SampleStatus.TRUNCATED, "max_turns")
                break
            if not await self._observe(calls):
                break
        s.response_text = self._decode(s.response_tokens, skip_special=True)

    async def _generate(self, *, resume_turn: bool) -> bool:
        """One assistant turn (or the rest of an aborted one); sets the status if that ends
        the episode. True if the turn was cut at ``max_tokens_per_turn``: its calls, if it
        holds any, still run; without one the episode ends truncated."""
        s = self.sample
        left = self.budget - s.response_length
        turn_cap = self.config.max_tokens_per_turn
        if turn_cap is not None and resume_turn:
            turn_cap -= s.spans[-1].end - s.spans[-1].start
        limit = left if turn_cap is None else min(left, turn_cap)
        if limit <= 0:
            self._end(SampleStatus.TRUNCATED, "length")
            return False
        if self.ctx.aborts() != self.aborts_at_start:  # aborted while the tools ran
            self._end(SampleStatus.ABORTED, "abort")
            return False
        ids = np.concatenate([s.prompt_tokens, s.response_tokens]).tolist()
        if self._full(len(ids)):
            self._end(SampleStatus.TRUNCATED, "context")
            return False
        params = self.ctx.sampling_with(max_new_tokens=limit)
        result = await self.ctx.engine.generate(
            ids, params, rid=f"{s.uid}#{s.attempts}#{self.turns}#"
        )
        if result.output_ids:
            if result.logprobs is None:
                raise ValueError("the engine returned no log-probs (return_logprob is required)")
            s.append_response(result.output_ids, result.logprobs, result.versions)
        reason = self.ctx.finish(result, params)
        kind = reason.type if reason is not None else "abort"
        s.status = SampleStatus.PENDING
        if kind == "abort":
            self._end(SampleStatus.ABORTED, "abort")
        elif kind == "length" and self._full(len(ids) + len(result.output_ids)):
            self._end(SampleStatus.TRUNCATED, "context")
        elif kind == "length" and limit == left:  # the whole budget is spent
            self._end(SampleStatus.TRUNCATED, "length")
        return kind == "length"

    def _full(self, tokens: int) -> bool:
        """True when ``tokens`` leave the engines no room for another token."""
        return self.context is not None and tokens >= self.context

    async def _observe(self, calls: list[ToolCall]) -> bool:
        """Run ``calls`` and append their observations; False if the budget ended it."""
        s = self.sample
        results = await self._run_calls(calls)
        messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
        closed = int(s.response_tokens[-1]) == self.tokenizer.eos_token_id
        tokens = self.renderer.render(messages, turn_closed=closed)
        if s.response_length + len(tokens) >= self.budget:
            self._end(SampleStatus.TRUNCATED, "length")  # no room left for an answer
            return False
        if self._full(len(s.prompt_tokens) + s.response_length + len(tokens)):
            self._end(SampleStatus.TRUNCATED, "context")
            return False
        version = int(s.token_versions[-1])
        s.append_response(tokens, np.zeros(len(tokens)), version, loss_mask=0, role="tool")
        record = s.metadata.setdefault("tool_calls", [])
        record.extend(
            {
                "name": r.name,
                "error": r.error,
                "seconds": round(r.seconds, 4),
                "timed_out": r.timed_out,
            }
            for r in results
        )
        return True

    async def _run_calls(self, calls: list[ToolCall]) -> list[ToolResult]:
        async def one(call: ToolCall) -> ToolResult:
            if call.error is not None:
                text = f"Error: {call.error}"
                return ToolResult(call.name, text, text)
            return await self.registry.call(call.name, call.arguments)

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(c)) for c in calls]
        return [t.result() for t in tasks]

    def _end(self, status: SampleStatus, reason: str) -> None:
        self.sample.status, self.sample.finish_reason = status, reason

    def _decode(self, ids: np.ndarray, *, skip_special: bool) -> str:
        return str(self.tokenizer.decode(ids.tolist(), skip_special_tokens=skip_special))


_FINAL = (SampleStatus.COMPLETED, "stop")


def _needs(ctx: RolloutContext) -> tuple[PreTrainedTokenizerBase, ToolRegistry]:
    if ctx.tokenizer is None:
        raise ValueError("the multi-turn workflow needs a tokenizer (ctx.tokenizer)")
    if not isinstance(ctx.tools, ToolRegistry):
        raise ValueError("the multi-turn workflow needs a ToolRegistry (ctx.tools)")
    return ctx.tokenizer, ctx.tools


#: The workflow with default settings, for ``--custom-generate-function-path
#: asyncrl.rollout.multi_turn:multi_turn``.
multi_turn = MultiTurn()
