"""One GRPO step on the real model, SmolLM2-135M-Instruct, against TRL's: time, tokens/s,
model FLOPs utilisation and peak RSS.

Each variant runs in a fresh process (peak RSS is that process's ``ru_maxrss``), one
after the other, on the same batch: ``--groups`` groups of 8 samples, in micro-batches
of ``--budget`` tokens (default 4,096). ``--lengths equal`` gives every sample
``--prompt`` prompt and ``--response`` response tokens; ``--lengths varied`` (the
default) draws prompts of 0.6-1.4 x ``--prompt`` tokens and lognormal responses of median
``--response`` tokens cut at 3 x that, as a rollout batch has. Variants:

- ``packed``: asyncrl's defaults: decoupled PPO, one forward and backward per
  micro-batch (a step is one optimizer update, so the proximal log-probs are that
  forward's own, detached: no separate pass), a group's prompt packed once with each
  response attending to it, chunked log-probs;
- ``whole``: ``packed`` with every sample packed whole (``share_prompts=False``), each
  sequence attending alone (the trainer before prompts were shared);
- ``compiled``: ``packed`` with ``trainer.compile`` (the MLPs and norms under
  ``torch.compile``; its first step pays the compile, tokens/s is read at the fastest);
- ``bypass``: the same with ``--use-rollout-logprobs`` (the engine's log-probs are the
  old policy's; the same compute);
- ``masked``: ``packed`` with sdpa and a block-diagonal ``L x L`` mask (the attention
  the trainer used before ``packed_attention``);
- ``padded``: ``packed``'s step on micro-batches right-padded to their longest sequence
  (``packing=False``), one batched attention call per layer;
- ``trl-onpolicy``: TRL's ``GRPOTrainer`` on the same samples as padded tensors (left-padded
  prompts, right-padded completions, as its ``_generate_and_score_completions`` builds
  them), cut into per-device batches of ``--trl-micro`` rows (default 8, as a TRL user
  fits a 24 GB machine; 32 rows at once peaked at 23 GB) with gradients accumulated over
  them: its ``compute_loss`` (``loss_type="dapo"``: token-mean, as asyncrl's default),
  backward, grad clip 1.0 and AdamW. With one update per generated batch TRL skips the
  old-log-prob pass, as asyncrl does: the same compute as ``packed``;
- ``trl``: the same plus the no-grad old-log-prob pass TRL runs whenever a generated
  batch may be off-policy (several updates per generation, or vLLM's importance-sampling
  correction);
- ``--repo DIR`` runs ``masked`` against another checkout (a before/after:
  ``git worktree add /tmp/before COMMIT``).

tokens/s counts every sample's prompt and response tokens, the work both frameworks
train on. Model FLOPs utilisation counts the tokens run through the model: a shared
prompt once (``packed``), padding not at all. It is ``6 x parameters x`` those a second
over the matmul peak, measured
in the same run in its own process: the best of five ``torch.mm`` of 2048 x 2048 on
``--threads`` threads, fp32 and bf16, before and after the variants (the higher of the
two: a slow spell of this shared machine would otherwise read as high utilisation).
``trl`` does ``8 x parameters`` FLOPs a token (2 more for the no-grad forward); MFU
counts only the 6, as is usual, so TRL's extra pass shows as lost utilisation.
``--dtype bf16-mixed`` runs both frameworks with fp32 master weights and bf16 autocast
(TRL: ``bf16=True``); MFU is then read against the bf16 peak.

    .venv/bin/python bench/real_trainer.py [--steps 3] [--budget 1024] [--dtype bf16-mixed]

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
ASYNCRL = ("packed", "whole", "compiled", "bypass", "masked", "padded")
TRL = ("trl", "trl-onpolicy")


def lengths(seed: int, args: argparse.Namespace) -> list[tuple[int, int]]:
    """(prompt, response) token counts of the batch's ``8 x groups`` samples."""
    import numpy as np

    n = 8 * args.groups
    if args.lengths == "equal":
        return [(args.prompt, args.response)] * n
    rng = np.random.default_rng(1000 + seed)
    prompts = rng.integers(int(0.6 * args.prompt), int(1.4 * args.prompt) + 1, args.groups)
    responses = np.clip(rng.lognormal(np.log(args.response), 0.6, n), 4, 3 * args.response)
    return [(int(prompts[i // 8]), int(r)) for i, r in enumerate(responses)]


def batch(seed: int, args: argparse.Namespace) -> Any:
    """Random token ids (the step's cost does not depend on them), rewards that vary."""
    import numpy as np

    from asyncrl.types import Group, Sample, SampleStatus, TrainBatch

    rng = np.random.default_rng(seed)
    sizes, out = lengths(seed, args), []
    for g in range(args.groups):
        ids = rng.integers(3, 49_000, sizes[8 * g][0]).astype(np.int32)
        samples = []
        for i in range(8):
            response = sizes[8 * g + i][1]
            s = Sample(uid=f"{g}/{i}", group_id=str(g), index=i, packed_prompt=ids.tobytes())
            s.append_response(rng.integers(3, 49_000, response), rng.normal(-3, 0.5, response), 0)
            s.reward, s.status = float(i % 2), SampleStatus.COMPLETED
            s.temperature = 0.7
            samples.append(s)
        out.append(Group(uid=str(g), prompt_uid=str(g), samples=samples))
    return TrainBatch(batch_id=seed, step=0, groups=out)


def asyncrl_steps(args: argparse.Namespace) -> tuple[list[float], float, float]:
    """Step seconds, trained tokens (prompt + response) and the tokens run through the
    model (a shared prompt once) of asyncrl's TorchTrainer."""
    from asyncrl.policies import PolicyConfig
    from asyncrl.trainers.rollout_tensors import rollout_tensors
    from asyncrl.trainers.torch_trainer import TorchTrainer
    from bench.torch_profile import profiled

    extra: dict[str, Any] = {"attn_implementation": "sdpa"} if args.variant == "masked" else {}
    if args.variant == "padded":  # each micro-batch right-padded to its longest sequence
        extra["packing"] = False
    if args.variant == "whole":
        extra["share_prompts"] = False
    if args.variant == "compiled":
        extra["compile"] = True
    cfg = TorchTrainer.Config(
        model_path=args.model, lr=1e-6, max_tokens_per_microbatch=args.budget,
        dtype=args.dtype, device=args.device, **extra,
    )  # fmt: skip
    policy = PolicyConfig(use_rollout_logprobs=True) if args.variant == "bypass" else PolicyConfig()
    trainer = TorchTrainer(cfg, policy)
    times, tokens = [], 0.0
    for k in range(args.steps):
        start = time.perf_counter()
        with profiled(f"{args.variant} step", enabled=args.profile and k == args.steps - 1):
            result = trainer.train_step(batch(k, args))
            sync(args.device)
        times.append(time.perf_counter() - start)
        tokens = result.metrics["tokens"]
    rows = rollout_tensors(batch(args.steps - 1, args), cfg.reward_key)
    model_tokens = tokens
    if cfg.packing:  # a padded micro-batch's padding is not counted
        model_tokens = sum(mb.input_ids.shape[1] for mb in trainer._microbatches(rows))
    return times, tokens, model_tokens


def trl_inputs(train_batch: Any) -> dict[str, Any]:
    """The batch as TRL's GRPOTrainer holds a generation batch: padded id/mask tensors."""
    import torch

    samples = [s for g in train_batch.groups for s in g.samples]
    prompts = [torch.tensor(s.prompt_tokens, dtype=torch.long) for s in samples]
    replies = [torch.tensor(s.response_tokens, dtype=torch.long) for s in samples]
    p_len, c_len = max(len(p) for p in prompts), max(len(c) for c in replies)
    prompt_ids = torch.zeros(len(samples), p_len, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.zeros(len(samples), c_len, dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for i, (p, c) in enumerate(zip(prompts, replies, strict=True)):
        prompt_ids[i, p_len - len(p) :], prompt_mask[i, p_len - len(p) :] = p, 1  # left pad
        completion_ids[i, : len(c)], completion_mask[i, : len(c)] = c, 1
    rewards = torch.tensor([s.reward for s in samples]).view(-1, 8)
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "completion_ids": completion_ids, "completion_mask": completion_mask,
            "advantages": advantages.view(-1),
            "num_items_in_batch": completion_mask.sum()}  # fmt: skip


def trl_split(inputs: dict[str, Any], chunks: int) -> list[dict[str, Any]]:
    """Per-device batches as TRL cuts them: rows split evenly, each trimmed to its own
    longest prompt (left-padded) and completion (right-padded)."""
    rows = inputs["prompt_ids"].size(0) // chunks
    parts = []
    for c in range(chunks):
        part = {k: v[c * rows : (c + 1) * rows] for k, v in inputs.items() if v.dim() > 0}
        p_keep = int(part["prompt_mask"].sum(1).max())
        c_keep = int(part["completion_mask"].sum(1).max())
        for key in ("prompt_ids", "prompt_mask"):
            part[key] = part[key][:, -p_keep:]
        for key in ("completion_ids", "completion_mask"):
            part[key] = part[key][:, :c_keep]
        parts.append(part | {"num_items_in_batch": inputs["num_items_in_batch"]})
    return parts


def trl_steps(args: argparse.Namespace) -> tuple[list[float], float]:
    """Step seconds and trained tokens (prompt + response, unpadded) of TRL's GRPO step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from bench.torch_profile import profiled

    n = 8 * args.groups
    config = GRPOConfig(
        output_dir="/tmp/asyncrl-bench-trl", use_cpu=args.device == "cpu", seed=0,
        bf16=args.dtype == "bf16-mixed", fp16=False,
        per_device_train_batch_size=args.trl_micro, num_generations=8,
        gradient_accumulation_steps=max(1, n // args.trl_micro),
        max_completion_length=3 * args.response, learning_rate=1e-6, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, loss_type="dapo", gradient_checkpointing=False,
        use_vllm=False, report_to="none", disable_tqdm=True, logging_steps=1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device)
    trainer = GRPOTrainer(
        model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config, train_dataset=Dataset.from_dict({"prompt": ["x"] * n}),
        processing_class=AutoTokenizer.from_pretrained(args.model),
    )  # fmt: skip
    chunks = max(1, n // args.trl_micro)
    # TRL splits a generation batch into per-device batches and accumulates: the dapo
    # normalizer is then num_items_in_batch x accumulation / steps_per_generation.
    trainer.current_gradient_accumulation_steps = chunks
    trainer.args.steps_per_generation = chunks
    trainer.create_optimizer()
    model = trainer.model
    model.train()
    times, tokens = [], 0.0
    for k in range(args.steps):
        inputs = {key: t.to(args.device) for key, t in trl_inputs(batch(k, args)).items()}
        sync(args.device)
        start = time.perf_counter()
        with profiled(f"{args.variant} step", enabled=args.profile and k == args.steps - 1):
            for part in trl_split(inputs, chunks):
                if args.variant == "trl":  # the pass _generate_and_score_completions makes
                    ids = torch.cat([part["prompt_ids"], part["completion_ids"]], 1)
                    mask = torch.cat([part["prompt_mask"], part["completion_mask"]], 1)
                    with torch.no_grad():
                        part["old_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                            model, ids, mask, part["completion_ids"].size(1), batch_size=n
                        )[0]
                trainer.compute_loss(model, part).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()
            sync(args.device)
        times.append(time.perf_counter() - start)
        tokens = float(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
    return times, tokens


def sync(device: str) -> None:
    """Wait for the GPU's queued work, so a host clock read after it times the work."""
    if device.startswith("cuda"):
        __import__("torch").cuda.synchronize()


def matmul_peak(threads: int, device: str) -> dict[str, float]:
    """GFLOP/s of the best of five square ``torch.mm`` per dtype (``bench/engine.py``'s)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from bench.engine import matmul_peak as peak

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return {name: peak(threads, dtype, device) for name, dtype in dtypes.items()}


def child(args: argparse.Namespace) -> None:
    """Run one variant in this process and print one JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    if args.variant == "peak":
        print(json.dumps({"variant": "peak", "gflops": matmul_peak(args.threads, args.device)}))
        return
    if args.variant in TRL:
        times, tokens = trl_steps(args)
        model_tokens = tokens
    else:
        times, tokens, model_tokens = asyncrl_steps(args)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    row = {"variant": args.variant, "step_s": times, "tokens": tokens,
           "tokens_per_s": tokens / min(times), "model_tokens": model_tokens,
           "model_tokens_per_s": model_tokens / min(times), "peak_rss_gib": rss}  # fmt: skip
    if args.device.startswith("cuda"):
        row["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(row))


def run(variant: str, repo: Path, args: argparse.Namespace) -> dict:
    sizes = {"--steps": args.steps, "--budget": args.budget, "--groups": args.groups,
             "--prompt": args.prompt, "--response": args.response,
             "--threads": args.threads, "--lengths": args.lengths,
             "--dtype": args.dtype, "--trl-micro": args.trl_micro,
             "--device": args.device}  # fmt: skip
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--model", args.model]
    cmd += ["--profile"] if args.profile else []
    cmd += [str(x) for kv in sizes.items() for x in kv]
    # The checkout first; what the caller's path held (packages installed aside) after it.
    path = os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"variant {variant} failed:\n{out.stderr[-3000:]}")
    if args.profile and "== " in out.stderr:  # the child's profiler tables
        print(out.stderr[out.stderr.index("== ") :], file=sys.stderr, flush=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["repo"] = str(repo)
    return row


def parameters(model: str) -> int:
    """The model's parameter count, from its config (no weights loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with __import__("torch").device("meta"):
        net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return sum(p.numel() for p in net.parameters())


def report(rows: list[dict], peak: dict[str, float], n_params: int, dtype: str) -> None:
    """Print the table and the asyncrl / TRL ratios of the pairs doing the same work."""
    dtype = "bf16" if dtype == "bf16-mixed" else "fp32"
    print(f"matmul peak on this run: fp32 {peak['fp32']:.0f} GFLOP/s, bf16 {peak['bf16']:.0f}")
    print(f"{'variant':13} {'step s':>14} {'tokens/s':>9} {'MFU ' + dtype:>9} {'peak RSS GiB':>13}")
    for r in rows:
        r["mfu"] = 6 * n_params * r["model_tokens_per_s"] / (peak[dtype] * 1e9)
        steps = ", ".join(f"{t:.1f}" for t in r["step_s"])
        gpu = f"  GPU peak {r['peak_gpu_gib']:.2f} GiB" if "peak_gpu_gib" in r else ""
        print(f"{r['variant']:13} {steps:>14} {r['tokens_per_s']:9.1f} {r['mfu']:9.1%} "
              f"{r['peak_rss_gib']:13.2f}{gpu}")  # fmt: skip
    by = {r["variant"]: r for r in rows}
    for ours, theirs in (("packed", "trl-onpolicy"), ("packed", "trl"), ("packed", "whole"),
                           ("compiled", "packed")):  # fmt: skip
        if ours in by and theirs in by:
            ratio = by[ours]["tokens_per_s"] / by[theirs]["tokens_per_s"]
            print(f"{ours} / {theirs}: {ratio:.2f}x tokens/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch")
    ap.add_argument("--groups", type=int, default=4, help="groups of 8 samples")
    ap.add_argument("--prompt", type=int, default=50)
    ap.add_argument("--response", type=int, default=70)
    ap.add_argument("--lengths", choices=("varied", "equal"), default="varied")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (both frameworks on the GPU)")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bf16-mixed"),
        default="float32",
        help="bf16-mixed: fp32 weights and AdamW state, bf16 autocast (both sides)",
    )
    ap.add_argument(
        "--trl-micro",
        type=int,
        default=8,
        help="TRL's per-device batch (rows); the step accumulates over the rest",
    )
    ap.add_argument("--variants", default="packed,whole,trl-onpolicy,trl")
    ap.add_argument("--profile", action="store_true", help="profile each variant's last step")
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
    before = run("peak", ROOT, args)["gflops"]
    rows = []
    for variant in args.variants.split(","):
        rows.append(run(variant, ROOT, args))
        print(json.dumps(rows[-1]), flush=True)  # kept in the log if a later one fails
    after = run("peak", ROOT, args)["gflops"]
    peak = {k: max(before[k], after[k]) for k in before}
    if args.repo is not None:
        rows.append(run("masked", args.repo.resolve(), args) | {"variant": "before"})
    n_params = parameters(args.model)
    report(rows, peak, n_params, args.dtype)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args) | {"repo": str(args.repo)},
                                          "peak_gflops": peak, "parameters": n_params,
                                          "rows": rows}, indent=2, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
