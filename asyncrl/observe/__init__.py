"""Observability: structured logs (``logs``) and metrics sinks (``metrics``).

``configure_logging`` is called once per process at start: by the CLI for the controller
and by ``runtime/child.py`` for each actor, which then bind their name, pid and weight
version so every line carries them. The controller and trainer write the run's numbers
through a ``MetricsSink`` (always ``JsonlMetricsSink``); ``read_jsonl`` reads them back
strictly, and ``asyncrl plot`` (``plots``) draws them, skipping a bad line with a warning.
``progress`` is the train progress bar; ``trackers`` forwards the files to TensorBoard
and W&B.
"""

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
