"""asyncrl: asynchronous actor-model dataflow engine for RL post-training.

The Python API (``make_config``, ``train``, ``open_run``) is ``asyncrl/api.py``; importing the
package imports nothing heavy: the API loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "JobFailed",
    "Run",
    "RunConfig",
    "__version__",
    "make_config",
    "open_run",
    "train",
    "train_async",
]

if TYPE_CHECKING:
    from asyncrl.api import (
        ConfigError,
        JobFailed,
        Run,
        RunConfig,
        make_config,
        open_run,
        train,
        train_async,
    )


def __getattr__(name: str) -> Any:
    # The CLI and every actor import the package: the API (config, the job controller)
    # loads only when a script asks for it.
    if name in __all__:
        from asyncrl import api

        return getattr(api, name)
    raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")
