"""SGLang's ``/update_weights_from_tensor`` payload (``docs/sglang_api.md`` 2.4): named
tensors handed over by reference, so the engine and the trainer must share the host.

Each entry of ``serialized_named_tensors`` is the base64 of a ``ForkingPickler`` pickle, as
SGLang's ``MultiprocessingSerializer`` makes it: a CPU tensor as its named shared-memory
storage, a CUDA tensor as an IPC handle. ``load_format`` None pickles ``[(name, tensor),
...]``; ``"flattened_bucket"`` pickles ``flattened``'s dict. ``decode`` never runs a pickle
freely: it allows only the globals these payloads use (``_ALLOWED``) and refuses any
other by name, as SGLang's ``SafeUnpickler`` does.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # registers torch's reductions with ForkingPickler

from asyncrl.errors import EngineError


@dataclass
class FlattenedTensorMetadata:
    """Where one tensor lies in a flattened bucket (SGLang's class of the same name)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
_ALLOWED: dict[str, set[str]] = {
    "torch.multiprocessing.reductions": {
        "rebuild_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
        "rebuild_storage_fd", "rebuild_storage_filename", "rebuild_storage_empty",
        "rebuild_cuda_tensor", "rebuild_nested_tensor",
    },
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch": {"Tensor", "Size", "float32", "float16", "bfloat16", "float64", "int64", "int32",
              "int16", "int8", "uint8", "bool"},
    "torch._utils": {"_rebuild_tensor_v2"},
    "multiprocessing.resource_sharer": {"DupFd"},
    __name__: {"FlattenedTensorMetadata"},
}  # fmt: skip


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _SGLANG_METADATA:
            return FlattenedTensorMetadata
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise EngineError(f"serialized_named_tensors: {module}.{name} is not allowed")


@contextlib.contextmanager
def named_sharing() -> Iterator[None]:
    """CPU storages shared meanwhile go to shared memory named in the file system, which
    any process on the host can open. (torch's default, a file descriptor, is handed only
    to a process that shares our ``multiprocessing`` authentication key: our children.)"""
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)


class _SGLangPickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    """``ForkingPickler``'s reductions (torch's storages by reference), with our
    ``FlattenedTensorMetadata`` written under SGLang's name: an SGLang server's
    ``SafeUnpickler`` allows that exact name, and we need not import SGLang to write it."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=4)
        self.dispatch_table = ForkingPickler._copyreg_dispatch_table.copy()  # type: ignore[attr-defined]
        self.dispatch_table.update(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]

    def save_global(self, obj: object, name: str | None = None) -> None:
        if obj is FlattenedTensorMetadata:
            module, qualname = _SGLANG_METADATA
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


def encode(payload: object) -> str:
    """``payload`` pickled by reference as base64: CPU storages move to named shared
    memory (``named_sharing``), CUDA ones go as IPC handles."""
    buffer = io.BytesIO()
    with named_sharing():
        _SGLangPickler(buffer).dump(payload)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode(text: str) -> Any:
    """The payload of one ``serialized_named_tensors`` entry; ``EngineError`` if malformed
    or if it names a global outside the allow-list."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EngineError(f"serialized_named_tensors: not base64 ({exc})") from None
    try:
        return _AllowListUnpickler(io.BytesIO(raw)).load()
    except EngineError:
        raise
    except Exception as exc:  # truncated, or a storage whose sender is gone
        raise EngineError(f"serialized_named_tensors: cannot be read ({exc!r})") from None


def bucket_layout(named: Iterable[tuple[str, torch.Tensor]]) -> list[FlattenedTensorMetadata]:
    """Where each of ``named`` lies in their flattened bucket: their bytes, in order."""
    metadata, offset = [], 0
    for name, t in named:
        metadata.append(
            FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + t.nbytes, t.nbytes)
        )
        offset += t.nbytes
    return metadata


def flattened(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The ``flattened_bucket`` payload of ``named``: their bytes in one ``uint8`` tensor."""
    if not named:
        raise ValueError("a flattened bucket needs at least one tensor")
    parts = [t.detach().contiguous().view(-1).view(torch.uint8) for _, t in named]
    return {"flattened_tensor": torch.cat(parts), "metadata": bucket_layout(named)}


def named_tensors(payload: Any, load_format: str | None) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of a decoded payload; ``EngineError`` when its shape is wrong."""
    if load_format == "flattened_bucket":
        if not isinstance(payload, dict) or {"flattened_tensor", "metadata"} - set(payload):
            raise EngineError("flattened_bucket: expected {flattened_tensor, metadata}")
        flat, metadata = payload["flattened_tensor"], payload["metadata"]
        if not isinstance(flat, torch.Tensor) or not all(
            isinstance(m, FlattenedTensorMetadata) for m in metadata
        ):
            raise EngineError("flattened_bucket: expected a tensor and FlattenedTensorMetadata")
        return {m.name: piece(flat, m) for m in metadata}
    if not isinstance(payload, list) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], torch.Tensor) for p in payload
    ):
        raise EngineError("serialized_named_tensors: expected a list of (name, tensor)")
    return dict(payload)


def piece(flat: torch.Tensor, meta: FlattenedTensorMetadata) -> torch.Tensor:
    """The tensor ``meta`` describes, a view of ``flat`` (a ``uint8`` bucket) where aligned."""
    if flat.dtype != torch.uint8 or not 0 <= meta.start_idx <= meta.end_idx <= flat.numel():
        raise EngineError(f"flattened_bucket: {meta.name} lies outside the flat tensor")
    part = flat[meta.start_idx : meta.end_idx]
    if part.data_ptr() % meta.dtype.itemsize:  # mixed dtypes: realign by a copy
        part = part.clone()
    try:
        return part.view(meta.dtype).view(meta.shape)
    except RuntimeError as exc:
        raise EngineError(f"flattened_bucket: {meta.name}: {exc}") from None
