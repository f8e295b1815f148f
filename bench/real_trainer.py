"""One GRPO step on the real model, SmolLM2-135M-Instruct: time, tokens/s and peak RSS.

Each variant runs in a fresh process (peak RSS is that process's ``ru_maxrss``), one
after the other, on the same batch: ``--groups`` groups of 8 samples, ``--prompt``
prompt and ``--response`` response tokens each, sampled at T 0.7, in micro-batches of
``--budget`` tokens (default 4,096: the whole batch in one packed row). Variants:

- ``packed``: the defaults (each packed sequence attends alone, chunked log-probs);
- ``masked``: the same with sdpa and a block-diagonal ``L x L`` mask (the attention
  the trainer used before ``packed_attention``);
- ``--repo DIR`` runs the ``masked`` variant against another checkout (an older commit,
  for a before/after: ``git worktree add /tmp/before COMMIT``).

    .venv/bin/python bench/real_trainer.py [--steps 2] [--budget 4096]

prints a table and writes ``bench/results/real_trainer.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def batch(seed: int, groups: int, prompt: int, response: int) -> Any:
    """Random token ids (the step's cost does not depend on them), rewards that vary."""
    import numpy as np

    from asyncrl.types import Group, Sample, SampleStatus, TrainBatch

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        ids = rng.integers(3, 49_000, prompt).astype(np.int32)
        samples = []
        for i in range(8):
            s = Sample(uid=f"{g}/{i}", group_id=str(g), index=i, packed_prompt=ids.tobytes())
            s.append_response(rng.integers(3, 49_000, response), rng.normal(-3, 0.5, response), 0)
            s.reward, s.status = float(i % 2), SampleStatus.COMPLETED
            if hasattr(s, "temperature"):  # older checkouts have no per-sample temperature
                s.temperature = 0.7
            samples.append(s)
        out.append(Group(uid=str(g), prompt_uid=str(g), samples=samples))
    return TrainBatch(batch_id=seed, step=0, groups=out)


def child(args: argparse.Namespace) -> None:
    """Run the steps of one variant in this process and print one JSON line."""
    import torch

    from asyncrl.policies import PolicyConfig
    from asyncrl.trainers.torch_trainer import TorchTrainer

    torch.set_num_threads(args.threads)
    extra = {"attn_implementation": "sdpa"} if args.variant == "masked" else {}
    cfg = TorchTrainer.Config(
        model_path=args.model, lr=1e-6, max_tokens_per_microbatch=args.budget, **extra
    )
    trainer = TorchTrainer(cfg, PolicyConfig())
    times, tokens = [], 0.0
    for k in range(args.steps):
        start = time.perf_counter()
        result = trainer.train_step(batch(k, args.groups, args.prompt, args.response))
        times.append(time.perf_counter() - start)
        tokens = result.metrics["tokens"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(json.dumps({"variant": args.variant, "step_s": times, "tokens": tokens,
                      "tokens_per_s": tokens / min(times), "peak_rss_gib": rss}))  # fmt: skip


def run(variant: str, repo: Path, args: argparse.Namespace) -> dict:
    sizes = {"--steps": args.steps, "--budget": args.budget, "--groups": args.groups,
             "--prompt": args.prompt, "--response": args.response,
             "--threads": args.threads}  # fmt: skip
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--model", args.model]
    cmd += [str(x) for kv in sizes.items() for x in kv]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["repo"] = str(repo)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch")
    ap.add_argument("--groups", type=int, default=4, help="groups of 8 samples")
    ap.add_argument("--prompt", type=int, default=50)
    ap.add_argument("--response", type=int, default=70)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="packed,masked")
    ap.add_argument("--repo", type=Path, help="also run 'masked' in this checkout (before)")
    ap.add_argument("--out", default="bench/results/real_trainer.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--model", help="model folder (default: SmolLM2, built if missing)")
    args = ap.parse_args()
    if args.model is None:
        from asyncrl.model_zoo import smollm2_dir

        args.model = str(smollm2_dir())
    if args.child:
        child(args)
        return
    rows = [run(v, ROOT, args) for v in args.variants.split(",")]
    if args.repo is not None:
        rows.append(run("masked", args.repo.resolve(), args) | {"variant": "before"})
    print(f"{'variant':10} {'step s':>16} {'tokens/s':>9} {'peak RSS GiB':>13}")
    for r in rows:
        steps = ", ".join(f"{t:.1f}" for t in r["step_s"])
        print(f"{r['variant']:10} {steps:>16} {r['tokens_per_s']:9.1f} {r['peak_rss_gib']:13.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args) | {"repo": str(args.repo)},
                                          "rows": rows}, indent=2, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
