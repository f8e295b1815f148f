"""The codec: records and arrays round-trip bit-exactly; bad input is a named WireError."""

from __future__ import annotations

import inspect
import itertools

import msgpack
import msgspec
import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from asyncrl.wire import messages
from asyncrl.wire.codec import Codec, Message
from asyncrl.wire.errors import FrameTooLarge, WireError


class Record(Message):
    name: str
    reward: float
    tokens: np.ndarray
    tensor: torch.Tensor | None = None
    extra: dict[str, int] = msgspec.field(default_factory=dict)


class Outer(Message):
    items: list[Record]


_ADDRESSES = itertools.count()


def roundtrip(codec: Codec, msg: object) -> object:
    """Encode, push through a real zmq socket pair without copies, decode."""
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    addr = f"inproc://codec-{next(_ADDRESSES)}"
    a.bind(addr)
    b.connect(addr)
    try:
        a.send_multipart(codec.encode(msg), copy=False)
        frames = b.recv_multipart(copy=False)
        return codec.decode([f.buffer for f in frames])
    finally:
        a.close(linger=0)
        b.close(linger=0)


EXAMPLES = {
    messages.Hello: messages.Hello(
        actor="rollout-0", role="rollout", pid=7, host="h", endpoints={"work": "tcp://127.0.0.1:1"}
    ),
    messages.Heartbeat: messages.Heartbeat(
        actor="a", pid=1, seq=3, state="running", version=9, stats={"x": 1.5}
    ),
    messages.Bye: messages.Bye(actor="a", pid=1, reason="stopped", ok=True),
    messages.Command: messages.Command(kind="pause", args={"mode": "abort", "n": 2}),
    messages.CommandResult: messages.CommandResult(ok=False, error="boom", data={"k": 1.0}),
    messages.TensorEntry: messages.TensorEntry(
        name="w", dtype="bfloat16", shape=[2, 3], offset=64, nbytes=12
    ),
    messages.BlobManifest: messages.BlobManifest(
        blob="v1", total_bytes=128, chunk_bytes=64, entries=[]
    ),
    messages.FetchManifest: messages.FetchManifest(blob="v1"),
    messages.FetchChunk: messages.FetchChunk(blob="v1", index=3),
    messages.FetchDone: messages.FetchDone(blob="v1"),
    messages.BlobChunk: messages.BlobChunk(
        blob="v1", index=0, parts=[(0, np.arange(100, dtype=np.uint8))]
    ),
    messages.WeightVersion: messages.WeightVersion(
        version=4, transport="pull", location="tcp://127.0.0.1:5", blob="v4"
    ),
    messages.Probe: messages.Probe(sender="s", seq=1, payload=np.arange(5, dtype=np.int32)),
}


def test_every_message_type_in_messages_module_has_a_roundtrip_example():
    defined = {
        obj
        for _, obj in inspect.getmembers(messages, inspect.isclass)
        if issubclass(obj, Message) and obj is not Message
    }
    assert defined == set(EXAMPLES)


@pytest.mark.parametrize("cls", list(EXAMPLES), ids=lambda c: c.__name__)
def test_every_message_type_roundtrips_through_zmq(cls: type):
    msg = EXAMPLES[cls]
    out = roundtrip(Codec(cls), msg)
    assert type(out) is cls
    inline = Codec(cls, inline_bytes=1 << 20)  # canonical bytes, arrays included
    assert inline.encode(out) == inline.encode(msg)


NUMPY_DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
]


@settings(max_examples=60, deadline=None)
@given(
    arr=hnp.arrays(
        st.sampled_from(NUMPY_DTYPES), hnp.array_shapes(min_dims=0, max_dims=4, max_side=9)
    )
)
def test_numpy_arrays_of_any_dtype_and_shape_roundtrip_bit_exactly(arr: np.ndarray):
    for inline in (0, 1 << 20):  # buffer frame and inline ext
        out = roundtrip(
            Codec(Record, inline_bytes=inline), Record(name="x", reward=0.0, tokens=arr)
        )
        assert out.tokens.dtype == arr.dtype and out.tokens.shape == arr.shape
        assert out.tokens.tobytes() == arr.tobytes()


TORCH_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.complex64,
]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 3, 4, 5)], ids=str)
@pytest.mark.parametrize("inline", [0, 1 << 20], ids=["frame", "inline"])
def test_torch_tensors_roundtrip_bit_exactly(dtype: torch.dtype, shape: tuple, inline: int):
    t = (torch.randn(shape) * 10).to(dtype)
    out = roundtrip(
        Codec(Record, inline_bytes=inline),
        Record(name="t", reward=1.0, tokens=np.zeros(1), tensor=t),
    )
    assert out.tensor.dtype == dtype and tuple(out.tensor.shape) == shape
    assert out.tensor.view(-1).view(torch.uint8).tolist() == t.view(-1).view(torch.uint8).tolist()


def test_non_contiguous_and_big_endian_arrays_are_sent_as_values():
    base = np.arange(48, dtype=np.float32).reshape(6, 8)
    codec = Codec(Record)
    assert np.array_equal(
        roundtrip(codec, Record(name="t", reward=0, tokens=base.T)).tokens, base.T
    )
    big = np.arange(10, dtype=">i4")
    assert roundtrip(codec, Record(name="b", reward=0, tokens=big)).tokens.tolist() == list(
        range(10)
    )
    t = torch.arange(12).reshape(3, 4).t()
    out = roundtrip(codec, Record(name="t", reward=0, tokens=np.zeros(1), tensor=t))
    assert torch.equal(out.tensor, t)


