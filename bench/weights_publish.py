"""Weight publish: a ~30M-parameter model's tensors to 2 subscriber processes.

asyncrl: the trainer side ``WeightPublisher`` (pull transport: ``BlobServer`` + pub/sub
announcement) publishes a version; each subscriber process (``WeightReceiver``) sees the
announcement and pulls the tensors into preallocated tensors, as an engine does.
Baseline: raw pyzmq, the same bytes sent by a ROUTER in the same chunk size to each of
2 DEALER processes that asked, copied into one preallocated buffer.

Time = from the publish call (asyncrl) or the go signal (raw) until the later of the two
subscribers has every byte; median over ``--versions`` (after one warm-up) in each of 3
alternating rounds. Ratio =
raw time / asyncrl time (>= 0.7 is the issue's target). Called by ``bench/trainer.py``;
run alone: ``.venv/bin/python bench/weights_publish.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import uvloop
import zmq
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.weights.sync import WeightPublisher, WeightReceiver
from asyncrl.wire.blob import BlobServer
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import WeightVersion
from asyncrl.wire.pubsub import Publisher
from asyncrl.wire.sockets import free_tcp_endpoint

CHUNK_BYTES = 4 * 1024 * 1024
SUBSCRIBERS = 2


def model_tensors() -> dict[str, torch.Tensor]:
    """The state dict of a random-init ~30M Qwen2 (bench/engine.py's shape), fp32, CPU."""
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=512,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


# -- subscriber processes ----------------------------------------------------------------
async def child_asyncrl(pub: str, snap: str, versions: int) -> None:
    async with WeightReceiver(pub, snap, max_frame_bytes=64 << 20) as rx:
        out: dict[str, torch.Tensor] | None = None
        print("READY", flush=True)
        seen = 0
        for _ in range(versions):
            msg = await rx.next_version(after=seen)
            if out is None:  # like an engine: its parameters are the destination
                assert msg.manifest is not None
                out = {
                    e.name: torch.empty(e.shape, dtype=getattr(torch, e.dtype))
                    for e in msg.manifest.entries
                }
            await rx.fetch(msg, out=out)
            seen = msg.version
            print(json.dumps({"version": seen, "done": time.perf_counter()}), flush=True)


def child_raw(endpoint: str, nbytes: int, versions: int) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    buf = np.empty(nbytes, dtype=np.uint8)
    print("READY", flush=True)
    for version in range(1, versions + 1):
        sys.stdin.readline()
        sock.send(b"get")
        got = 0
        while got < nbytes:
            frame = sock.recv(copy=False)
            n = len(frame)
            buf[got : got + n] = np.frombuffer(frame.buffer, dtype=np.uint8)
            got += n
        print(json.dumps({"version": version, "done": time.perf_counter()}), flush=True)


def spawn(args: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    return proc


def read_done(procs: list[subprocess.Popen]) -> float:
    dones = []
    for proc in procs:
        assert proc.stdout is not None
        dones.append(json.loads(proc.stdout.readline())["done"])
    return max(dones)


# -- parent measurements -----------------------------------------------------------------
def measure_asyncrl(tensors: dict[str, torch.Tensor], versions: int) -> list[float]:
    """Seconds from ``publish`` to both subscribers holding the version, per version."""
    pub_ep, snap_ep, blob_ep = free_tcp_endpoint(), free_tcp_endpoint(), free_tcp_endpoint()

    async def run() -> list[float]:
        pub = Publisher(pub_ep, snap_ep, Codec(WeightVersion))
        blob = BlobServer(blob_ep, chunk_bytes=CHUNK_BYTES, keep=2)
        async with pub, blob:
            sync = WeightPublisher(pub, transport="pull", blob=blob)
            args = ["--role", "asyncrl", "--a", pub_ep, "--b", snap_ep, "--n", str(versions)]
            procs = [spawn(args) for _ in range(SUBSCRIBERS)]
            await asyncio.sleep(0.5)  # subscribers connected (a late one would get a snapshot)
            times = []
            for version in range(1, versions + 1):
                start = time.perf_counter()
                await sync.publish(version, tensors)
                done = await asyncio.to_thread(read_done, procs)
                times.append(done - start)
            for proc in procs:
                proc.wait(30)
            return times

    return uvloop.run(run())


def measure_raw(tensors: dict[str, torch.Tensor], versions: int) -> list[float]:
    """Seconds from the go signal to both subscribers holding every byte, per version."""
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()]).numpy()
    view = memoryview(flat)
    endpoint = free_tcp_endpoint()
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    args = ["--role", "raw", "--a", endpoint, "--b", str(len(flat)), "--n", str(versions)]
    procs = [spawn(args) for _ in range(SUBSCRIBERS)]
    times = []
    for _ in range(versions):
        start = time.perf_counter()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for _ in procs:
            peer, _ask = sock.recv_multipart()
            for off in range(0, len(flat), CHUNK_BYTES):
                sock.send_multipart([peer, view[off : off + CHUNK_BYTES]], copy=False)
        times.append(read_done(procs) - start)
    for proc in procs:
        proc.communicate(timeout=30)
    sock.close(linger=0)
    return times


def run(versions: int, rounds: int = 3) -> dict[str, float]:
    """Both measurements, alternated ``rounds`` times, and the ratio of their medians."""
    tensors = model_tensors()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    params = sum(t.numel() for t in tensors.values())
    raw: list[float] = []
    ours: list[float] = []
    for _ in range(rounds):  # alternate, so a noisy spell hits both sides
        raw += measure_raw(tensors, versions + 1)[1:]
        ours += measure_asyncrl(tensors, versions + 1)[1:]
    raw_s, ours_s = statistics.median(raw), statistics.median(ours)
    return {
        "params": params,
        "bytes": nbytes,
        "subscribers": SUBSCRIBERS,
        "raw_s": raw_s,
        "asyncrl_s": ours_s,
        "ratio": raw_s / ours_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--a", help=argparse.SUPPRESS)
    ap.add_argument("--b", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "asyncrl":
        uvloop.run(child_asyncrl(args.a, args.b, args.n))
        return
    if args.role == "raw":
        child_raw(args.a, int(args.b), args.n)
        return
    print(json.dumps(run(args.versions), indent=2))


if __name__ == "__main__":
    main()
