"""Observability: structured logs (``logs``), metrics sinks (``metrics``), the progress
bar, figures and tracker forwarding. ``configure_logging`` is called once per process at
start, by the CLI for the controller and by ``runtime/child.py`` for each actor."""

from asyncrl.observe.logs import (
    adopt_library_loggers,
    bind_context,
    bind_task_context,
    configure_logging,
    get_logger,
    reset_logging,
    unbind_context,
)
from asyncrl.observe.metrics import JsonlMetricsSink, MetricsSink, MultiSink, read_jsonl

__all__ = [
    "JsonlMetricsSink",
    "MetricsSink",
    "MultiSink",
    "adopt_library_loggers",
    "bind_context",
    "bind_task_context",
    "configure_logging",
    "get_logger",
    "read_jsonl",
    "reset_logging",
    "unbind_context",
]
