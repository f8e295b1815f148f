"""Wire throughput against raw pyzmq, measured side by side in one run.

    python bench/wire.py [--messages 200000] [--payload-mb 64] [--repeats 3] [--out FILE]

Two measurements, each a ratio of asyncrl to raw pyzmq between two processes on the
same machine, taken alternately ``--repeats`` times (the median ratio is reported, since
this machine is shared and absolute rates drift):

1. **records**: ~1 KB ``asyncrl.types.Sample`` records (48 prompt and 64 response
   tokens with log-probs, versions and mask, ids, reward, status) through a
   ``ReliableSender`` -> ``ReliableReceiver`` channel (encode, batch, decode, validate,
   ack, de-duplicate) against raw PUSH/PULL sending the
   same number of pre-encoded 1 KB byte strings. Rate = messages / (last arrival - first
   arrival) at the receiver. Target: >= 0.5. A second row sends a 1 KB record whose
   payload is opaque bytes, which separates the channel's cost from the record's.
2. **blob**: ``--payload-mb`` of float32/bf16 tensors pulled through ``BlobClient`` (manifest
   round trip, chunked, credit-windowed, copied into the destination tensors as an engine
   does on a weight update) against raw PUSH/PULL streaming the same bytes in frames of
   the same chunk size that the receiver does not copy anywhere. Both sides move the
   payload once untimed (connect, first-touch pages), then ``PULLS`` times timed.
   Target: >= 0.7.

Writes a JSON result (default ``bench/results/wire.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import uvloop
import zmq

from asyncrl.observe.logs import configure_logging
from asyncrl.types import Sample, SampleStatus, pack_int32
from asyncrl.wire import security
from asyncrl.wire.blob import BlobClient, BlobServer
from asyncrl.wire.codec import Codec, Message
from asyncrl.wire.reliable import ReliableReceiver, ReliableSender
from asyncrl.wire.sockets import free_tcp_endpoint

CHUNK_BYTES = 4 * 1024 * 1024
PULLS = 4  # timed payload transfers per measurement, after one untimed warm-up
CURVE_ENV = "ASYNCRL_BENCH_CURVE_KEYS"  # children enable CurveZMQ with these keys


def make_record(i: int) -> Sample:
    """A finished sample as a rollout actor returns it: 48 prompt + 64 response tokens."""
    rng = np.random.default_rng(i)
    sample = Sample(
        uid=f"g-{i // 8:07d}/{i % 8}",
        group_id=f"g-{i // 8:07d}",
        index=i % 8,
        prompt_id=f"train:{i // 8}",
        packed_prompt=pack_int32(rng.integers(0, 32000, 48)),
        status=SampleStatus.COMPLETED,
        reward=1.0,
        finish_reason="stop",
    )
    sample.append_response(
        rng.integers(0, 32000, 64), rng.standard_normal(64).astype(np.float32), versions=3
    )
    return sample


class PayloadRecord(Message):
    """A ~1 KB record whose payload is opaque bytes: the channel's cost without arrays."""

    uid: str
    group_id: str
    index: int
    payload: bytes
    reward: float
    status: str


def make_payload_record(i: int) -> PayloadRecord:
    return PayloadRecord(
        uid=f"s-{i:08d}",
        group_id=f"g-{i // 8:07d}",
        index=i % 8,
        payload=bytes(960),
        reward=1.0,
        status="completed",
    )


RECORDS = {"sample": (Sample, make_record), "payload": (PayloadRecord, make_payload_record)}


def record_size() -> int:
    return len(Codec(Sample).encode(make_record(0))[0])


# -- child roles ------------------------------------------------------------------------
def child_raw_pull(endpoint: str, n: int) -> dict:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.bind(endpoint)
    print("READY", flush=True)
    sock.recv()
    t0 = time.perf_counter()
    for _ in range(n - 1):
        sock.recv()
    return {"rate": (n - 1) / (time.perf_counter() - t0)}


