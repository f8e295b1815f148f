"""Loading the user code a config names: by dotted path (``"package.module:name"`` or
``"package.module.name"``) or by file (``"path/to/file.py:name"``, relative to the working
directory; imported once per process as module ``asyncrl_user_<stem>_<hash of the path>``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from asyncrl.errors import InputError


class PluginError(InputError):
    """User code named by path cannot be loaded (a ``ValueError``)."""


def load_object(path: str, *, what: str = "object") -> Any:
    """Import and return the object named by ``path``; ``PluginError`` says what failed."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(
            f"{what} path {path!r} must look like 'package.module:name' or 'file.py:name'"
        )
    try:
        if module_name.endswith(".py"):
            module = _import_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # user code runs on import: any error means it cannot load
        raise PluginError(f"{what} path {path!r}: cannot import {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{what} path {path!r}: {module_name!r} has no {attr!r}") from None
    return obj


def _import_file(path: Path) -> ModuleType:
    """The module of the Python file at ``path``, executed once per process."""
    resolved = path.resolve()
    if not resolved.is_file():
        raise ImportError(f"no such file: {resolved}")
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    name = f"asyncrl_user_{resolved.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {resolved} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
