"""structlog set-up shared by the controller and every actor process.

One pipeline for every record: structlog events are handed to the standard ``logging``
module and rendered by a ``ProcessorFormatter`` on the root handlers, so libraries'
records (ray, transformers, aiohttp) get the same renderer (``console`` for people,
``json`` for machines), level and context as our own. Context merged into every line:
call-site keys win, then the task's (``bind_task_context``), then the process's
(``bind_context``).
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
    "critical": logging.CRITICAL,
}
# Libraries that attach their own handler and set ``propagate = False`` on import.
_LIBRARY_LOGGERS = ("ray", "transformers")
# Marks the root handlers we own, so reconfiguring removes ours and leaves others
# (pytest's capture handlers, an embedding application's) alone.
_HANDLER_TAG = "_asyncrl_handler"
_process_context: dict[str, Any] = {}


def _merge_process_context(logger: Any, name: str, event: dict[str, Any]) -> dict[str, Any]:
    """Add the process-wide context without overriding keys given at the call site."""
    for key, value in _process_context.items():
        event.setdefault(key, value)
    return event


def _common_processors() -> list[Any]:
    """Processors both structlog events and foreign ``logging`` records go through."""
    return [
        structlog.contextvars.merge_contextvars,
        _merge_process_context,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


# Built once so every cached logger holds the same chain. Loggers are cached on first use,
# which is safe because this chain never changes: what ``configure_logging`` varies lives in
# the root handlers and in module state read at call time, so reconfiguring reaches every
# logger, old or new. (One cached under someone else's ``structlog.configure`` keeps theirs.)
_STRUCTLOG_CHAIN: list[Any] = [
    # Drop disabled levels before any work: a debug call in a hot loop costs one check.
    structlog.stdlib.filter_by_level,
    structlog.stdlib.PositionalArgumentsFormatter(),
    *_common_processors(),
    structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
]
_FOREIGN_PRE_CHAIN: list[Any] = [*_common_processors(), structlog.stdlib.ExtraAdder()]


def _formatter(*renderers: Any) -> structlog.stdlib.ProcessorFormatter:
    """A ``logging`` formatter running the shared chain, then ``renderers``."""
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_FOREIGN_PRE_CHAIN,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderers],
    )


def _json_formatter() -> structlog.stdlib.ProcessorFormatter:
    """One JSON object per line (``timestamp`` ISO-8601 UTC, ``level``, ``event``, ``logger``,
    the context); a traceback becomes the string field ``exception``."""
    return _formatter(structlog.processors.format_exc_info, structlog.processors.JSONRenderer())


def _console_formatter(stream: TextIO) -> structlog.stdlib.ProcessorFormatter:
    """Human-readable lines (``timestamp [level] event [logger] key=value ...``); escape
    codes and rich tracebacks only on a terminal."""
    tty = _is_tty(stream)
    # Locals stay off: a frame holding a batch of tensors would flood the terminal.
    tracebacks = (
        structlog.dev.RichTracebackFormatter(show_locals=False)
        if tty
        else structlog.dev.plain_traceback
    )
    return _formatter(structlog.dev.ConsoleRenderer(colors=tty, exception_formatter=tracebacks))


def _is_tty(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal; a closed or exotic stream counts as not."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _owned_handler(handler: logging.Handler, formatter: logging.Formatter) -> logging.Handler:
    """Tag ``handler`` as ours and give it ``formatter``."""
    handler.setFormatter(formatter)
    setattr(handler, _HANDLER_TAG, True)
    return handler


def _remove_owned_handlers(root: logging.Logger) -> None:
    """Detach and close the handlers a previous ``configure_logging`` installed."""
    for handler in [h for h in root.handlers if getattr(h, _HANDLER_TAG, False)]:
        root.removeHandler(handler)
        handler.close()


def configure_logging(
    *,
    level: str = "info",
    fmt: Literal["console", "json"] = "console",
    stream: TextIO | None = None,
    file: str | Path | None = None,
    **context: Any,
) -> None:
    """(Re)configure logging for this process; called once at start by the CLI and each actor.

    ``level`` applies to structlog and standard ``logging`` records alike; ``fmt`` picks
    the renderer for ``stream`` (default ``sys.stderr``); ``file`` additionally receives
    JSON lines (appended, parents created). Calling it again replaces the previous set-up
    and its context: the process context becomes ``context`` and the current task's
    context is cleared.
    """
    if level not in _LEVELS:
        raise ValueError(f"log level must be one of {sorted(_LEVELS)}, got {level!r}")
    if fmt not in ("console", "json"):
        raise ValueError(f"log format must be 'console' or 'json', got {fmt!r}")
    stream = sys.stderr if stream is None else stream
    handlers = [_owned_handler(logging.StreamHandler(stream), _stream_formatter(fmt, stream))]
    if file is not None:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(file, mode="a", encoding="utf-8")
        handlers.append(_owned_handler(to_file, _json_formatter()))
    root = logging.getLogger()
    _remove_owned_handlers(root)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(_LEVELS[level])
    adopt_library_loggers()
    # HTTP clients log a line per request at info: one per agent call through the OpenAI
    # proxy (tens of thousands a run). Set before they are imported, the level sticks.
    for name in _CHATTY_HTTP_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if level == "debug" else logging.WARNING)
    structlog.configure(
        processors=_STRUCTLOG_CHAIN,
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    _process_context.clear()
    bind_context(**context)


def _stream_formatter(fmt: str, stream: TextIO) -> structlog.stdlib.ProcessorFormatter:
    """The formatter for the stream handler."""
    return _json_formatter() if fmt == "json" else _console_formatter(stream)


_CHATTY_HTTP_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "openai")


def adopt_library_loggers(*names: str) -> None:
    """Route the named libraries' loggers (default: ray, transformers) into our pipeline.

    Called by ``configure_logging``; call it again after importing such a library later
    (an actor's ``setup()`` importing transformers), since the import installs the
    library's own handler and turns propagation off. Their chatter (config dumps, files
    saved) stays out below warning unless the root logs at debug.
    """
    debug = logging.getLogger().level <= logging.DEBUG
    for name in names or _LIBRARY_LOGGERS:
        if name not in logging.Logger.manager.loggerDict:
            continue  # never imported: nothing to undo
        library = logging.getLogger(name)
        for handler in list(library.handlers):
            library.removeHandler(handler)
        library.propagate = True
        library.setLevel(logging.NOTSET if debug else logging.WARNING)


def reset_logging() -> None:
    """Undo ``configure_logging``: our handlers, both contexts, structlog's config.

    Called by test fixtures so one test's set-up does not leak into the next. Library
    loggers adopted earlier stay adopted.
    """
    root = logging.getLogger()
    _remove_owned_handlers(root)
    root.setLevel(logging.WARNING)
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    _process_context.clear()


def bind_context(**context: Any) -> None:
    """Add ``context`` to every later line of this process, from any task or thread.

    Called by actors (``version=`` when they load new weights) and by ``configure_logging``.
    A plain dict, not a ``contextvars`` binding: the task that learns a new weight version
    is not the parent of the tasks that log with it.
    """
    _process_context.update(context)


def unbind_context(*keys: str) -> None:
    """Remove ``keys`` from the process-wide context; absent keys are ignored."""
    for key in keys:
        _process_context.pop(key, None)


def bind_task_context(**context: Any) -> None:
    """Add ``context`` to later lines of the current task and the tasks it starts.

    Called by code handling one piece of work (a sample ``uid``); it overrides the process
    context for keys in both.
    """
    structlog.contextvars.bind_contextvars(**context)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger named ``name``, usually made at module import time.

    It follows whatever ``configure_logging`` set last, even if made before it.
    """
    return structlog.get_logger(name)