async def child_reliable_recv(endpoint: str, n: int, kind: str) -> dict:
    async with ReliableReceiver(endpoint, Codec(RECORDS[kind][0])) as rx:
        gc.freeze()  # as every actor does after setup (actors/base.py)
        print("READY", flush=True)
        batch = await rx.receive_batch()
        t0, got = time.perf_counter(), 0
        while True:
            batch.ack()
            got += len(batch)
            if got >= n:
                break
            batch = await rx.receive_batch()
        rate = (n - 1) / (time.perf_counter() - t0)
        await asyncio.sleep(0.2)  # let the last acks leave
        return {"rate": rate, "duplicates": rx.stats.duplicates, "received": got}


def child_raw_push_blob(endpoint: str, nbytes: int) -> dict:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.bind(endpoint)
    payload = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    view = memoryview(payload)
    print("READY", flush=True)
    sys.stdin.readline()
    for _ in range(PULLS + 1):
        for off in range(0, nbytes, CHUNK_BYTES):
            sock.send(view[off : off + CHUNK_BYTES], copy=False)
    sys.stdin.readline()
    return {}


async def child_blob_server(endpoint: str, nbytes: int) -> dict:
    tensors = make_tensors(nbytes)
    async with BlobServer(endpoint, chunk_bytes=CHUNK_BYTES) as server:
        server.put("weights-v1", tensors)
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    return {}


