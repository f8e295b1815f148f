"""MessagePack codec for wire records, with arrays and tensors as out-of-band frames.

A ``Message`` encodes to ``frames = [body, buf_0, buf_1, ...]``. A numpy array or torch
tensor in it is an ext value with a binary header (``u8 dtype code, u8 ndim, ndim x u64
dims``): up to ``inline_bytes`` its bytes ride inside; larger, it names a buffer frame,
handed to zmq without a copy and decoded as a view on the received frame. Decoding
validates every field and names the bad one in a ``WireError``; nothing is pickled.
"""

from __future__ import annotations

import functools
import math
import re
import struct
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec
import numpy as np
from msgspec import msgpack

from asyncrl.wire.errors import FrameTooLarge, WireError

if TYPE_CHECKING:
    import torch

#: Bumped when the framing (not a message schema) changes incompatibly.
WIRE_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024
DEFAULT_INLINE_BYTES = 32 * 1024

_EXT_NDARRAY_INLINE = 1
_EXT_NDARRAY_FRAME = 2
_EXT_TENSOR_INLINE = 3
_EXT_TENSOR_FRAME = 4
_MAX_NDIM = 32

Buffer = bytes | bytearray | memoryview
_NO_BUFFERS: list[memoryview] = []  # shared, never mutated: callers only read it


class Message(
    msgspec.Struct,
    array_like=True,
    tag=True,
    kw_only=True,
    forbid_unknown_fields=True,
    gc=False,
):
    """Base of every wire record. Subclass it; the class name is the wire tag.

    ``gc=False``: records are plain data without reference cycles, and with tens of
    thousands of samples alive in the buffer, cyclic GC passes would dominate the
    per-message cost.
    """


T = TypeVar("T")

# One code table for numpy and torch. Codes are part of the wire format: append only.
_DTYPE_NAMES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
)
_NP_BY_CODE = {c: np.dtype(n) for c, n in enumerate(_DTYPE_NAMES) if n in np.sctypeDict}
_NP_CODE = {dtype: code for code, dtype in _NP_BY_CODE.items()}


@functools.cache
def _torch_tables() -> tuple[dict[int, torch.dtype], dict[torch.dtype, int]]:
    """Code <-> torch dtype maps; torch is imported only once a tensor is involved."""
    import torch

    by_code = {
        c: getattr(torch, n)
        for c, n in enumerate(_DTYPE_NAMES)
        if isinstance(getattr(torch, n, None), torch.dtype)
    }
    return by_code, {dtype: code for code, dtype in by_code.items()}


# Ext payload: u8 dtype code, u8 ndim, ndim x u64 dims, then the bytes (inline) or a
# u32 buffer-frame index (framed). Precompiled headers for the common ranks.
_HEADERS = [struct.Struct(f"<BB{n}Q") for n in range(5)]
_HEAD1 = _HEADERS[1]
_INDEX = struct.Struct("<I")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``); ``WireError`` if not a wire dtype."""
    code = _DTYPE_NAMES.index(name) if name in _DTYPE_NAMES else -1
    dtype = _torch_tables()[0].get(code)
    if dtype is None:
        raise WireError(f"unknown torch dtype {name!r}")
    return dtype


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; ``WireError`` if it cannot travel."""
    code = _torch_tables()[1].get(dtype)
    if code is None:
        raise WireError(f"torch dtype {dtype} cannot travel on the wire")
    return _DTYPE_NAMES[code]


def _header(code: int, shape: tuple[int, ...]) -> bytes:
    n = len(shape)
    if n < len(_HEADERS):
        return _HEADERS[n].pack(code, n, *shape)
    if n > _MAX_NDIM:
        raise WireError(f"array of {n} dimensions exceeds {_MAX_NDIM}")
    return struct.pack(f"<BB{n}Q", code, n, *shape)


