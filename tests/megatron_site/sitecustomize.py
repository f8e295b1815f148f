"""Test-only: megatron-core on the CPU in ``asyncrl train``'s child processes.

A test puts this directory on ``PYTHONPATH`` and sets ``ASYNCRL_TEST_MEGATRON_CPU=1``;
Python imports ``sitecustomize`` at start-up in every process of the job. Only a process
that imports the megatron trainer (the trainer actor) installs the shim
(``tests/megatron_shim.install_for_process``), just before that import; the buffer,
rollout and engine processes are left alone.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Any

_TRIGGER = "asyncrl.trainers.megatron_trainer"


class _InstallShim(importlib.abc.MetaPathFinder):
    """Installs the shim on the first import of the megatron trainer, then stays inert
    (removing itself from ``sys.meta_path`` mid-lookup would skip the next finder)."""

    installed = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == _TRIGGER and not self.installed:
            self.installed = True
            from tests.megatron_shim import install_for_process

            install_for_process()
        return None  # the regular finders load the module


if os.environ.get("ASYNCRL_TEST_MEGATRON_CPU") == "1":
    sys.meta_path.insert(0, _InstallShim())
