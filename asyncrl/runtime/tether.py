"""``python -m asyncrl.runtime.tether CMD ARGS...``: run ``CMD`` tied to its parent.

An engine actor starts its server (SGLang, vLLM) in a process group of its own, out of
reach of whatever kills the actor. This shim leads that group and runs ``CMD`` as its child
(not by exec: a parent-death signal on ``CMD`` kills it alone, not what it forked); when
its parent dies (``PR_SET_PDEATHSIG``, Linux only) it SIGKILLs the whole group, so a dead
actor leaves nothing holding memory or a GPU. A group stop (SIGTERM, SIGINT) is ``CMD``'s
to handle: the shim ignores it and exits with ``CMD``'s status.

``tie_to_parent`` is the same tie for a process of its own (an actor, a bench's worker).
``python -m asyncrl.runtime.tether --tie PID CMD ARGS...`` ties itself to ``PID`` (its
parent) with SIGTERM, then execs ``CMD``: a job a sweep starts stops, in order, when the
sweep dies, without a ``preexec_fn`` in a process that has threads.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1
#: The signal the kernel sends the shim when its parent dies (nothing else sends it).
_PARENT_DIED = signal.SIGUSR1


def tie_to_parent(signum: int, parent: int | None = None) -> bool:
    """Have the kernel send this process ``signum`` when its parent exits (Linux; False
    elsewhere). ``parent``: the pid it must have (default: the parent now); if that one
    died before the tie took, the signal is sent at once."""
    parent = os.getppid() if parent is None else parent
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):  # not Linux
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)
    return True


def _kill_group(signum: int, frame: object) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)  # the shim included


def _exec_tied(argv: list[str]) -> None:
    """``--tie PID CMD ARGS...``: SIGTERM when ``PID`` (our parent) exits, then exec."""
    if len(argv) < 3 or not argv[1].isdigit():
        sys.exit("usage: python -m asyncrl.runtime.tether --tie PID CMD [ARGS...]")
    tie_to_parent(signal.SIGTERM, int(argv[1]))  # the tie outlives the exec
    os.execvp(argv[2], argv[2:])


def main() -> None:
    """Lead a process group, run ``sys.argv[1:]`` in it, SIGKILL the group if our parent
    dies; exit with the command's status. (``--tie``: ``_exec_tied``.)"""
    if sys.argv[1:2] == ["--tie"]:
        _exec_tied(sys.argv[1:])
    if len(sys.argv) < 2:
        sys.exit("usage: python -m asyncrl.runtime.tether CMD [ARGS...]")
    parent = os.getppid()
    if os.getpgrp() != os.getpid():  # not started as a group leader: become one
        os.setpgid(0, 0)
    signal.signal(_PARENT_DIED, _kill_group)
    tie_to_parent(_PARENT_DIED, parent)  # a parent already gone: the group is killed
    child = subprocess.Popen(sys.argv[1:])  # before ignoring: an ignored signal stays so
    for stop in (signal.SIGTERM, signal.SIGINT):  # a group stop: CMD's to handle
        signal.signal(stop, signal.SIG_IGN)
    sys.exit(child.wait())


if __name__ == "__main__":
    main()
