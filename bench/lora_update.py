"""LoRA weight versions on the real model: merged against adapter-only, side by side.

One process, SmolLM2-135M-Instruct in fp32 on ``--threads`` threads: a ``TorchTrainer``
with LoRA adapters (``--rank``, ``--alpha``, ``--targets``; B drawn at random so the
merge does real work) and an embedded ``TorchEngine`` loaded from the same base. For each
kind of version, alternated ``--repeats`` times:

- **bytes**: what the version carries (what a pull or a disk write moves);
- **export**: the trainer's ``export_weights()`` (CPU copies; merged: every weight with
  ``W0 + (alpha / r) B A`` for the adapted ones; adapters: A, B and ``alpha / r``);
- **load**: the engine's ``update_weights_from_tensors`` (merged: a copy per weight;
  adapters: the checks, then ``W0 + (B @ A) * scaling`` per adapted linear with ``W0``
  read from the base model's safetensors), and the engine's pause in it.

Target (issue 29): the adapter-only version >= 10x smaller. Prints a table with the
ratios and writes JSON (default ``bench/results/lora_update.json``)::

    .venv/bin/python bench/lora_update.py [--rank 16] [--alpha 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--targets", default="all-linear", help="all-linear or a JSON list")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora_update.json"))
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args))
    print_table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from asyncrl.engines.torch.engine import TorchEngine
    from asyncrl.trainers.torch_trainer import TorchTrainer

    torch.set_num_threads(args.threads)
    targets = args.targets if args.targets == "all-linear" else json.loads(args.targets)
    lora = {"rank": args.rank, "alpha": args.alpha, "target_modules": targets}
    trainer = TorchTrainer(TorchTrainer.Config(model_path=args.model, lora=lora, dtype="float32"))
    adapters = trainer.policy.adapters
    assert adapters is not None
    with torch.no_grad():  # B = 0 at the start; random B makes the merge do its work
        for layer in adapters.layers().values():
            layer.lora_B["default"].weight.normal_(0.0, 1e-3)
    engine = TorchEngine.from_pretrained(args.model)
    runner = asyncio.create_task(engine.run())
    rows: dict[str, dict[str, list[float]]] = {"merged": {}, "adapters": {}}
    try:
        for _ in range(args.repeats):
            for kind in rows:
                adapters.config.publish = kind  # type: ignore[assignment]
                for key, value in (await one_update(trainer, engine)).items():
                    rows[kind].setdefault(key, []).append(value)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    summary = {kind: {k: statistics.median(v) for k, v in r.items()} for kind, r in rows.items()}
    m, a = summary["merged"], summary["adapters"]
    return {
        "model": args.model,
        "rank": args.rank,
        "alpha": args.alpha,
        "targets": targets,
        "threads": args.threads,
        "trainable_params": adapters.num_trainable(),
        "adapted_linears": len(adapters.layers()),
        "runs": rows,
        "median": summary,
        "ratios": {
            "bytes_merged_over_adapters": m["bytes"] / a["bytes"],
            "export_merged_over_adapters": m["export_s"] / a["export_s"],
            "load_merged_over_adapters": m["load_s"] / a["load_s"],
            "pause_merged_over_adapters": m["pause_s"] / a["pause_s"],
        },
    }


async def one_update(trainer: Any, engine: Any) -> dict[str, float]:
    start = time.perf_counter()
    tensors = trainer.export_weights()
    export_s = time.perf_counter() - start
    paused = engine.stats["update_pause_s"]
    start = time.perf_counter()
    await engine.update_weights_from_tensors(tensors, version=None)
    return {
        "bytes": float(sum(t.numel() * t.element_size() for t in tensors.values())),
        "tensors": float(len(tensors)),
        "export_s": export_s,
        "load_s": time.perf_counter() - start,
        "pause_s": engine.stats["update_pause_s"] - paused,
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{result['model']}: LoRA r={result['rank']} alpha={result['alpha']} "
        f"targets={result['targets']}, {result['adapted_linears']} adapted linears, "
        f"{result['trainable_params'] / 1e6:.2f}M trainable; {result['threads']} threads; "
        "medians"
    )
    print(f"{'version':10} {'MB':>9} {'tensors':>8} {'export s':>9} {'load s':>8} {'pause s':>8}")
    for kind, m in result["median"].items():
        print(f"{kind:10} {m['bytes'] / 1e6:9.1f} {m['tensors']:8.0f} {m['export_s']:9.3f} "
              f"{m['load_s']:8.3f} {m['pause_s']:8.3f}")  # fmt: skip
    for name, value in result["ratios"].items():
        print(f"{name:32} {value:6.2f}")


if __name__ == "__main__":
    sys.exit(main())