def _parse_header(data: memoryview) -> tuple[int, tuple[int, ...], int]:
    """Return (dtype code, shape, header length) of an ext payload."""
    if len(data) < 2:
        raise WireError("array header truncated")
    code, ndim = data[0], data[1]
    end = 2 + 8 * ndim
    if ndim > _MAX_NDIM or len(data) < end:
        raise WireError(f"array header truncated or ndim {ndim} > {_MAX_NDIM}")
    shape = (
        _HEADERS[ndim].unpack_from(data)[2:]
        if ndim < len(_HEADERS)
        else struct.unpack_from(f"<{ndim}Q", data, 2)
    )
    return code, shape, end


def _ndarray_payload(arr: np.ndarray) -> tuple[int, tuple[int, ...], np.ndarray]:
    code = _NP_CODE.get(arr.dtype)
    if code is None:
        native = arr.dtype.newbyteorder("=")
        code = _NP_CODE.get(native)
        if code is None:
            raise WireError(f"numpy dtype {arr.dtype} cannot travel on the wire")
        arr = arr.astype(native)
    return code, arr.shape, arr


def _tensor_payload(t: torch.Tensor) -> tuple[int, tuple[int, ...], np.ndarray]:
    import torch

    code = _torch_tables()[1].get(t.dtype)
    if code is None:
        raise WireError(f"torch dtype {t.dtype} cannot travel on the wire")
    # .cpu() is a copy only for device tensors; GPU weights take the NCCL path instead.
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    return code, tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy()


def _is_tensor(obj: Any) -> bool:
    # No object can be a tensor unless torch is already imported: never import it here.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _check_nbytes(shape: tuple[int, ...], itemsize: int, nbytes: int) -> None:
    expected = math.prod(shape) * itemsize
    if expected != nbytes:
        raise WireError(f"shape {list(shape)} needs {expected} bytes, frame has {nbytes}")


