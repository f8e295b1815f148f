"""Loading user code by dotted path: ``"package.module:name"`` or ``"package.module.name"``.

Used wherever a config names code to run: actor classes in ``ActorSpec.cls``, and later
custom rewards (``--custom-rm-path``) and workflows (``--custom-generate-function-path``).
"""

from __future__ import annotations

import importlib
from typing import Any


def load_object(path: str, *, what: str = "object") -> Any:
    """Import and return the object named by ``path``; ``ValueError`` says what failed."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} path {path!r} must look like 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} path {path!r}: cannot import {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what} path {path!r}: {module_name!r} has no {attr!r}") from None
    return obj
