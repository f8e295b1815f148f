"""The embedded engine against HF ``generate`` and vLLM's CPU build, one run, side by side.

    python bench/engine.py [--model toy|DIR] [--requests 64] [--batch 64] [--median 32]
                           [--tail 9.5] [--uniform 64] [--threads 2]
                           [--vllm-python .venv-vllm/bin/python] [--out FILE]

``--model toy`` is a random-init Qwen2 of about 30M parameters (hidden 512, 8 layers,
vocab 512); a folder is any HF causal LM (``make bench-engine`` uses SmolLM2-135M-Instruct),
fp32 on CPU. Two workloads of ``--requests`` prompts of 16-64 random token ids:

- **long-tail**: response lengths lognormal with median ``--median`` and p99 about
  ``--tail`` times the median at evenly spaced quantiles (p99/p50 = 8.3 at the defaults;
  the run refuses one under 8);
- **uniform**: every response ``--uniform`` tokens, so ``--batch`` sequences stay running:
  decode at a full batch, measured against the machine's own limit.

EOS is ignored, so each request generates exactly its length; temperature 1; the sampled
token's log-prob is returned by every system (HF: ``output_logits``, then log-softmax).

- **engine**: every request submitted at once to ``TorchEngine`` (``--batch`` running at
  most; continuous batching);
- **unpacked**: the same without its oneDNN-packed CPU weights (``packed=False``,
  ``engines/torch/cpu_linear.py``): what the packing buys, in the same run;
- **hf-forward**: the same through transformers' forward, not the engine's own
  (``lean=False``, ``engines/torch/lean_forward.py``);
- **eager** (CUDA only): the same without the static KV pool and CUDA graphs
  (``cuda_graph=False``, ``engines/torch/graph_decode.py``): what the graphs buy;
- **hf**: ``model.generate`` in static batches of ``--batch`` requests in arrival order,
  left-padded, each batch run to its longest request;
- **vllm**: vLLM's offline ``LLM.generate`` with every request at once, ``max_num_seqs``
  = ``--batch``, eager, both cores (``bench/vllm_worker.py`` in vLLM's venv; skipped
  with a note when ``--vllm-python`` is missing: ``make vllm-venv`` builds it);
- **vllm-server**: the same vLLM as asyncrl's ``vllm`` engine type runs it, its OpenAI
  server started with asyncrl's arguments (``engines/vllm/launch.py``), every request
  at once through ``VLLMEngine`` (one HTTP call each to ``/inference/v1/generate``):
  what a rollout actor gets from vLLM, HTTP and vLLM's API server included.

Each system runs in a process of its own (``run_isolated``: in one process, what ran
before slowed what came after) and first runs the workload's first 8 requests once (a
warm-up: vLLM's first call is slow, and a first large forward page-faults its
activations in). Rate = completed
(requested) tokens / wall seconds of the timed run. **Peak**: the best of five fp32
``torch.mm`` of 2048x2048 on the same threads, measured in the same run; the engine's
share of it is ``2 * params * tokens/s / peak`` (the weights' FLOPs per token, attention
left out). Targets: engine >= 2x hf and >= 1.0x vllm on the long tail, >= 50% of the peak
on the uniform workload. Writes JSON (default ``bench/results/engine.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import NormalDist
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from asyncrl.engines.base import GenerateRequest, SamplingParams
from asyncrl.engines.torch.engine import TorchEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, too
from bench.torch_profile import profiled

Work = list[tuple[list[int], int]]


def build_model(name: str, device: str, dtype_name: str = "auto") -> torch.nn.Module:
    """The random 30M toy, or an HF folder's model; ``auto``: fp32 on CPU, bf16 on CUDA."""
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.startswith("cuda") else "float32"
    dtype = getattr(torch, dtype_name)
    if name != "toy":
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device).eval()
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=512, max_position_embeddings=4096,
        tie_word_embeddings=True, initializer_range=0.2,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg).to(device, dtype).eval()


