"""``AgentWorkflow``: one openai-client agent episode per sample, through the rollout
actor's ``OpenAIProxy`` (``docs/agents.md``). An aborted episode restarts from nothing: an
agent's Python state cannot be resumed."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import msgspec

from asyncrl.rollout.base import RolloutContext
from asyncrl.rollout.multi_turn import ToolCallParser
from asyncrl.rollout.openai_proxy import (
    MAX_STATE_BYTES,
    Agent,
    AgentTask,
    Episode,
    OpenAIProxy,
    ProxyConfig,
)
from asyncrl.types import Sample, SampleStatus


class AgentWorkflow:
    """The workflow that runs an ``Agent`` per sample through an ``OpenAIProxy``.

    ``resources(ctx)`` starts the proxy; the rollout (and eval) actor holds it for its
    lifetime. Each call resets the sample (an aborted episode restarts), runs the agent in a
    session, and scores the result (``docs/agents.md``).
    """

    def __init__(
        self, agent: Agent, config: ProxyConfig | None = None, parser: ToolCallParser | None = None
    ) -> None:
        self.agent, self.config, self.parser = agent, config or ProxyConfig(), parser
        self._proxies: dict[int, OpenAIProxy] = {}  # by id(ctx)

    def resources(self, ctx: RolloutContext) -> OpenAIProxy:
        """The proxy for ``ctx``: enter it (``async with``) before the first sample."""
        proxy = OpenAIProxy(ctx, self.config, self.parser)
        self._proxies[id(ctx)] = proxy
        return proxy

    async def __call__(self, ctx: RolloutContext, sample: Sample) -> Sample:
        proxy = self._proxies.get(id(ctx))
        if proxy is None or not proxy.url:
            raise ValueError("AgentWorkflow needs its proxy started: enter resources(ctx) first")
        _restart(sample)
        # Copies: an agent that appends to its prompt must not change the sample.
        task = AgentTask(
            sample.uid,
            copy.deepcopy(sample.prompt),
            copy.deepcopy(sample.label),
            copy.deepcopy(sample.metadata),
            copy.deepcopy(sample.tools),
        )
        async with proxy.session(sample) as (session, episode):
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    state = await self.agent(session, task)
            except asyncio.CancelledError:
                if not episode.aborted or _cancelled_from_outside():
                    raise
                return _aborted(sample)
            except Exception:
                if episode.aborted:  # the agent turned the abort into its own error
                    _cancelled_from_outside()
                    return _aborted(sample)
                raise
            if episode.aborted:  # the agent swallowed the abort and went on
                _cancelled_from_outside()
                return _aborted(sample)
        if not episode.calls:
            raise ValueError("the agent returned without calling the model")
        _finish(sample, episode, state, ctx.tokenizer)
        sample.reward = await ctx.score(sample)
        return sample


def _cancelled_from_outside() -> bool:
    """Withdraw the proxy's own cancel request; True if another one is still pending."""
    task = asyncio.current_task()
    return task is not None and task.uncancel() > 0


def _aborted(sample: Sample) -> Sample:
    _restart(sample)
    sample.status, sample.finish_reason = SampleStatus.ABORTED, "abort"
    return sample


def _restart(sample: Sample) -> None:
    """An agent episode cannot resume mid-way: it starts again with no tokens."""
    sample.truncate_response(0)
    sample.turns = []
    sample.metadata["tool_calls"] = []  # an agent episode, even without calls
    sample.status, sample.finish_reason = SampleStatus.PENDING, None


def _finish(sample: Sample, episode: Episode, state: Any, tokenizer: Any) -> None:
    sample.status = SampleStatus.TRUNCATED if episode.truncated else SampleStatus.COMPLETED
    sample.finish_reason = episode.truncated or "stop"
    sample.metadata["agent_calls"] = episode.calls
    try:  # the state travels with the sample: wire types, and not too big
        encoded = msgspec.msgpack.encode(state)
        sample.metadata["final_state"] = state if len(encoded) <= MAX_STATE_BYTES else None
    except Exception:  # not a wire type, too deep, an int past 64 bits: keep its repr
        sample.metadata["final_state"] = repr(state)[:MAX_STATE_BYTES]
    if isinstance(state, str):
        sample.response_text = state
    else:
        ids = sample.response_tokens.tolist()
        sample.response_text = str(tokenizer.decode(ids, skip_special_tokens=True))
