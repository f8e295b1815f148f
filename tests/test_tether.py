"""``tie_to_parent``: a process tied to its parent ends when the parent is killed, so a
bench's worker or a sweep's job does not train on after a ``kill -9`` of the bench."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.polling import alive

ROOT = Path(__file__).resolve().parents[1]

CHILD = (
    "import signal, time\n"
    "from asyncrl.runtime.tether import tie_to_parent\n"
    "tied = tie_to_parent(signal.SIGTERM)\n"
    "print('tied' if tied else 'untied', flush=True)\n"
    "time.sleep(120)\n"
)
PARENT = (
    "import subprocess, sys, time\n"
    f"child = subprocess.Popen([sys.executable, '-c', {CHILD!r}])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_tied_process_ends_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "tied"  # the child's line, on our pipe
        assert alive(child)
        parent.kill()  # SIGKILL: the parent runs no cleanup of its own
        parent.wait()
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the child outlived its killed parent"
    finally:
        parent.kill()