def workload(n: int, lengths: np.ndarray, vocab: int, seed: int = 0) -> Work:
    """``n`` prompts of 16-64 random ids in ``[4, vocab - 4)`` with the given lengths."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, vocab - 4, rng.integers(16, 65)).tolist() for _ in range(n)]
    return list(zip(prompts, lengths.tolist(), strict=True))


def long_tail(n: int, median: int, tail: float, seed: int = 0) -> np.ndarray:
    """``n`` lognormal lengths at evenly spaced quantiles (no sampling noise in the
    shape), shuffled; sigma chosen so that p99 / median = ``tail``."""
    sigma = np.log(tail) / 2.326  # z of the 99th percentile
    z = np.array([NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])
    lengths = np.maximum(np.exp(np.log(median) + sigma * z), 1).astype(int)
    return np.random.default_rng(seed).permutation(lengths)


#: Every system first runs the workload's first requests once (vLLM's first call is
#: slow; the engine's and HF's first large forward page-faults its activations in).
WARM_UP = 8


#: The engine's variants beside it: what its CPU weight packing, its own forward and (on
#: CUDA) its graph-captured static decode buy.
VARIANTS: dict[str, dict[str, bool]] = {
    "engine": {}, "unpacked": {"packed": False}, "hf-forward": {"lean": False},
    "eager": {"cuda_graph": False},
}  # fmt: skip


async def all_at_once(engine: Any, work: Work, tag: str, *, seeded: bool = True) -> int:
    """Submit every request of ``work`` at once to ``engine``; the tokens it made (each
    request's length, checked with its log-probs). ``seeded``: request ``i`` samples
    with seed ``i``."""

    async def one(i: int, ids: list[int], n: int) -> int:
        params = SamplingParams(max_new_tokens=n, ignore_eos=True,
                                sampling_seed=i if seeded else None)  # fmt: skip
        request = GenerateRequest(rid=f"{tag}{i}", input_ids=ids, sampling=params)
        outputs = [out async for out in engine.generate(request)]
        assert len(outputs[-1].output_ids) == len(outputs[-1].logprobs) == n
        return n

    return sum(await asyncio.gather(*(one(i, ids, n) for i, (ids, n) in enumerate(work))))


async def run_engine(model: torch.nn.Module, work: Work, batch: int, **variant: bool) -> float:
    """Tokens/s of every request submitted at once to a fresh ``TorchEngine``."""
    engine = TorchEngine(model, max_running=batch, **variant)
    async with asyncio.TaskGroup() as tg:
        runner = tg.create_task(engine.run())
        await all_at_once(engine, work[:WARM_UP], "warm-up")
        start = time.perf_counter()
        tokens = await all_at_once(engine, work, "r")
        elapsed = time.perf_counter() - start
        runner.cancel()
    return tokens / elapsed


def run_hf(model: torch.nn.Module, work: Work, batch: int) -> float:
    """Tokens/s of ``generate`` in static batches, with each sampled token's log-prob."""
    hf_batches(model, work[:WARM_UP], batch)
    start = time.perf_counter()
    tokens = hf_batches(model, work, batch)
    return tokens / (time.perf_counter() - start)


def hf_batches(model: torch.nn.Module, work: Work, batch: int) -> int:
    """``generate`` over ``work`` in static batches; the requested tokens it completed."""
    device = next(model.parameters()).device
    tokens = 0
    for lo in range(0, len(work), batch):
        chunk = work[lo : lo + batch]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(chunk):
            ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
        longest = max(n for _, n in chunk)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=longest,
                min_new_tokens=longest, pad_token_id=0, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
            sampled = out.sequences[:, width:]
            logits = torch.stack(out.logits, 1).float()
            logprobs = torch.log_softmax(logits, -1).gather(-1, sampled[..., None])
            assert logprobs.shape[:2] == (len(chunk), longest)
        tokens += sum(n for _, n in chunk)  # only requested tokens count as completed
    return tokens


def run_vllm(
    python: str, model: str, works: dict[str, Work], batch: int, threads: int,
    dtype: str = "float32",
) -> dict | None:  # fmt: skip
    """vLLM's tokens/s per workload from its own venv, or None when it is not built."""
    if model == "toy":
        print("vllm: skipped (the toy model has no folder; pass --model DIR)")
        return None
    if not python or not Path(python).exists():
        print(f"vllm: skipped ({python or 'no --vllm-python'} missing; make vllm-venv)")
        return None
    longest = max(len(ids) + n for work in works.values() for ids, n in work)
    spec = {"model": str(Path(model).resolve()), "max_running": batch, "dtype": dtype,
            "max_model_len": longest + 8, "workloads": works}  # fmt: skip
    env = {**os.environ, **_vllm_cpu_env(threads)}
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, out_file = Path(tmp, "work.json"), Path(tmp, "out.json")
        spec_file.write_text(json.dumps(spec))
        worker = Path(__file__).with_name("vllm_worker.py")
        command = [str(Path(python).absolute()), str(worker), str(spec_file), str(out_file)]
        proc = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"vllm worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(out_file.read_text())


def run_vllm_server(
    python: str, model: str, works: dict[str, Work], batch: int, threads: int,
    dtype: str = "float32",
) -> dict[str, float]:  # fmt: skip
    """vLLM's server as the ``vllm`` engine type drives it: tokens/s per workload."""
    from asyncrl.engines.vllm.launch import vllm_command, vllm_env

    longest = max(len(ids) + n for work in works.values() for ids, n in work)
    extra = ["--max-num-seqs", str(batch), "--max-model-len", str(longest + 8), "--enforce-eager"]
    port = _free_port()
    env = vllm_env() | _vllm_cpu_env(threads)
    command = vllm_command(python, str(Path(model).resolve()), "127.0.0.1", port, dtype=dtype,
                           seed="0", extra=extra)  # fmt: skip
    with open(os.environ.get("VLLM_SERVER_LOG", os.devnull), "w+") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
        try:
            return asyncio.run(_through_vllm_engine(f"http://127.0.0.1:{port}", server, works))
        finally:
            stop_group(server)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM ``proc``'s process group, then SIGKILL what is left: vLLM's engine core
    outlived a SIGTERMed API server once (found as an orphan after this bench)."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            continue
        time.sleep(1.0)  # the group's other members end after their leader


async def _through_vllm_engine(
    url: str, server: subprocess.Popen, works: dict[str, Work]
) -> dict[str, float]:
    import aiohttp

    from asyncrl.engines.vllm.engine import VLLMEngine

    async with aiohttp.ClientSession() as http, asyncio.timeout(600):
        while server.poll() is None:
            try:
                async with http.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1)
    if server.poll() is not None:
        raise RuntimeError(f"the vllm server exited with {server.returncode}")
    engine = await VLLMEngine(url).start()
    rates = {}
    try:  # no per-request seeds: VLLMEngine refuses them on the CPU (a vLLM crash)
        for name, work in works.items():
            await all_at_once(engine, work[:WARM_UP], f"{name}-warm-up", seeded=False)
            start = time.perf_counter()
            tokens = await all_at_once(engine, work, name, seeded=False)
            rates[name] = tokens / (time.perf_counter() - start)
    finally:
        await engine.close()
    return rates


