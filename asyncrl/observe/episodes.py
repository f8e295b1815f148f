"""Agent episode metrics of a trained batch: turns, tool calls, errors, latency, context.

Agent episodes record each tool call in ``metadata["tool_calls"]`` (``name``, ``error``,
and from the multi-turn workflow ``seconds`` and ``timed_out``), a list present even when
empty; their ``spans`` give the assistant turns. Over a batch's episodes::

    agent/turns            mean assistant turns per episode
    agent/tool_calls       mean tool calls per episode
    agent/tool_errors      share of calls that failed (a timeout counts)
    agent/tool_timeouts    share of calls that timed out
    agent/tool_latency_s   mean seconds per call (calls that report it)
    agent/tokens_per_turn  sampled tokens / assistant turns
    agent/context_ended    share of episodes cut by the token budget or the model's context
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: observe is below types in the package order
    from asyncrl.types import Sample


def episode_metrics(samples: Iterable[Sample]) -> dict[str, float]:
    """The metrics above over ``samples``' episodes; {} when there are none."""
    episodes = [s for s in samples if s.turns or "tool_calls" in s.metadata]
    if not episodes:
        return {}
    turns = [sum(span.role == "assistant" for span in s.spans) for s in episodes]
    sampled = [
        sum(span.end - span.start for span in s.spans if span.role == "assistant") for s in episodes
    ]
    calls = [c for s in episodes for c in s.metadata.get("tool_calls", ())]
    timed = [float(c["seconds"]) for c in calls if c.get("seconds") is not None]
    metrics = {
        "agent/turns": sum(turns) / len(episodes),
        "agent/tool_calls": len(calls) / len(episodes),
        "agent/tool_errors": _share(c.get("error") is not None for c in calls),
        "agent/tool_timeouts": _share(bool(c.get("timed_out")) for c in calls),
        "agent/tokens_per_turn": sum(sampled) / max(1, sum(turns)),
        "agent/context_ended": _share(s.finish_reason in _CUT for s in episodes),
    }
    if timed:
        metrics["agent/tool_latency_s"] = sum(timed) / len(timed)
    return metrics


_CUT = ("length", "context")


def _share(flags: Iterable[bool]) -> float:
    values = list(flags)
    return sum(values) / len(values) if values else 0.0
