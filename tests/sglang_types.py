"""SGLang's own request types, read from its source: the oracle of the wire contract tests.

``pip download --no-deps sglang==SGLANG`` fetches the wheel once into the model cache's
sibling folder (``~/.cache/asyncrl/sglang``; 39 MB); ``request_fields(name)`` parses
``sglang/srt/managers/io_struct.py`` out of it with ``ast`` (importing it would need
SGLang's whole runtime) and gives each field of the named ``msgspec.Struct`` with its
annotation and whether it has a default. The inherited ``BaseReq`` fields (``rid``,
``http_worker_ipc``) are internal and left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from asyncrl.model_zoo import cache_dir, exclusive

#: Pinned, so every machine checks against the same definitions.
SGLANG = "0.5.23"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SERVER_ARGS = "sglang/srt/arg_groups/fields/"


@dataclass(frozen=True)
class Field:
    name: str
    annotation: str  # as written, e.g. "List[List[int]]", "Optional[str]"
    required: bool


def _wheel() -> Path:
    folder = cache_dir().parent / "sglang"
    with exclusive(folder):  # the other test worker may be downloading it
        found = sorted(folder.glob(f"sglang-{SGLANG}-*.whl"))
        if not found:
            folder.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
                 "--no-deps", f"sglang=={SGLANG}", "-d", str(folder)],
                check=True,
            )  # fmt: skip
            found = sorted(folder.glob(f"sglang-{SGLANG}-*.whl"))
    return found[0]


@cache
def _classes() -> dict[str, ast.ClassDef]:
    with zipfile.ZipFile(_wheel()) as wheel:
        tree = ast.parse(wheel.read(IO_STRUCT).decode())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def request_fields(name: str) -> dict[str, Field]:
    """The fields of SGLang's ``io_struct.<name>``, by name."""
    fields = {}
    for node in _classes()[name].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            annotation = ast.unparse(node.annotation)
            if annotation.startswith("ClassVar"):
                continue
            fields[node.target.id] = Field(node.target.id, annotation, node.value is None)
    return fields


@cache
def server_arg_fields() -> dict[str, str]:
    """SGLang's ``ServerArgs`` fields and their types as written. 0.5.23 declares them in
    ``sglang/srt/arg_groups/fields/*.py`` as ``name: A[Type, help]``."""
    fields = {}
    with zipfile.ZipFile(_wheel()) as wheel:
        names = [n for n in wheel.namelist() if n.startswith(SERVER_ARGS) and n.endswith(".py")]
        for name in names:
            for node in ast.walk(ast.parse(wheel.read(name).decode())):
                if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                    continue
                annotation = node.annotation
                if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "A":
                    typed = annotation.slice
                    first = typed.elts[0] if isinstance(typed, ast.Tuple) else typed
                    fields[node.target.id] = ast.unparse(first)
    return fields


def safe_unpickler_globals() -> set[tuple[str, str]]:
    """``SafeUnpickler.ALLOWED_GLOBALS`` of ``sglang/srt/utils/common.py``: the only
    globals an SGLang server lets an ``/update_weights_from_tensor`` payload name."""
    with zipfile.ZipFile(_wheel()) as wheel:
        tree = ast.parse(wheel.read("sglang/srt/utils/common.py").decode())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "SafeUnpickler":
            for item in node.body:
                target = ast.unparse(item.targets[0]) if isinstance(item, ast.Assign) else ""
                if target == "ALLOWED_GLOBALS":
                    return set(ast.literal_eval(item.value))
    raise LookupError("SafeUnpickler.ALLOWED_GLOBALS not found in the wheel")


def fits(value: object, annotation: str) -> bool:
    """Whether a JSON ``value`` is of the (simple) annotation SGLang gives the field."""
    text = annotation.replace("typing.", "").replace(" ", "")
    if text.startswith("Optional[") and text.endswith("]"):
        return value is None or fits(value, text[len("Optional[") : -1])
    if text.startswith("Annotated["):  # Annotated[List[bytes], Base64Bytes()]: base64 text
        inner = text[len("Annotated[") :].split(",")[0]
        return fits(value, inner.replace("bytes", "str"))
    if text.startswith(("List[", "list[")) and text.endswith("]"):
        return isinstance(value, list) and all(fits(v, text[5:-1]) for v in value)
    if text.startswith("Literal["):
        return value in ast.literal_eval(f"[{text[len('Literal[') : -1]}]")
    simple = {"str": str, "int": int, "bool": bool, "float": (int, float)}
    if text in simple:
        kind = simple[text]
        return isinstance(value, kind) and not (text == "int" and isinstance(value, bool))
    raise ValueError(f"annotation {annotation!r} is not one this check knows")


@cache
def api_types() -> Any:
    """SGLang's generated ``/generate`` JSON contract (``sglang/api/v1/api_types.py``,
    which needs only msgspec), imported from the wheel: ``generate_contract_error`` of
    its ``api_contract.py`` is ``GenerateRequest.from_json_value`` raising
    ``JsonContractError``."""
    import importlib.util
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="sglang-api-"))
    with zipfile.ZipFile(_wheel()) as wheel:
        (folder / "api_types.py").write_bytes(wheel.read("sglang/api/v1/api_types.py"))
    spec = importlib.util.spec_from_file_location("sglang_api_types", folder / "api_types.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the module's annotations by name
    spec.loader.exec_module(module)
    return module


def sglang_contract_error(body: dict[str, Any]) -> str | None:
    """What SGLang 0.5.23's ``/generate`` answers 400 ``{"error": ...}`` with, or None."""
    types = api_types()
    try:
        types.GenerateRequest.from_json_value(body)
    except types.JsonContractError as exc:
        return str(exc)
    return None
