"""``python -m asyncrl.runtime.tether CMD ARGS...``: exec ``CMD`` tied to its parent.

An engine actor starts its SGLang server in a process group of its own (so one signal
stops the server and every scheduler process it forks). That also takes the server out of
the reach of whatever kills the actor: a runtime's SIGKILL to the actor's group, or Ray
killing its worker. This shim asks the kernel to SIGKILL it when its parent dies
(``PR_SET_PDEATHSIG`` survives ``exec``), then becomes ``CMD``, so a dead actor never
leaves a server holding a GPU. Linux only; elsewhere it just execs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main() -> None:
    """Set the parent-death signal, then exec ``sys.argv[1:]``."""
    if len(sys.argv) < 2:
        sys.exit("usage: python -m asyncrl.runtime.tether CMD [ARGS...]")
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        sys.exit(1)
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
