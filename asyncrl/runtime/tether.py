"""``python -m asyncrl.runtime.tether CMD ARGS...``: run ``CMD`` tied to its parent.

An engine actor starts its server (SGLang, vLLM) in a process group of its own, so one
signal stops the server and every process it forks (SGLang's schedulers, vLLM's engine
core and workers). That also takes them out of the reach of whatever kills the actor: a
runtime's SIGKILL to the actor's group, or Ray killing its worker. This shim leads that
group: it asks the kernel to signal it when its parent dies (``PR_SET_PDEATHSIG``), runs
``CMD`` as its child, and on its parent's death SIGKILLs the whole group, so a dead actor
leaves no server, nor any process the server forked, holding memory or a GPU. (It used
to exec ``CMD`` with the signal set on it: the server died, but vLLM's engine core, a
process of the server's own, outlived a SIGKILLed actor, 1.7 GB each time.)

A group stop (SIGTERM or SIGINT to the group) reaches ``CMD`` and the shim alike: the shim
ignores it and exits with ``CMD``'s status once ``CMD`` has stopped. Linux only for the
parent-death signal; elsewhere the shim only waits.
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


def _kill_group(signum: int, frame: object) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)  # the shim included


def main() -> None:
    """Lead a process group, run ``sys.argv[1:]`` in it, SIGKILL the group if our parent
    dies; exit with the command's status."""
    if len(sys.argv) < 2:
        sys.exit("usage: python -m asyncrl.runtime.tether CMD [ARGS...]")
    parent = os.getppid()
    if os.getpgrp() != os.getpid():  # not started as a group leader: become one
        os.setpgid(0, 0)
    signal.signal(_PARENT_DIED, _kill_group)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, _PARENT_DIED)
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        sys.exit(1)
    child = subprocess.Popen(sys.argv[1:])  # before ignoring: an ignored signal stays so
    for stop in (signal.SIGTERM, signal.SIGINT):  # a group stop: CMD's to handle
        signal.signal(stop, signal.SIG_IGN)
    sys.exit(child.wait())


if __name__ == "__main__":
    main()