def _vllm_cpu_env(threads: int) -> dict[str, str]:
    """vLLM binds one core and reserves the other by default; give it the same threads."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CACHE_ROOT": str(Path(tempfile.gettempdir(), "asyncrl-vllm-cache")),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def matmul_peak(threads: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> float:
    """GFLOP/s of the best of five square ``torch.mm`` in ``dtype``: 2048 on ``threads``
    CPU threads, 8192 on a GPU (a size that fills the chip), after a warm-up."""
    torch.set_num_threads(threads)
    n = 8192 if device.startswith("cuda") else 2048
    a = torch.randn(n, n, dtype=dtype, device=device)  # random data: zeros run faster
    b = torch.randn(n, n, dtype=dtype, device=device)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b), device) for _ in range(5))
    return 2 * n**3 / best / 1e9


def _timed(fn, device: str = "cpu") -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="toy")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--median", type=int, default=32)
    ap.add_argument("--tail", type=float, default=9.5)
    ap.add_argument("--uniform", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="every system's weights and the peak's matmul (auto: fp32 on CPU)",
    )
    ap.add_argument("--vllm-python", default="")
    ap.add_argument(
        "--skip", nargs="*", default=[], choices=[*VARIANTS, "hf", "vllm", "vllm-server"]
    )
    ap.add_argument("--profile", action="store_true", help="profile the engine's uniform run")
    ap.add_argument("--out", default="bench/results/engine.json")
    ap.add_argument("--system", help=argparse.SUPPRESS)  # run_isolated's child
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.model, args.device, args.dtype)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    lengths = long_tail(args.requests, args.median, args.tail)
    p50, p99 = np.percentile(lengths, 50), np.percentile(lengths, 99)
    if p99 < 8 * p50:
        raise SystemExit(f"workload tail p99/p50 = {p99 / p50:.1f} < 8: raise --tail")
    works = {
        "long-tail": workload(args.requests, lengths, vocab),
        "uniform": workload(args.requests, np.full(args.requests, args.uniform), vocab, seed=1),
    }
    params = sum(p.numel() for p in model.parameters())
    if args.system:  # a child: one system's rates, in a process of its own
        Path(args.out).write_text(json.dumps(run_system(args, args.system, model, works)))
        return
    peak = matmul_peak(args.threads, next(model.parameters()).dtype, args.device)
    del model  # each system runs in a process of its own (``run_isolated``)
    rates: dict[str, dict[str, float]] = {name: {} for name in works}
    for system in [*VARIANTS, "hf"]:
        cpu_only, cuda_only = system == "unpacked", system == "eager"
        if (
            system in args.skip
            or (cpu_only and args.device != "cpu")
            or (cuda_only and args.device != "cuda")
        ):
            continue
        for name, rate in run_isolated(system).items():
            rates[name][system] = rate
            print(f"{name} {system}: {rate:.1f} tokens/s", flush=True)
    vllm = None
    if "vllm" not in args.skip:
        dtype = {"auto": "float32"}.get(args.dtype, args.dtype)
        vllm = run_vllm(args.vllm_python, args.model, works, args.batch, args.threads, dtype)
    if vllm:
        for name in works:
            rates[name]["vllm"] = vllm["workloads"][name]["tokens_per_s"]
    if vllm and "vllm-server" not in args.skip:
        dtype = {"auto": "float32"}.get(args.dtype, args.dtype)
        served = run_vllm_server(args.vllm_python, args.model, works, args.batch, args.threads,
                                 dtype)  # fmt: skip
        for name, rate in served.items():
            rates[name]["vllm-server"] = rate
            print(f"{name} vllm-server: {rate:.1f} tokens/s", flush=True)
    report(args, params, peak, rates, works, p50, p99, vllm)


def run_isolated(system: str) -> dict[str, float]:
    """``system``'s tokens/s per workload, measured by this script in a fresh process.

    In one process, whatever ran before slowed what came after: the engine's uniform
    run decoded in 12.6 s after an HF ``generate`` of the same work, 9.8 s without, and
    11.4 s after merely allocating and freeing the 0.8 GB of logits ``generate`` keeps
    (the allocator's state, not the CPU's: a fixed mmap threshold did not help)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "rates.json")
        command = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--system", system,
                   "--out", str(out)]  # fmt: skip
        subprocess.run(command, check=True)
        return json.loads(out.read_text())


