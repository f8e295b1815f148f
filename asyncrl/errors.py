"""Errors that say the job's input is wrong, as opposed to something having gone wrong.

An ``InputError`` (bad data, config or user code; lost run state, an unreadable
checkpoint, samples that keep failing) recurs however often the actor that hit it is
restarted, so the supervisor ends the job with the reason instead of restarting it
(``actors/base.py::is_permanent``). Anything else (a lost peer, a timeout, out of memory)
may pass and is restarted within the budget.
"""

from __future__ import annotations

import errno
import re

#: A write the disk refused: full, over a quota or the file size limit, read-only. A
#: restart would write the same checkpoint, log or journal and fail the same way.
_DISK_REFUSED = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
#: How Rust's ``io::Error`` ends its text (a SafetensorError's "File too large (os error
#: 27)").
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def disk_refused(exc: BaseException) -> bool:
    """True when ``exc`` itself is a write the disk refused (an ``OSError`` or a Rust
    library's error with one of those codes)."""
    if isinstance(exc, OSError) and exc.errno in _DISK_REFUSED:
        return True
    rust = _RUST_OS_ERROR.search(str(exc))  # safetensors, tokenizers: not an OSError
    return rust is not None and int(rust.group(1)) in _DISK_REFUSED


class InputError(ValueError):
    """The job's input is wrong in a way a restart would only repeat."""


class RunStateLost(InputError):
    """The run directory lost state the job needs to go on exactly (a checkpoint or a
    journal deleted or moved while the job ran): going on would serve consumed work again,
    and a restart would find the same directory."""


class SamplesFailing(InputError):
    """Most samples fail (``buffer.max_failed_share``): the data, the reward or agent code,
    or the sampling settings are wrong, and going on would train nothing."""


class CheckpointUnreadable(InputError):
    """A checkpoint the job must load is truncated or not one: a restart would read the
    same bytes again."""


class NonFiniteTraining(InputError):
    """Training produces NaN or infinite values step after step (a reward, a learning rate
    or data out of range): going on, or a restart, would only write broken weights."""


class EngineError(ValueError):
    """A request the engine cannot serve (the HTTP layer answers 400 with the message)."""
