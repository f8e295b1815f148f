"""Checkpoint files written past the page cache (``asyncrl.trainers.direct_io``): the same
files as safetensors' and torch's own writers, whatever the filesystem takes."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from asyncrl.trainers import direct_io
from asyncrl.trainers.direct_io import DirectFile, save_object, save_tensors


def mixed_tensors() -> dict[str, torch.Tensor]:
    """Every width, and dtypes of one width whose names sort against their rank (int32
    'a' before float32 'b' by name, after it by safetensors' rank), odd byte counts."""
    gen = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(3_000_001, generator=gen),  # 12 MB: crosses the 8 MB buffer
        "a.i32": torch.arange(3, dtype=torch.int32),
        "b.u32": torch.arange(2, dtype=torch.int32).view(torch.uint32),
        "a.f64": torch.randn(2, generator=gen, dtype=torch.float64),
        "b.i64": torch.arange(5, dtype=torch.int64),
        "a.i16": torch.arange(3, dtype=torch.int16),
        "b.bf16": torch.randn(7, 3, generator=gen).to(torch.bfloat16),  # 42 bytes
        "c.f16": torch.tensor(2.5, dtype=torch.float16),  # 0-dim
        "a.bool": torch.tensor([True, False, True]),
        "b.u8": torch.arange(3, dtype=torch.uint8),
        "c.i8": torch.arange(5, dtype=torch.int8),
        "d.f8": torch.randn(3, generator=gen).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(6, 4, generator=gen).t(),  # not contiguous
        "ünï": torch.ones(2),  # a name outside ASCII
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (float8 has no ``==``; NaN bytes compare too)."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*flat)


def direct_io_here(path: Path) -> bool:
    """Whether this filesystem takes O_DIRECT for a write at all."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(path / "probe", os.O_WRONLY | os.O_CREAT | flag)
    except OSError:
        return False
    os.close(fd)
    return True


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("metadata", [{"format": "pt"}, {}, None], ids=["meta", "empty", "none"])
def test_safetensors_written_direct_are_safetensors_own_file(
    tmp_path: Path, direct: bool, metadata: dict[str, str] | None
):
    tensors = mixed_tensors()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    save_tensors(tensors, ours, metadata=metadata, direct=direct)
    save_file({k: v.contiguous() for k, v in tensors.items()}, theirs, metadata=metadata)
    assert ours.read_bytes() == theirs.read_bytes()  # layout, order, header, length
    loaded = load_file(ours)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert same(loaded[name], tensor), name
    with safe_open(ours, "pt") as f:
        assert f.metadata() == metadata


def test_a_dtype_not_written_here_goes_to_safetensors_itself(tmp_path: Path):
    tensors = {"z": torch.randn(3, dtype=torch.complex64), "w": torch.ones(2)}
    save_tensors(tensors, tmp_path / "ours.safetensors")
    save_file(tensors, tmp_path / "theirs.safetensors")
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()


def test_bad_metadata_and_names_are_refused_before_a_byte_is_written(tmp_path: Path):
    with pytest.raises(ValueError, match="str to str"):
        save_tensors({"w": torch.ones(1)}, tmp_path / "a", metadata={"step": 3})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="__metadata__"):
        save_tensors({"__metadata__": torch.ones(1)}, tmp_path / "b")
    assert not list(tmp_path.iterdir())


def test_the_writes_really_bypass_the_page_cache_where_the_filesystem_allows(tmp_path: Path):
    if not direct_io_here(tmp_path):
        pytest.skip("this filesystem takes no O_DIRECT")
    with DirectFile(tmp_path / "f.bin") as f:
        f.write(b"x" * ((9 << 20) + 5))  # a full block out, and an odd tail to pad
        assert f.direct  # no write fell back
    assert (tmp_path / "f.bin").read_bytes() == b"x" * ((9 << 20) + 5)


def test_torch_save_through_a_direct_file_loads_as_torch_save(tmp_path: Path):
    model = torch.nn.Linear(300, 200)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 300)).sum().backward()
    opt.step()
    save_object(opt.state_dict(), tmp_path / "optimizer.pt")
    torch.save(opt.state_dict(), tmp_path / "plain.pt")
    ours, theirs = (
        torch.load(tmp_path / name, weights_only=True, mmap=True)
        for name in ("optimizer.pt", "plain.pt")
    )
    assert ours["param_groups"] == theirs["param_groups"]
    for key, state in theirs["state"].items():
        for name, value in state.items():
            assert torch.equal(ours["state"][key][name], value), (key, name)


def test_a_filesystem_that_refuses_direct_io_gets_a_buffered_file(tmp_path: Path, monkeypatch):
    """Refused at open (EINVAL, as tmpfs did before Linux 6.6) or only at the first write
    (as some network filesystems do): the file is written buffered, whole."""
    if not direct_io_here(tmp_path):
        pytest.skip("this filesystem takes no O_DIRECT")
    real_open, real_write = os.open, os.write
    refused: list[str] = []

    def open_refusing(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            refused.append("open")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(direct_io.os, "open", open_refusing)
    save_tensors(mixed_tensors(), tmp_path / "a.safetensors")
    monkeypatch.setattr(direct_io.os, "open", real_open)

    def write_refusing(fd, data):
        if not refused.count("write"):
            refused.append("write")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct_io.os, "write", write_refusing)
    with DirectFile(tmp_path / "b.bin") as f:
        f.write(b"x" * (9 << 20))  # past the buffer: a full block goes out mid-write
        f.write(b"tail")
        assert not f.direct  # it fell back, and says so
    assert refused == ["open", "write"]
    assert (tmp_path / "b.bin").read_bytes() == b"x" * (9 << 20) + b"tail"
    expected = mixed_tensors()
    for name, tensor in load_file(tmp_path / "a.safetensors").items():
        assert same(tensor, expected[name]), name


def test_a_full_disk_raises_its_own_error_and_closes_the_file_once(tmp_path: Path, monkeypatch):
    """ENOSPC mid-write is the error the caller sees (not a BufferError of the staging
    buffer), the descriptor is closed, and a second close does nothing."""
    real_write, real_close = os.write, os.close
    closed: list[int] = []

    def write_full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close_counting(fd):
        closed.append(fd)
        return real_close(fd)

    monkeypatch.setattr(direct_io.os, "close", close_counting)
    f = DirectFile(tmp_path / "full.bin")
    monkeypatch.setattr(direct_io.os, "write", write_full)
    with pytest.raises(OSError) as caught, f:
        f.write(b"x" * (9 << 20))
    assert caught.value.errno == errno.ENOSPC
    assert f.closed and len(closed) == 1
    f.close()
    monkeypatch.setattr(direct_io.os, "write", real_write)
    assert len(closed) == 1