class Codec(Generic[T]):
    """Encodes and decodes one closed set of message types.

    ``Codec(Heartbeat | Command)`` decodes only those two records; anything else is a
    ``WireError``. Not thread-safe (one per event loop), cheap to create.
    """

    def __init__(
        self,
        types: Any,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        inline_bytes: int = DEFAULT_INLINE_BYTES,
    ) -> None:
        self.types = types
        self.max_frame_bytes = max_frame_bytes
        self.inline_bytes = inline_bytes
        self._out: list[memoryview] = []
        self._in: Sequence[Buffer] = ()
        self._used = 0
        self._copy_inline = False
        self._encoder = msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgpack.Decoder(types, ext_hook=self._ext_hook, dec_hook=_dec_hook)
        self._list_decoder = msgpack.Decoder(
            list[types], ext_hook=self._ext_hook, dec_hook=_dec_hook
        )

    # -- encode ---------------------------------------------------------------------
    def encode(self, msg: T) -> list[Buffer]:
        """Return ``[body, *buffers]`` for ``msg``; raises ``WireError`` / ``FrameTooLarge``."""
        body, buffers = self.encode_parts(msg)
        return [body, *buffers]

    def encode_parts(self, msg: T) -> tuple[bytes, list[memoryview]]:
        """Like ``encode`` but returns the body and the buffer frames separately."""
        try:
            body = self._encoder.encode(msg)
        except Exception as exc:
            self._out = []  # a failed encode must not leave frames for the next message
            if isinstance(exc, (TypeError, OverflowError)):
                raise WireError(f"cannot encode {type(msg).__name__}: {exc}") from exc
            raise
        if not self._out and len(body) <= self.max_frame_bytes:
            return body, _NO_BUFFERS  # the common case: no per-call allocations
        buffers, self._out = self._out, []
        self._check_sizes(type(msg).__name__, len(body), buffers)
        return body, buffers

    def _check_sizes(self, what: str, body_len: int, buffers: list[memoryview]) -> None:
        limit = self.max_frame_bytes
        if body_len > limit:
            raise FrameTooLarge(f"{what}: body of {body_len} bytes exceeds limit {limit}")
        for buf in buffers:
            if buf.nbytes > limit:
                raise FrameTooLarge(f"{what}: buffer of {buf.nbytes} bytes exceeds limit {limit}")

    def _enc_hook(self, obj: Any) -> Any:
        # Fast path: small 1-D numpy arrays (token ids, log-probs) are most of the traffic.
        if type(obj) is np.ndarray and obj.ndim == 1 and obj.nbytes <= self.inline_bytes:
            code = _NP_CODE.get(obj.dtype)
            if code is not None:
                header = _HEAD1.pack(code, 1, len(obj))
                return msgpack.Ext(_EXT_NDARRAY_INLINE, header + obj.tobytes())
        return self._enc_general(obj)

    def _enc_general(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            code, shape, arr = _ndarray_payload(obj)
            inline, framed = _EXT_NDARRAY_INLINE, _EXT_NDARRAY_FRAME
        elif _is_tensor(obj):
            code, shape, arr = _tensor_payload(obj)
            inline, framed = _EXT_TENSOR_INLINE, _EXT_TENSOR_FRAME
        else:
            raise TypeError(f"type {type(obj).__name__} is not a wire type")
        header = _header(code, shape)
        if arr.nbytes <= self.inline_bytes:
            return msgpack.Ext(inline, header + arr.tobytes())
        arr = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        self._out.append(memoryview(arr))
        return msgpack.Ext(framed, header + _INDEX.pack(len(self._out) - 1))

    # -- decode ---------------------------------------------------------------------
    def decode(self, frames: Sequence[Buffer]) -> T:
        """Decode ``[body, *buffers]``; raises ``WireError`` naming the bad field."""
        if not frames:
            raise WireError("empty message: no body frame")
        return self.decode_parts(frames[0], frames[1:])

    def decode_parts(self, body: Buffer, buffers: Sequence[Buffer] = ()) -> T:
        """Decode a body whose buffer frames are ``buffers``.

        The message gets a private copy of ``body``: inline arrays are writable views into
        it (one allocation per message, and no view pins a received batch frame). Arrays
        from buffer frames are views on those frames.
        """
        if len(body) > self.max_frame_bytes or buffers:
            self._check_sizes("message", len(body), [memoryview(b) for b in buffers])
        owned = bytearray(body)
        self._in, self._used = buffers, 0
        try:
            msg = self._decoder.decode(owned)
        except msgspec.ValidationError as exc:
            raise WireError(_with_field_names(str(exc), body)) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise WireError(f"malformed MessagePack: {exc}") from None
        finally:
            self._in = ()
        if self._used != len(buffers):
            raise WireError(f"{len(buffers)} buffer frames sent, {self._used} referenced")
        return msg

    def decode_many(self, body: Buffer) -> list[T]:
        """Decode a MessagePack array of messages that reference no buffer frames.

        One call for a whole batch (the reliable receiver's common case). Inline arrays get
        a private copy each instead of viewing ``body``, so no array pins the batch frame.
        Raises ``WireError``; the caller decodes item by item to find the bad one.
        """
        self._copy_inline = True
        try:
            return self._list_decoder.decode(body)
        except (msgspec.MsgspecError, UnicodeDecodeError) as exc:
            raise WireError(f"batch does not decode: {exc}") from None
        finally:
            self._copy_inline = False

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if self._copy_inline:
            data = memoryview(bytearray(data))
        if code == _EXT_NDARRAY_INLINE and len(data) >= _HEAD1.size and data[1] == 1:
            dcode, _, n = _HEAD1.unpack_from(data)
            dtype = _NP_BY_CODE.get(dcode)
            if dtype is not None and n * dtype.itemsize == len(data) - _HEAD1.size:
                return np.frombuffer(data, dtype, n, _HEAD1.size)  # view into the owned body
        return self._ext_general(code, data)

    def _ext_general(self, code: int, data: memoryview) -> Any:
        try:
            return self._ext_array(code, data)
        except WireError:
            raise
        except Exception as exc:  # a hostile header can make numpy or torch raise anything
            raise WireError(f"bad array in ext {code}: {type(exc).__name__}: {exc}") from None

    def _ext_array(self, code: int, data: memoryview) -> Any:
        dcode, shape, start = _parse_header(data)
        if code in (_EXT_NDARRAY_INLINE, _EXT_TENSOR_INLINE):
            payload: Buffer = data[start:]  # a view into the message's owned body
        elif code in (_EXT_NDARRAY_FRAME, _EXT_TENSOR_FRAME):
            payload = self._buffer_frame(data, start)
        else:
            raise WireError(f"unknown ext type {code}")
        if code <= _EXT_NDARRAY_FRAME:
            np_dtype = _NP_BY_CODE.get(dcode)
            if np_dtype is None:
                raise WireError(f"unknown numpy dtype code {dcode}")
            _check_nbytes(shape, np_dtype.itemsize, len(payload))
            return np.frombuffer(payload, np_dtype).reshape(shape)
        torch = sys.modules.get("torch")
        if torch is None:  # a codec whose messages hold tensors has imported torch already
            raise WireError("a tensor arrived for a message type that holds no tensors")
        dtype = _torch_tables()[0].get(dcode)
        if dtype is None:
            raise WireError(f"unknown torch dtype code {dcode}")
        _check_nbytes(shape, dtype.itemsize, len(payload))
        if not len(payload):
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(payload, dtype=dtype).reshape(shape)

    def _buffer_frame(self, data: memoryview, start: int) -> memoryview:
        if len(data) != start + _INDEX.size:
            raise WireError("framed array header has the wrong length")
        (index,) = _INDEX.unpack_from(data, start)
        if index >= len(self._in):
            raise WireError(f"buffer index {index} out of range ({len(self._in)} frames)")
        self._used += 1
        view = memoryview(self._in[index]).cast("B")
        # Arrays handed to users are always writable; a read-only source costs one copy.
        return memoryview(bytearray(view)) if view.readonly else view


def _dec_hook(tp: type, obj: Any) -> Any:
    if isinstance(obj, tp):
        return obj
    raise msgspec.ValidationError(f"Expected `{tp.__name__}`, got `{type(obj).__name__}`")


_PATH_RE = re.compile(r" - at `\$(.*)`$")
_STEP_RE = re.compile(r"\[(\d+)\]|\.([A-Za-z_]\w*)|\[([^\]]*)\]")
_raw_decoder = msgpack.Decoder(ext_hook=lambda code, data: None)


def _with_field_names(error: str, body: Buffer) -> str:
    """Rewrite msgspec's positional path (``$[2][0][1]``) into field names.

    Array-like structs lose their field names on the wire, so the raw data is walked
    alongside the path: a list whose first item is a known ``Message`` tag maps index
    ``i`` to that class's field ``i - 1``.
    """
    try:
        node: Any = _raw_decoder.decode(body)
    except (msgspec.MsgspecError, UnicodeDecodeError):
        return error
    match = _PATH_RE.search(error)
    if match is None:
        cls = _message_class(node)
        return f"{cls.__name__}: {error}" if cls is not None else error
    named = ""
    for index, key, other in _STEP_RE.findall(match.group(1)):
        if index:
            i = int(index)
            cls = _message_class(node)
            if cls is not None and 0 < i <= len(cls.__struct_fields__):
                field = cls.__struct_fields__[i - 1]
                named = f"{named}.{field}" if named else f"{cls.__name__}.{field}"
            elif cls is not None and i == 0:
                named = named or cls.__name__
            else:
                named += f"[{i}]"
            node = node[i] if isinstance(node, list) and i < len(node) else None
        else:
            step = key or other
            named += f"[{step!r}]" if other else f".{step}"
            node = node.get(step) if isinstance(node, dict) else None
    return f"{_PATH_RE.sub('', error)} - at `{named or '$'}`"


def _message_class(node: Any) -> type[Message] | None:
    if isinstance(node, list) and node and isinstance(node[0], str):
        return _message_classes().get(node[0])
    return None


def _message_classes() -> dict[str, type[Message]]:
    found: dict[str, type[Message]] = {}
    stack = list(Message.__subclasses__())
    while stack:
        cls = stack.pop()
        found[cls.__name__] = cls
        stack.extend(cls.__subclasses__())
    return found
