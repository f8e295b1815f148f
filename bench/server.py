"""HTTP overhead of the SGLang-compatible server: 1-token generations per second.

    python bench/server.py [--requests 2000] [--concurrency 32] [--out FILE]

A tiny random Qwen2 (2 layers, hidden 64, vocab 512: the model costs almost nothing) is
saved to a temporary directory and served by ``asyncrl serve`` in its own process. A
client in this process sends ``--requests`` ``/generate`` calls (8 prompt ids,
``max_new_tokens = 1``, ``return_logprob``) with ``--concurrency`` in flight over one
aiohttp connection pool. Side by side, the same calls go straight to a ``TorchEngine``
in-process (no HTTP), which shows what the HTTP layer costs.

Target: >= 300 requests/s through the server. Writes JSON (default
``bench/results/server.json``).
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncrl.engines.base import GenerateRequest, SamplingParams
from asyncrl.engines.torch.engine import TorchEngine
from asyncrl.wire.sockets import free_tcp_endpoint


def save_model(directory: Path) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(directory)
    return model


def body(i: int) -> dict:
    return {
        "input_ids": [(i * 7 + k) % 500 + 1 for k in range(8)],
        "sampling_params": {"max_new_tokens": 1, "ignore_eos": True},
        "return_logprob": True,
    }


async def through_http(url: str, n: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one(i: int) -> None:
            async with sem, session.post(f"{url}/generate", json=body(i)) as resp:
                out = await resp.json()
                assert resp.status == 200 and len(out["output_ids"]) == 1, out

        await asyncio.gather(*(one(i) for i in range(64)))  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - t0)


async def in_process(model: Qwen2ForCausalLM, n: int, concurrency: int) -> float:
    engine = TorchEngine(model, max_running=64)
    task = asyncio.create_task(engine.run())
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        params = SamplingParams(max_new_tokens=1, ignore_eos=True)
        req = GenerateRequest(rid=f"r{i}", input_ids=body(i)["input_ids"], sampling=params)
        async with sem:
            outs = [o async for o in engine.generate(req)]
        assert len(outs[-1].output_ids) == 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    rate = n / (time.perf_counter() - t0)
    task.cancel()
    return rate


def serve(model_dir: Path) -> tuple[subprocess.Popen, str]:
    port = int(free_tcp_endpoint().rsplit(":", 1)[1])
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "serve", "--model", str(model_dir),
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if "ready on" in line:
            return proc, f"http://127.0.0.1:{port}"
    raise SystemExit(f"asyncrl serve exited with {proc.wait()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", default="bench/results/server.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = save_model(Path(tmp))
        proc, url = serve(Path(tmp))
        try:
            http = asyncio.run(through_http(url, args.requests, args.concurrency))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    direct = asyncio.run(in_process(model, args.requests, args.concurrency))
    print(f"{args.requests} one-token generations, {args.concurrency} in flight")
    print(f"{'':<32}{'requests/s':>12}")
    print(f"{'TorchEngine in-process':<32}{direct:>12,.0f}")
    print(f"{'asyncrl serve over HTTP':<32}{http:>12,.0f}   (target >= 300)")
    print(f"{'ratio http / in-process':<32}{http / direct:>12.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"bench": "server", "requests": args.requests, "concurrency": args.concurrency,
              "http_rps": http, "in_process_rps": direct, "target_http_rps": 300}  # fmt: skip
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
