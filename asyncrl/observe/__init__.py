"""Observability: structured logs (``logs``) and metrics sinks (``metrics``).

Called by the CLI and every actor process at start (``configure_logging``), and by the
controller, which writes the run's metrics as JSON lines.
"""

from asyncrl.observe.logs import (
    bind_context,
    bind_task_context,
    configure_logging,
    get_logger,
    unbind_context,
)
from asyncrl.observe.metrics import JsonlMetricsSink, MetricsSink, MultiSink, read_jsonl

__all__ = [
    "JsonlMetricsSink",
    "MetricsSink",
    "MultiSink",
    "bind_context",
    "bind_task_context",
    "configure_logging",
    "get_logger",
    "read_jsonl",
    "unbind_context",
]