def test_large_arrays_travel_as_separate_frames_and_decode_without_copy():
    codec = Codec(Record, inline_bytes=1024)
    arr = np.arange(10_000, dtype=np.int64)
    frames = codec.encode(Record(name="big", reward=0.0, tokens=arr))
    assert len(frames) == 2 and memoryview(frames[1]).nbytes == arr.nbytes
    buf = bytearray(memoryview(frames[1]))
    out = codec.decode([bytes(frames[0]), memoryview(buf)])
    buf[0:8] = (99).to_bytes(8, "little")  # a view on the received frame: no copy made
    assert out.tokens[0] == 99


def test_small_inline_arrays_are_owned_and_writable():
    codec = Codec(Record)
    body = bytearray(codec.encode(Record(name="s", reward=0, tokens=np.arange(4)))[0])
    out = codec.decode([body])
    body[:] = b"\0" * len(body)
    out.tokens[0] = 7
    assert out.tokens.tolist() == [7, 1, 2, 3]


def test_nested_message_fields_are_validated_and_named():
    codec = Codec(Outer)
    bad = msgspec.msgpack.encode(["Outer", [["Record", "x", "not-a-float", None]]])
    with pytest.raises(WireError, match=r"Outer\.items\[0\]\.reward"):
        codec.decode([bad])


def test_unknown_message_type_and_wrong_arity_are_wire_errors():
    codec = Codec(messages.Hello)
    with pytest.raises(WireError, match="Invalid value 'Nope'"):
        codec.decode([msgspec.msgpack.encode(["Nope", "a", "r", 1, "h"])])
    with pytest.raises(WireError, match=r"^Hello: Expected `array` of at least length 5"):
        codec.decode([msgspec.msgpack.encode(["Hello", "a"])])
    with pytest.raises(WireError, match=r"Expected `array` of length at most|Expected"):
        codec.decode([msgspec.msgpack.encode(["Hello", "a", "r", 1, "h", {}, "extra"])])


def test_array_headers_that_lie_about_size_or_frames_are_refused():
    codec = Codec(Record, inline_bytes=16)
    frames = codec.encode(Record(name="x", reward=0.0, tokens=np.arange(100)))
    with pytest.raises(WireError, match="out of range"):
        codec.decode(frames[:1])
    with pytest.raises(WireError, match="needs 800 bytes"):
        codec.decode([frames[0], b"short"])
    with pytest.raises(WireError, match="referenced"):
        codec.decode([*frames, b"unexpected extra frame"])


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300))
def test_random_bytes_never_raise_anything_but_wire_error(data: bytes):
    codec = Codec(Outer | messages.Hello)
    try:
        codec.decode([data])
    except WireError:
        pass


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(min_value=0, max_value=400))
def test_truncated_bodies_are_wire_errors(cut: int):
    codec = Codec(Record)
    body = bytes(codec.encode(Record(name="t", reward=1.0, tokens=np.arange(40)))[0])
    if cut >= len(body):
        return
    with pytest.raises(WireError):
        codec.decode([body[:cut]])


def test_frames_over_the_size_limit_are_refused_on_both_sides():
    codec = Codec(Record, max_frame_bytes=1000, inline_bytes=10_000)
    with pytest.raises(FrameTooLarge, match="exceeds limit 1000"):
        codec.encode(Record(name="x", reward=0.0, tokens=np.zeros(500)))
    small = Codec(Record, max_frame_bytes=100)
    body = Codec(Record).encode(Record(name="x" * 200, reward=0.0, tokens=np.zeros(1)))[0]
    with pytest.raises(FrameTooLarge):
        small.decode([body])


def test_objects_that_are_not_wire_types_are_refused_not_pickled():
    codec = Codec(Record)
    with pytest.raises(WireError, match="dtype object cannot travel"):
        codec.encode(Record(name="x", reward=0.0, tokens=np.array([object()], dtype=object)))

    class Foreign:
        pass

    with pytest.raises(WireError, match="Foreign is not a wire type"):
        codec.encode(Record(name="x", reward=0.0, tokens=np.zeros(1), extra={"a": Foreign()}))


def test_a_reference_msgpack_implementation_reads_our_frames():
    codec = Codec(messages.Heartbeat)
    body = codec.encode(EXAMPLES[messages.Heartbeat])[0]
    assert msgpack.unpackb(bytes(body)) == ["Heartbeat", "a", 1, 3, "running", 9, {"x": 1.5}]


def test_a_failed_encode_leaves_nothing_behind_for_the_next_message():
    class Two(Message):
        a: np.ndarray
        b: np.ndarray

    codec = Codec(Two, inline_bytes=10)
    with pytest.raises(WireError):
        codec.encode(Two(a=np.arange(100), b=np.array([object()], dtype=object)))
    frames = codec.encode(Two(a=np.arange(3), b=np.arange(4)))
    out = codec.decode(frames)
    assert len(frames) == 3 and out.b.tolist() == [0, 1, 2, 3]


def test_hostile_array_headers_are_wire_errors_and_never_import_torch():
    import subprocess
    import sys

    script = (
        "import msgspec, numpy as np, sys\n"
        "from asyncrl.wire.codec import Codec, Message, _HEADERS\n"
        "from asyncrl.wire.errors import WireError\n"
        "class R(Message):\n    a: np.ndarray\n"
        "c = Codec(R)\n"
        "bad = [msgspec.msgpack.Ext(1, _HEADERS[2].pack(3, 2, 0, 2**63)),\n"
        "       msgspec.msgpack.Ext(3, _HEADERS[1].pack(10, 1, 2) + bytes(8)),\n"
        "       msgspec.msgpack.Ext(9, bytes(3)), msgspec.msgpack.Ext(1, bytes(1))]\n"
        "for ext in bad:\n"
        "    try:\n        c.decode([msgspec.msgpack.encode(['R', ext])])\n"
        "    except WireError:\n        pass\n"
        "    else:\n        raise SystemExit('accepted a hostile header')\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
