"""megatron-core's checkpoint writer without an orphan process.

megatron keeps the writer's results queue in a ``multiprocessing`` manager process that
it starts at the first save and never stops, so it would outlive follower ranks (they end
with ``os._exit``) and a killed trainer. ``own_results_queue()`` starts that manager first,
with a thread that ends it once its parent is gone (megatron-core <= 0.16).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from multiprocessing.managers import SyncManager


def _exit_with_parent(parent: int) -> None:
    """In the manager process: exit once ``parent`` is no longer our parent."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def own_results_queue() -> None:
    """Give megatron's async file writer a results queue whose manager exits with us."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=_exit_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
