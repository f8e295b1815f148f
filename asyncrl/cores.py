"""The cores an idle trainer lends to the embedded engines on its machine.

A local job gives its trainer every core and each embedded engine a share (``job.py``);
OpenMP threads that wait sleep, so while the trainer waits for a batch its cores idle.
The trainer marks, in a one-byte file of the run directory, whether it is computing a
step (``BusyMark``). An embedded CPU engine reads the mark before each of its steps
(``LentThreads``, one ``pread``) and runs on its idle-trainer thread count while the mark
is clear, on its own share while it is set, missing or unreadable.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

#: How often a reader looks again for a mark file that is not there yet (the trainer
#: creates it as it sets up, beside the engines starting).
REOPEN_S = 1.0


class BusyMark:
    """The trainer's side: byte 0 of ``path`` is 1 while a step computes, else 0.

    The file is opened without truncation, so a restarted trainer writes the same inode
    the engines already read; it clears the mark a crash mid-step left set."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.set(False)

    def set(self, busy: bool) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, b"\x01" if busy else b"\x00", 0)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Set while the block runs (a step), cleared after it however it ends."""
        self.set(True)
        try:
            yield
        finally:
            self.set(False)

    def close(self) -> None:
        """Clear the mark (engines then take the cores) and close the file."""
        if self._fd is not None:
            self.set(False)
            os.close(self._fd)
            self._fd = None


class LentThreads:
    """The engine's side: its torch thread count before a step, ``own`` while the trainer
    computes (or the mark cannot be read), ``idle`` while it waits."""

    def __init__(self, path: Path, *, own: int, idle: int) -> None:
        self.path, self.own, self.idle = path, own, idle
        self._fd: int | None = None
        self._next_open = 0.0
        self._closed = False

    def __call__(self) -> int:
        return self.own if self._trainer_busy() else self.idle

    def _trainer_busy(self) -> bool:
        fd = self._fd if self._fd is not None else self._open()
        if fd is None:
            return True
        try:
            return os.pread(fd, 1, 0) != b"\x00"
        except OSError:  # closed under us at teardown
            return True

    def _open(self) -> int | None:
        now = time.monotonic()
        if self._closed or now < self._next_open:
            return None
        self._next_open = now + REOPEN_S
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        return self._fd

    def close(self) -> None:
        """Close the file; a step still running reads "busy" from then on."""
        self._closed = True
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
