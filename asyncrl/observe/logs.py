"""structlog set-up shared by the controller and every actor process.

``configure_logging()`` is called once per process (the CLI for the controller,
``runtime/child.py`` for each actor). Two renderers:

- ``console`` for people: ``time level event key=value ...`` (colour only on a TTY);
- ``json`` for machines: one object per line with ``timestamp`` (ISO-8601, UTC),
  ``level``, ``event`` and the context.

With ``file=`` JSON lines are also appended to that file whatever the console format,
so every actor leaves a machine-readable log in the run directory. Records from the
standard ``logging`` module (ray, transformers, aiohttp) go through the same renderers.
Two kinds of context:

- ``bind_context(actor=..., version=...)``: process-wide, on every later line from any
  task. One process is one actor, so its name, pid and weight version belong here.
- ``bind_task_context(uid=...)``: per task (``contextvars``), inherited by tasks the
  current one starts; for what one piece of work is doing.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Literal, TextIO

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
_HANDLER_TAG = "_asyncrl_handler"
_process_context: dict[str, Any] = {}


def _merge_process_context(logger: Any, name: str, event: dict[str, Any]) -> dict[str, Any]:
    for key, value in _process_context.items():
        event.setdefault(key, value)
    return event


def _shared_processors() -> list[Any]:
    return [
        structlog.contextvars.merge_contextvars,
        _merge_process_context,
        structlog.stdlib.add_log_level,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


def _formatter(renderer: Any) -> structlog.stdlib.ProcessorFormatter:
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_shared_processors(),
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )


def _json_renderer() -> Any:
    return structlog.processors.JSONRenderer(default=repr)


def configure_logging(
    *,
    level: str = "info",
    fmt: Literal["console", "json"] = "console",
    stream: TextIO | None = None,
    file: str | Path | None = None,
    **context: Any,
) -> None:
    """(Re)configure logging for this process; ``context`` is bound to every line."""
    if level not in _LEVELS:
        raise ValueError(f"log level must be one of {sorted(_LEVELS)}, got {level!r}")
    stream = stream or sys.stderr
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _HANDLER_TAG, False)]:
        root.removeHandler(handler)
        handler.close()
    console = logging.StreamHandler(stream)
    if fmt == "json":
        console.setFormatter(_formatter(_json_with_traceback()))
    else:
        colors = hasattr(stream, "isatty") and stream.isatty()
        console.setFormatter(_formatter(structlog.dev.ConsoleRenderer(colors=colors)))
    handlers: list[logging.Handler] = [console]
    if file is not None:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(file, encoding="utf-8")
        to_file.setFormatter(_formatter(_json_with_traceback()))
        handlers.append(to_file)
    for handler in handlers:
        setattr(handler, _HANDLER_TAG, True)
        root.addHandler(handler)
    root.setLevel(_LEVELS[level])
    structlog.configure(
        processors=[*_shared_processors(), structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: loggers made at import time must follow a later reconfiguration.
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    _process_context.clear()
    bind_context(**context)


def _json_with_traceback() -> Any:
    dict_tracebacks = structlog.processors.ExceptionRenderer()

    def render(logger: Any, name: str, event: dict[str, Any]) -> str:
        return _json_renderer()(logger, name, dict_tracebacks(logger, name, event))

    return render


def bind_context(**context: Any) -> None:
    """Add ``context`` to every later log line of this process, from any task."""
    _process_context.update(context)


def unbind_context(*keys: str) -> None:
    """Remove ``keys`` from the process-wide context."""
    for key in keys:
        _process_context.pop(key, None)


def bind_task_context(**context: Any) -> None:
    """Add ``context`` to later lines of the current task and the tasks it starts."""
    structlog.contextvars.bind_contextvars(**context)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger; it follows whatever ``configure_logging`` set last."""
    return structlog.get_logger(name)
