"""Train from Python: the arith example's job, built, run and read through ``import asyncrl``.

    .venv/bin/python examples/python_api/train.py [--steps 20] [--out runs/python_api]

(from the repository root: the example's config names its data relative to it).

It builds the config from the example's YAML with a few settings changed, trains (the
same processes as ``asyncrl train``: buffer, rollout actor with the embedded engine,
trainer, eval actor), then reads the run: the trainer's metrics, the eval, and the
newest checkpoint exported as a plain Hugging Face folder, which it loads with
transformers and samples once. ``asyncrl.train_async`` does the same inside an event
loop; ``asyncrl.open_run(folder)`` reads a finished run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import asyncrl

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="runs/python_api")
    args = parser.parse_args(argv)

    test = {"name": "test", "path": "examples/arith/data/test.jsonl@[0:32]", "n_samples": 2,
            "pass_k": [1, 2]}  # fmt: skip
    cfg = asyncrl.make_config(
        ROOT / "examples/arith/config.yaml",
        {
            "name": "python_api",
            "output_dir": args.out,
            "train.num_steps": args.steps,
            "train.checkpoint_interval": args.steps,
            "rollout_batch_size": 8,  # slime's name works too: buffer.groups_per_step
            "eval.interval": args.steps,
            "eval.sets": [test],
        },
    )
    try:
        run = asyncrl.train(cfg, overwrite=True)
    except asyncrl.JobFailed as exc:
        print(f"training failed: {exc}", file=sys.stderr)
        return 1

    first, last = run.metrics[0], run.metrics[-1]
    print(f"trained {run.result.steps} steps in {run.result.seconds:.0f} s")
    print(f"reward/mean: step 1 {first['reward/mean']:.3f}, step {last['step']} "
          f"{last['reward/mean']:.3f}")  # fmt: skip
    for row in run.evals:
        print(f"eval v{row['version']}: pass@1 {row['pass@1']:.3f}, pass@2 {row['pass@2']:.3f}")
    model_dir = run.export(Path(args.out) / "exported")
    print(f"exported {model_dir} (checkpoints at steps {sorted(run.checkpoints)})")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tokenizer("12+7=", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    print(f"greedy answer to 12+7=: {tokenizer.decode(out, skip_special_tokens=True)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
