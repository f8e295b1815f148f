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
    gen = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(3_000_001, generator=gen),  # 12 MB: crosses the 8 MB buffer
        "half.odd": torch.randn(7, 3, generator=gen).to(torch.bfloat16),  # 42 bytes
        "ids": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(6, 4, generator=gen).t(),  # not contiguous
        "bytes": torch.arange(3, dtype=torch.uint8),
    }


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_safetensors_written_direct_are_safetensors_own_file(tmp_path: Path, direct: bool):
    tensors = mixed_tensors()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    save_tensors(tensors, ours, metadata={"format": "pt"}, direct=direct)
    save_file({k: v.contiguous() for k, v in tensors.items()}, theirs, metadata={"format": "pt"})
    loaded = load_file(ours)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(ours, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # The same layout as safetensors' writer: not a byte more (the padded last block is
    # truncated away), and every tensor at the offset safetensors gives it.
    assert ours.stat().st_size == theirs.stat().st_size
    assert ours.read_bytes() == theirs.read_bytes()


def test_torch_save_through_a_direct_file_loads_as_torch_save(tmp_path: Path):
    model = torch.nn.Linear(300, 200)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 300)).sum().backward()
    opt.step()
    save_object(opt.state_dict(), tmp_path / "optimizer.pt")
    torch.save(opt.state_dict(), tmp_path / "plain.pt")
    ours, theirs = (
        torch.load(tmp_path / name, weights_only=True) for name in ("optimizer.pt", "plain.pt")
    )
    assert ours["param_groups"] == theirs["param_groups"]
    for key, state in theirs["state"].items():
        for name, value in state.items():
            assert torch.equal(ours["state"][key][name], value), (key, name)


def test_a_filesystem_that_refuses_direct_io_gets_a_buffered_file(tmp_path: Path, monkeypatch):
    """Refused at open (EINVAL, as tmpfs did before Linux 6.6) or only at the first write
    (as some network filesystems do): the file is written buffered, whole."""
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this OS")
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
        tried_direct = f.direct
    assert refused == ["open", "write"]
    assert not tried_direct  # it fell back, and said so
    assert (tmp_path / "b.bin").read_bytes() == b"x" * (9 << 20) + b"tail"
    expected = mixed_tensors()
    for name, tensor in load_file(tmp_path / "a.safetensors").items():
        assert torch.equal(tensor, expected[name]), name


def test_a_dtype_safetensors_cannot_store_is_refused_by_name(tmp_path: Path):
    with pytest.raises(ValueError, match=r"'z'.*complex"):
        save_tensors({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "z.safetensors")
