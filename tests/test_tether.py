"""``tie_to_parent`` and ``tether --tie``: a process tied to its parent ends when the
parent is killed, so a bench's worker or a sweep's job does not train on after a
``kill -9`` of the bench; one whose parent is already gone does not start."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.polling import alive

ROOT = Path(__file__).resolve().parents[1]
SLEEPER = "import time; print('up', flush=True); time.sleep(120)"
#: The child, tied in its own code (as a bench's worker is).
IN_CODE = (
    "import signal, time\n"
    "from asyncrl.runtime.tether import tie_to_parent\n"
    "print('up' if tie_to_parent(signal.SIGTERM) else 'untied', flush=True)\n"
    "time.sleep(120)\n"
)
#: The child, tied by the shim and exec'd (as a sweep's job is).
BY_SHIM = (
    "import os, sys\n"
    "print(os.getpid(), flush=True)\n"
    "os.execvp(sys.executable, [sys.executable, '-m', 'asyncrl.runtime.tether', '--tie',\n"
    f"                           str(os.getppid()), sys.executable, '-c', {SLEEPER!r}])\n"
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's"
)


def parent_of(child: str) -> str:
    """A parent that starts ``child`` (code), prints its pid, and sleeps."""
    return (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )


@pytest.mark.parametrize("child", [IN_CODE, BY_SHIM], ids=["in-code", "shim"])
def test_a_tied_process_ends_when_its_parent_is_killed(child: str) -> None:
    parent = subprocess.Popen([sys.executable, "-c", parent_of(child)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    pid = None
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        lines = [parent.stdout.readline().strip()]  # the shim's child prints its pid first
        if lines[0] != "up":
            lines.append(parent.stdout.readline().strip())
        assert lines[-1] == "up" and alive(pid)  # tied, running (the child's line, our pipe)
        parent.kill()  # SIGKILL: the parent runs no cleanup of its own
        parent.wait()
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), "the child outlived its killed parent"
    finally:
        parent.kill()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_job_whose_parent_is_gone_before_the_tie_never_starts() -> None:
    # PID 1 is not this process's parent: as if the sweep died while the shim started.
    command = [sys.executable, "-m", "asyncrl.runtime.tether", "--tie", "1",
               sys.executable, "-c", "print('ran')"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM and "ran" not in done.stdout