def make_tensors(nbytes: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n_layers, out = 8, {}
    per = nbytes // n_layers
    for i in range(n_layers):
        dtype = torch.float32 if i % 2 else torch.bfloat16
        out[f"layers.{i}.weight"] = torch.randn(per // dtype.itemsize, generator=gen).to(dtype)
    return out


# -- parent measurements ----------------------------------------------------------------
def spawn(role: str, endpoint: str, size: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--role", role, "--endpoint", endpoint, "--size", str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    return proc


def finish(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=300)
    return json.loads(out.strip().splitlines()[-1])


def raw_records(n: int) -> float:
    endpoint = free_tcp_endpoint()
    proc = spawn("raw_pull", endpoint, n)
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(endpoint)
    msg = b"x" * record_size()
    for _ in range(n):
        sock.send(msg)
    result = finish(proc)
    sock.close(linger=1000)
    return result["rate"]


def reliable_records(n: int, kind: str) -> float:
    endpoint = free_tcp_endpoint()
    proc = spawn(f"reliable_recv:{kind}", endpoint, n)
    cls, make = RECORDS[kind]
    records = [make(i) for i in range(1024)]

    async def send_all() -> None:
        async with ReliableSender(endpoint, Codec(cls)) as tx:
            gc.freeze()
            for i in range(n):
                await tx.send(records[i % 1024])
            await tx.join()

    uvloop.run(send_all())
    result = finish(proc)
    assert result["received"] == n, result
    return result["rate"]


def raw_blob(nbytes: int) -> float:
    endpoint = free_tcp_endpoint()
    proc = spawn("raw_push_blob", endpoint, nbytes)
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.connect(endpoint)
    time.sleep(0.2)
    assert proc.stdin is not None
    t0 = time.perf_counter()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    got = 0
    while got < (PULLS + 1) * nbytes:
        if got == nbytes:  # same warm-up as the pull: first payload not timed
            t0 = time.perf_counter()
        got += len(sock.recv(copy=False))
    rate = PULLS * nbytes / (time.perf_counter() - t0)
    proc.stdin.write("done\n")
    proc.stdin.flush()
    finish(proc)
    sock.close(linger=0)
    return rate


def blob_pull(nbytes: int) -> float:
    endpoint = free_tcp_endpoint()
    proc = spawn("blob_server", endpoint, nbytes)
    expected = make_tensors(nbytes)

    async def pull() -> float:
        # Like an engine: a connected client pulls each new version into the same tensors.
        out = {name: torch.empty_like(t) for name, t in expected.items()}
        async with BlobClient(endpoint) as client:
            await client.fetch("weights-v1", out=out)  # warm-up: connect, touch pages
            t0 = time.perf_counter()
            for _ in range(PULLS):
                await client.fetch("weights-v1", out=out)
            rate = PULLS * nbytes / (time.perf_counter() - t0)
        for name, t in expected.items():
            assert torch.equal(out[name], t), name
        return rate

    rate = uvloop.run(pull())
    assert proc.stdin is not None
    proc.stdin.write("done\n")
    proc.stdin.flush()
    finish(proc)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--payload-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/wire.json")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        run_child(args.role, args.endpoint, args.size)
        return
    nbytes = args.payload_mb * 1024 * 1024
    runs = {
        "raw_records": [],
        "reliable_records": [],
        "reliable_payload_records": [],
        "raw_blob": [],
        "blob_pull": [],
    }
    for _ in range(args.repeats):
        runs["raw_records"].append(raw_records(args.messages))
        runs["reliable_records"].append(reliable_records(args.messages, "sample"))
        runs["reliable_payload_records"].append(reliable_records(args.messages, "payload"))
        runs["raw_blob"].append(raw_blob(nbytes))
        runs["blob_pull"].append(blob_pull(nbytes))
    report(args, runs)


def run_child(role: str, endpoint: str, size: int) -> None:
    if keys := os.environ.get(CURVE_ENV):  # bench/curve.py: the encrypted variant
        configure_logging(level="warning")  # stdout carries READY and the result only
        security.enable(keys)
    if role == "raw_pull":
        result = child_raw_pull(endpoint, size)
    elif role.startswith("reliable_recv:"):
        result = uvloop.run(child_reliable_recv(endpoint, size, role.split(":")[1]))
    elif role == "raw_push_blob":
        result = child_raw_push_blob(endpoint, size)
    else:
        result = uvloop.run(child_blob_server(endpoint, size))
    print(json.dumps(result), flush=True)


def report(args: argparse.Namespace, runs: dict[str, list[float]]) -> None:
    rec = [r / b for r, b in zip(runs["reliable_records"], runs["raw_records"], strict=True)]
    pay = [
        r / b for r, b in zip(runs["reliable_payload_records"], runs["raw_records"], strict=True)
    ]
    blob = [r / b for r, b in zip(runs["blob_pull"], runs["raw_blob"], strict=True)]
    result = {
        "bench": "wire",
        "record_bytes": record_size(),
        "messages": args.messages,
        "payload_bytes": args.payload_mb * 1024 * 1024,
        "chunk_bytes": CHUNK_BYTES,
        "runs": runs,
        "records_ratio": statistics.median(rec),
        "payload_records_ratio": statistics.median(pay),
        "blob_ratio": statistics.median(blob),
        "targets": {"records_ratio": 0.5, "blob_ratio": 0.7},
    }
    med = {k: statistics.median(v) for k, v in runs.items()}
    mb = 1024 * 1024
    rows = [
        (
            "1 KB sample records, msgs/s",
            med["raw_records"],
            med["reliable_records"],
            result["records_ratio"],
            ">=0.5",
        ),
        (
            "1 KB bytes-payload records, msgs/s",
            med["raw_records"],
            med["reliable_payload_records"],
            result["payload_records_ratio"],
            "",
        ),
        (
            f"{args.payload_mb} MB tensors, MB/s",
            med["raw_blob"] / mb,
            med["blob_pull"] / mb,
            result["blob_ratio"],
            ">=0.7",
        ),
    ]
    print(
        f"{'median of ' + str(args.repeats):<36}{'raw pyzmq':>12}{'asyncrl':>12}"
        f"{'ratio':>8}{'target':>8}"
    )
    for name, raw, ours, ratio, target in rows:
        print(f"{name:<36}{raw:>12,.0f}{ours:>12,.0f}{ratio:>8.2f}{target:>8}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