def run_system(
    args: argparse.Namespace, system: str, model: torch.nn.Module, works: dict[str, Work]
) -> dict[str, float]:
    """Tokens/s of ``system`` (an engine variant, or ``hf``) on each workload, in order."""
    rates = {}
    for name, work in works.items():
        if system == "hf":
            rates[name] = run_hf(model, work, args.batch)
            continue
        profile = args.profile and name == "uniform" and system == "engine"
        with profiled(f"engine, {name}", enabled=profile):
            rates[name] = asyncio.run(run_engine(model, work, args.batch, **VARIANTS[system]))
    return rates


def report(args, params, peak, rates, works, p50, p99, vllm) -> None:
    print(f"model {args.model} ({params / 1e6:.1f}M params) on {args.device}, {args.threads} "
          f"threads; {args.requests} requests, batch {args.batch}; long tail p50 {p50:.0f} "
          f"p99 {p99:.0f} ({p99 / p50:.1f}x); matmul peak {peak:.0f} GFLOP/s")  # fmt: skip
    print(f"{'workload':<11}{'system':<12}{'tokens':>8}{'tokens/s':>10}{'% peak':>8}")
    for name, per in rates.items():
        tokens = sum(n for _, n in works[name])
        for system, rate in per.items():
            share = 2 * params * rate / (peak * 1e9)
            print(f"{name:<11}{system:<12}{tokens:>8}{rate:>10.1f}{share:>8.1%}")
    ratios = {}
    for name, per in rates.items():
        for base in ("hf", "vllm", "vllm-server", "unpacked", "hf-forward", "eager"):
            if "engine" in per and base in per:
                ratios[f"{name}/engine_over_{base}"] = per["engine"] / per[base]
        if "vllm" in per and "vllm-server" in per:  # what the server and HTTP cost vLLM
            ratios[f"{name}/vllm-server_over_vllm"] = per["vllm-server"] / per["vllm"]
    for key, value in ratios.items():
        print(f"{key:<36}{value:>6.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "bench": "engine", "model": args.model, "device": args.device, "params": params,
        "threads": args.threads, "requests": args.requests, "batch": args.batch,
        "p50": p50, "p99": p99, "matmul_peak_gflops": peak, "tokens_per_s": rates,
        "share_of_peak": {n: {s: 2 * params * r / (peak * 1e9) for s, r in per.items()}
                          for n, per in rates.items()},
        "ratios": ratios, "vllm_startup_s": vllm and vllm["startup_s"],
        "targets": {"long-tail/engine_over_hf": 2.0, "long-tail/engine_over_vllm": 1.0,
                    "uniform/engine_share_of_peak": 0.5},
    }  # fmt: skip
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
