"""Pack a model for the lent GPU machine, whose calls carry at most 64 MiB each, and unpack
it there.

``pack MODEL DIR --first-mb A --chunk-mb B`` writes ``DIR/meta/`` (config, tokenizer,
template) and ``DIR/part0``, ``DIR/part1``, ... (part0 of at most A MB, the rest at most B
MB): the weights, matrices of ``--min-numel`` elements or more rounded to int8 with one
absmax scale per row (``w ~= q * s``, ``s = max|w_row| / 127``: a relative RMS error near
1%, three times bf16's), the rest in bf16, lzma-compressed. ``unpack DIR MODEL`` joins the parts and
writes a bf16 ``model.safetensors`` beside the meta files. Each call carries some parts
(``.gpu/<name>/partN``) and copies them to the same folder there; the machine stays
warm 30 s between calls.
"""

from __future__ import annotations

import argparse
import lzma
import shutil
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save, save_file


def _quantize(sd: dict[str, torch.Tensor], min_numel: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        w = w.float()
        if w.dim() == 2 and w.numel() >= min_numel:
            scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12)
            out[name + ".q8"] = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
            out[name + ".scale"] = scale.squeeze(1)
        else:
            out[name] = w.to(torch.bfloat16)
    return out


def _dequantize(packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in packed.items():
        if name.endswith(".q8"):
            base = name[: -len(".q8")]
            out[base] = (t.float() * packed[base + ".scale"][:, None]).to(torch.bfloat16)
        elif not name.endswith(".scale"):
            out[name] = t
    return out


def pack(model: Path, out: Path, first_mb: float, chunk_mb: float, min_numel: int) -> None:
    meta = out / "meta"
    meta.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, meta / f.name)
    sd = load_file(model / "model.safetensors")
    blob = lzma.compress(save(_quantize(sd, min_numel)), preset=1)
    at, part = 0, 0
    while at < len(blob):
        size = int((first_mb if part == 0 else chunk_mb) * 1e6)
        (out / f"part{part}").write_bytes(blob[at : at + size])
        at, part = at + size, part + 1
    print(f"{len(blob) / 1e6:.1f} MB in {part} parts under {out}")


def unpack(src: Path, model: Path) -> None:
    parts = sorted(src.glob("part*"), key=lambda p: int(p.name[4:]))
    data = b"".join(p.read_bytes() for p in parts)
    sd = _dequantize(load(lzma.decompress(data)))
    model.mkdir(parents=True, exist_ok=True)
    for f in (src / "meta").iterdir():
        shutil.copy(f, model / f.name)
    save_file(sd, model / "model.safetensors", metadata={"format": "pt"})
    print(f"{len(parts)} parts -> {model} ({sum(t.numel() for t in sd.values()) / 1e6:.1f}M)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--first-mb", type=float, default=28)
    p.add_argument("--chunk-mb", type=float, default=46)
    p.add_argument("--min-numel", type=int, default=1 << 16, help="smaller matrices stay bf16")
    u = sub.add_parser("unpack")
    u.add_argument("src", type=Path)
    u.add_argument("model", type=Path)
    args = ap.parse_args()
    if args.cmd == "pack":
        pack(args.model, args.out, args.first_mb, args.chunk_mb, args.min_numel)
    else:
        unpack(args.src, args.model)


if __name__ == "__main__":
    main()
