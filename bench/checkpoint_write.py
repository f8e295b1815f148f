"""A trainer checkpoint written through the page cache and past it, side by side.

The real model's checkpoint as the torch trainer writes it (``model.safetensors`` with
the HF-named weights, ``optimizer.pt`` with AdamW's state after one step), each write
followed by the fsync a checkpoint gets before it counts as durable:

- ``page cache``: ``safetensors.torch.save_file`` and ``torch.save`` to a path (the
  trainer's writes before ``trainers/direct_io.py``, and what HF's Trainer does);
- ``direct``: ``direct_io.save_tensors`` and ``save_object`` (``O_DIRECT`` where the
  filesystem takes it).

Alternated ``--repeats`` times (page cache first, then direct first, ...) into ``--dir``
(default ``runs/checkpoint_write``: the disk checkpoints go to). Every copy stays until
the end, as a job keeps its checkpoints: a buffered write into a page cache that earlier
files fill must reclaim pages first, while one that reuses pages a deleted file freed
is several times cheaper (1.8 against 6.9-13.9 s here), which a job never sees. Per
write: wall seconds and the process's CPU seconds (user + system: a buffered write's
page copies are system time the trainer would have used).

``.venv/bin/python bench/checkpoint_write.py [--repeats 3] [--dir DIR] [--out FILE]``
prints each write, the medians and direct / page-cache ratios, and writes ``--out``
(``bench/results/checkpoint_write.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.torch import save_file

from asyncrl.model_zoo import smollm2_dir
from asyncrl.trainers.direct_io import save_object, save_tensors

Writer = Callable[[dict[str, torch.Tensor], Any, Path], None]


def page_cache(weights: dict[str, torch.Tensor], optimizer: Any, out: Path) -> None:
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    torch.save(optimizer, out / "optimizer.pt")


def direct(weights: dict[str, torch.Tensor], optimizer: Any, out: Path) -> None:
    save_tensors(weights, out / "model.safetensors", metadata={"format": "pt"})
    save_object(optimizer, out / "optimizer.pt")


WRITERS: dict[str, Writer] = {"page cache": page_cache, "direct": direct}


def real_state() -> tuple[dict[str, torch.Tensor], Any]:
    """SmolLM2-135M's HF-named weights (tied head once) and AdamW's state after a step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model(torch.arange(64).unsqueeze(0), labels=torch.arange(64).unsqueeze(0)).loss.backward()
    opt.step()
    weights = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return weights, opt.state_dict()


def timed(write: Writer, weights: dict[str, torch.Tensor], optimizer: Any, out: Path) -> dict:
    out.mkdir(parents=True)
    wall, cpu = time.perf_counter(), time.process_time()
    write(weights, optimizer, out)
    written = time.perf_counter()
    for f in out.iterdir():
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    end = time.perf_counter()
    size = sum(f.stat().st_size for f in out.iterdir())
    return {
        "seconds": round(end - wall, 3),
        "write_s": round(written - wall, 3),
        "fsync_s": round(end - written, 3),
        "cpu_s": round(time.process_time() - cpu, 3),
        "bytes": size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("runs/checkpoint_write"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/checkpoint_write.json"))
    args = parser.parse_args()
    weights, optimizer = real_state()
    shutil.rmtree(args.dir, ignore_errors=True)
    runs: dict[str, list[dict]] = {name: [] for name in WRITERS}
    for rep in range(args.repeats):
        order = list(WRITERS) if rep % 2 == 0 else list(reversed(WRITERS))
        for name in order:
            out = args.dir / f"{rep}-{name.replace(' ', '_')}"
            row = timed(WRITERS[name], weights, optimizer, out)
            runs[name].append(row)
            print(f"repeat {rep} {name:>10}: {row}", flush=True)
    shutil.rmtree(args.dir)
    medians = {
        name: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        for name, rows in runs.items()
    }
    ratios = {
        key: round(medians["direct"][key] / medians["page cache"][key], 3)
        for key in ("seconds", "cpu_s")
    }
    size = medians["direct"]["bytes"] / 1e9
    print(f"checkpoint {size:.2f} GB; medians: {json.dumps(medians)}")
    print(f"direct / page cache: wall {ratios['seconds']}x, CPU {ratios['cpu_s']}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"runs": runs, "medians": medians, "ratios": ratios, "dir": str(args.dir)}
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
