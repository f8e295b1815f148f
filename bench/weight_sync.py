"""Weight sync: one version from a trainer to 1 and 2 engine processes, per transport,
side by side with the raw transport moving the same bytes.

Models: SmolLM2-135M-Instruct (the real model, fp32 as the trainer publishes it) and a
random-init model of Qwen2.5-0.5B's shape (494M parameters, built from its config; no
download). Transports, each against its raw counterpart in the same run:

- ``pull``: ``WeightPublisher`` (BlobServer + announcement) to ``WeightReceiver``s that
  pull into preallocated tensors (an engine's parameters) | raw: a pyzmq ROUTER sends the
  same bytes in the same chunks to each DEALER that asks (``bench/weights_publish.py``).
- ``dist``: the trainer's ``GroupMembership`` (as in a job: the group formed in the
  background, the first broadcast version is the warm-up) broadcasts the version in
  buckets over gloo, a large tensor as itself and received straight into the
  receivers' tensors, the small ones flattened and copied out | raw: a bare
  ``torch.distributed`` broadcast of the same bucket sizes into preallocated buffers,
  nothing copied.
- ``ipc``: the trainer copies the version into shared buckets (named shared memory) and
  announces a handle per bucket; receivers on the host map them and copy into their
  tensors | raw: ``multiprocessing.shared_memory``: the trainer copies the same bytes
  into one segment the receivers attached beforehand, each copies them out.
- ``disk``: the trainer writes a safetensors directory (temp, then rename) and receivers
  load it and copy it into their tensors | raw: ``safetensors`` ``save_file`` and
  ``load_file`` of the same tensors, copied the same way (a load maps the file lazily:
  the copy is what reads it).

``--device cuda`` (a lent GPU): the trainer's tensors and the receivers' destinations
are on the GPU and the transport is ``ipc`` alone, as for engines colocated on one GPU:
the buckets are device memory whose CUDA IPC handles travel, the receivers map and copy
them device to device | raw: one device buffer shared by its CUDA IPC handle, the same
bytes copied into it and out of it. (NCCL ``dist`` needs a GPU per member: not on one.)
The 135M model is then ``smollm2-135m-shape``, random weights of SmolLM2's config, as the
real one's file does not travel to the device. Each receiver checks the first version's
checksum against the trainer's: the bytes arrived, not just a signal.

Time = from the publish call (or the go signal) until the last receiver holds every
tensor; median over ``--versions`` after one warm-up, in ``--rounds`` rounds that
alternate asyncrl and raw (a noisy spell hits both). Ratio = raw time / asyncrl time.
Also each receiver's peak RSS above what it held once its destination tensors were
allocated (an engine's weights are already there): what an update costs in memory.

Run: ``.venv/bin/python bench/weight_sync.py`` (about 10 minutes on 2 cores; ``--quick``:
the 135M model alone). Writes ``bench/results/weight_sync.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import uvloop
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.weights.buckets import empty_bucket, manifest_buckets
from asyncrl.weights.config import GroupConfig
from asyncrl.weights.group import BroadcastGroup, GroupMembership
from asyncrl.weights.sync import WeightPublisher, WeightReceiver
from asyncrl.wire.blob import BlobServer, layout
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import WeightVersion
from asyncrl.wire.pubsub import Publisher
from asyncrl.wire.sockets import free_tcp_endpoint

CHUNK_BYTES = 4 * 1024 * 1024
BUCKET_BYTES = 64 * 1024 * 1024  # the job default (--update-weight-buffer-size)
TARGETS = {"pull": 0.8, "dist": 0.8, "ipc": 0.8}


def real_model() -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from asyncrl.model_zoo import smollm2_dir

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32)
    return untied(model.state_dict())


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict without tied duplicates (``lm_head`` = the embedding), as the trainer
    publishes it (``Learner.hf_weights``)."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t.detach().contiguous()
    return out


def qwen05_shape() -> dict[str, torch.Tensor]:
    """Qwen2.5-0.5B's architecture (its config.json), random weights, fp32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(cfg)
    return untied(model.state_dict())


def smollm2_shape() -> dict[str, torch.Tensor]:
    """SmolLM2-135M-Instruct's architecture, random weights, fp32 (the same bytes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg)
    return untied(model.state_dict())


MODELS = {
    "smollm2-135m": real_model,
    "qwen2.5-0.5b-shape": qwen05_shape,
    "smollm2-135m-shape": smollm2_shape,
}
DEVICE = "cpu"  # --device: where the trainer's tensors and the receivers' copies live


# -- receiver processes ----------------------------------------------------------------
def rss_mb() -> float:
    """This process's peak RSS (VmHWM). Not ``ru_maxrss``: that keeps the RSS of the
    parent it was forked from (the bench's, several GB), so a child's own peak hides."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def report(version: int, base: float, out: dict[str, torch.Tensor] | None = None) -> None:
    """One line per version: when the receiver held it, its extra RSS, and (``out``) the
    checksum of what it holds, taken after the time is read."""
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    row = {"version": version, "done": time.perf_counter(), "extra_mb": rss_mb() - base}
    if out is not None:
        row["checksum"] = checksum(out)
    print(json.dumps(row), flush=True)


def checksum(tensors: dict[str, torch.Tensor]) -> float:
    """The float64 sum of every value, 1M values at a time: a whole tensor in float64
    (the 0.5B shape's embedding: 1.1 GB) would raise the peak RSS the later versions'
    reports read (VmHWM)."""
    return sum(
        float(piece.double().sum())
        for t in tensors.values()
        for piece in t.reshape(-1).split(1 << 20)
    )


def allocate(manifest) -> dict[str, torch.Tensor]:
    out = {e.name: torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=DEVICE)
           for e in manifest.entries}  # fmt: skip
    for t in out.values():
        t.zero_()  # touch the pages: they count in the baseline, as an engine's weights do
    return out


def allocate_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(t) for name, t in tensors.items()}


async def child_asyncrl(opts: dict) -> None:
    group = None
    if opts["transport"] == "dist":  # as a rollout actor joins the job's group
        config = GroupConfig(world_size=opts["world"])
        group = GroupMembership(config, rank=opts["rank"], address=opts["address"])
    async with WeightReceiver(
        opts["pub"], opts["snap"], max_frame_bytes=64 << 20, group=group
    ) as rx:
        print("READY", flush=True)
        out, base, seen = None, 0.0, 0
        while True:  # until the parent kills us
            msg = await rx.next_version(after=seen)
            if out is None and msg.manifest is not None:
                out, base = allocate(msg.manifest), rss_mb()
            if msg.transport == "disk":
                loaded = await rx.fetch(msg)  # mapped lazily: the copy below reads it
                if out is None:
                    out, base = allocate_like(loaded), rss_mb()
                for name, t in loaded.items():
                    out[name].copy_(t)
                del loaded
            else:
                await rx.fetch(msg, out=out)
            report(msg.version, base, out if seen == 0 else None)
            seen = msg.version


def child_raw_zmq(opts: dict) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(opts["endpoint"])
    buf = np.zeros(opts["nbytes"], dtype=np.uint8)
    base = rss_mb()
    print("READY", flush=True)
    for version in range(1, opts["versions"] + 1):
        sys.stdin.readline()
        sock.send(b"get")
        got = 0
        while got < len(buf):
            frame = sock.recv(copy=False)
            buf[got : got + len(frame)] = np.frombuffer(frame.buffer, dtype=np.uint8)
            got += len(frame)
        report(version, base)


def child_raw_dist(opts: dict) -> None:
    group = BroadcastGroup.join(opts["address"], opts["rank"], opts["world"])
    sizes = [(n, getattr(torch, d)) for n, d in opts["buckets"]]
    buffers = [torch.zeros(n, dtype=dtype) for n, dtype in sizes]
    base = rss_mb()
    print("READY", flush=True)
    for version in range(1, opts["versions"] + 1):
        group.broadcast(buffers)
        report(version, base)


def child_raw_shm(opts: dict) -> None:
    from multiprocessing import resource_tracker, shared_memory

    segment = shared_memory.SharedMemory(name=opts["name"])
    # Python 3.11 registers an attached segment too, and unlinks it when this child exits.
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    shared = np.ndarray((opts["nbytes"],), dtype=np.uint8, buffer=segment.buf)
    buf = np.zeros(opts["nbytes"], dtype=np.uint8)
    base = rss_mb()
    print("READY", flush=True)
    for version in range(1, opts["versions"] + 1):
        sys.stdin.readline()
        np.copyto(buf, shared)
        report(version, base)
    del shared
    segment.close()


def child_raw_cuda(opts: dict) -> None:
    from asyncrl.weights.payload import decode

    shared = decode(opts["handle"])  # the parent's device buffer, mapped
    buf = torch.zeros_like(shared)
    base = rss_mb()
    print("READY", flush=True)
    for version in range(1, opts["versions"] + 1):
        sys.stdin.readline()
        buf.copy_(shared)
        report(version, base)


def child_raw_disk(opts: dict) -> None:
    from safetensors.torch import load_file

    out, base = None, 0.0
    print("READY", flush=True)
    for version in range(1, opts["versions"] + 1):
        path = sys.stdin.readline().strip()
        loaded = load_file(path)
        if out is None:
            out, base = allocate_like(loaded), rss_mb()
        for name, t in loaded.items():
            out[name].copy_(t)
        del loaded
        report(version, base)


# -- the parent --------------------------------------------------------------------------
def spawn(opts: dict) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", json.dumps(opts)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    return proc


def ready(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line == "READY", f"receiver failed to start: {line!r}"


def read_done(procs: list[subprocess.Popen], expect: float | None = None) -> tuple[float, float]:
    """The last receiver's done time and the largest extra RSS; with ``expect``, each
    receiver's checksum must match it (float64 sums of the same fp32 values)."""
    rows = []
    for proc in procs:
        assert proc.stdout is not None
        rows.append(json.loads(proc.stdout.readline()))
    if expect is not None:
        sums = [r.get("checksum") for r in rows]
        assert all(s is not None and abs(s - expect) <= 1e-6 * max(1.0, abs(expect))
                   for s in sums), f"receivers hold other bytes: {sums} != {expect}"  # fmt: skip
    return max(r["done"] for r in rows), max(r["extra_mb"] for r in rows)


def finish(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.communicate(timeout=120)


def measure_asyncrl(transport: str, tensors: dict, n: int, versions: int, tmp: Path):
    """``(seconds per version, receivers' peak extra MB)``."""
    pub_ep, snap_ep = free_tcp_endpoint(), free_tcp_endpoint()
    address = free_tcp_endpoint().removeprefix("tcp://")

    async def run() -> tuple[list[float], float]:
        pub = Publisher(pub_ep, snap_ep, Codec(WeightVersion))
        blob = BlobServer(free_tcp_endpoint(), chunk_bytes=CHUNK_BYTES, keep=2)
        async with pub, blob:
            opts = {"role": "asyncrl", "transport": transport, "pub": pub_ep, "snap": snap_ep,
                    "versions": versions, "address": address, "world": n + 1,
                    "device": DEVICE}  # fmt: skip
            first = checksum(tensors)
            procs = [spawn(opts | {"rank": r + 1}) for r in range(n)]
            group = None
            if transport == "dist":  # as the trainer serves the job's group
                group = GroupMembership(GroupConfig(world_size=n + 1), rank=0, address=address)
                group.open()
            await asyncio.to_thread(ready, procs)
            await asyncio.sleep(0.5)  # subscribed (a late one would get a snapshot)
            sync = WeightPublisher(
                pub, transport=transport, blob=blob, disk_dir=tmp / "weights", group=group,
                bucket_bytes=BUCKET_BYTES,
            )  # fmt: skip

            async def one(version: int) -> tuple[WeightVersion, float, float]:
                start = time.perf_counter()
                publish = asyncio.ensure_future(sync.publish(version, tensors))
                expect = first if version == 1 else None
                done, mb = await asyncio.to_thread(read_done, procs, expect)
                return await publish, done - start, mb

            # Warm-up: dist versions go by pull until the group has formed; the first
            # broadcast is the warm-up (compare() drops it), as the first pull is.
            version = 1
            msg, warm, extra = await one(version)
            while transport == "dist" and not msg.formed:
                await asyncio.sleep(0.5)
                version += 1
                msg, warm, extra = await one(version)
            times = [warm]
            for timed in range(version + 1, version + versions):
                _, seconds, mb = await one(timed)
                times.append(seconds)
                extra = max(extra, mb)
            for proc in procs:
                proc.kill()
                proc.wait()
            if group is not None:
                group.close()
            sync.close()
            return times, extra

    return uvloop.run(run())


def measure_raw(transport: str, tensors: dict, n: int, versions: int, tmp: Path):
    if transport == "pull":
        return _raw_zmq(tensors, n, versions)
    if transport == "dist":
        return _raw_dist(tensors, n, versions)
    if transport == "ipc":
        raw = _raw_cuda if DEVICE != "cpu" else _raw_shm
        return raw(tensors, n, versions)
    return _raw_disk(tensors, n, versions, tmp)


def _raw_shm(tensors: dict, n: int, versions: int):
    from multiprocessing import shared_memory

    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    segment = shared_memory.SharedMemory(create=True, size=nbytes)
    shared = torch.frombuffer(segment.buf, dtype=torch.uint8)
    opts = {"role": "raw-shm", "name": segment.name, "nbytes": nbytes, "versions": versions}
    result = copy_rounds(tensors, shared, [spawn(opts) for _ in range(n)], versions)
    del shared
    segment.close()
    segment.unlink()
    return result


def _raw_cuda(tensors: dict, n: int, versions: int):
    from asyncrl.weights.payload import encode

    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    shared = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    opts = {"role": "raw-cuda", "handle": encode(shared), "versions": versions, "device": DEVICE}
    return copy_rounds(tensors, shared, [spawn(opts) for _ in range(n)], versions)


def copy_rounds(tensors: dict, shared: torch.Tensor, procs: list, versions: int):
    """Per version: the bytes copied into ``shared`` (on a GPU, finished before anyone is
    told), then every receiver told to copy them out."""
    ready(procs)
    times, extra = [], 0.0
    for _ in range(versions):
        start = time.perf_counter()
        torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()], out=shared)
        if shared.device.type == "cuda":
            torch.cuda.synchronize()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        done, mb = read_done(procs)
        times.append(done - start)
        extra = max(extra, mb)
    finish(procs)
    return times, extra


def _raw_zmq(tensors: dict, n: int, versions: int):
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()]).numpy()
    view = memoryview(flat)
    endpoint = free_tcp_endpoint()
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    procs = [spawn({"role": "raw-zmq", "endpoint": endpoint, "nbytes": len(flat),
                    "versions": versions}) for _ in range(n)]  # fmt: skip
    ready(procs)
    times, extra = [], 0.0
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
        done, mb = read_done(procs)
        times.append(done - start)
        extra = max(extra, mb)
    finish(procs)
    sock.close(linger=0)
    return times, extra


def _raw_dist(tensors: dict, n: int, versions: int):
    manifest = layout(tensors, chunk_bytes=BUCKET_BYTES, blob="raw")
    plan = manifest_buckets(manifest)
    flats = []
    for b in plan:
        flat = empty_bucket(b)
        flat.copy_(
            torch.cat([tensors[e.name].reshape(-1) for e in manifest.entries[b.start : b.end]])
        )
        flats.append(flat)
    address = free_tcp_endpoint().removeprefix("tcp://")
    opts = {"role": "raw-dist", "address": address, "world": n + 1, "versions": versions,
            "buckets": [[b.numel, b.dtype] for b in plan]}  # fmt: skip
    procs = [spawn(opts | {"rank": r + 1}) for r in range(n)]
    group = BroadcastGroup.join(address, 0, n + 1)
    ready(procs)
    times, extra = [], 0.0
    for _ in range(versions):
        start = time.perf_counter()
        group.broadcast(flats)  # the same bucket sizes, no flattening, no copy out
        done, mb = read_done(procs)
        times.append(done - start)
        extra = max(extra, mb)
    finish(procs)
    return times, extra


def _raw_disk(tensors: dict, n: int, versions: int, tmp: Path):
    from safetensors.torch import save_file

    procs = [spawn({"role": "raw-disk", "versions": versions}) for _ in range(n)]
    ready(procs)
    times, extra = [], 0.0
    for version in range(versions):
        start = time.perf_counter()
        path = tmp / f"raw_{version}.safetensors"
        save_file(tensors, str(path))
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(f"{path}\n")
            proc.stdin.flush()
        done, mb = read_done(procs)
        times.append(done - start)
        extra = max(extra, mb)
        # Keep the newest 2, as the trainer does (keep=2): deleting a file at once would
        # drop its dirty pages before they are ever written back, which no trainer does.
        (tmp / f"raw_{version - 2}.safetensors").unlink(missing_ok=True)
    finish(procs)
    return times, extra


def compare(transport: str, tensors: dict, n: int, versions: int, rounds: int) -> dict:
    gc.collect()  # the last measurement's shared memory goes before this one takes more
    ours: list[float] = []
    raw: list[float] = []
    ours_mb = raw_mb = 0.0
    # ipc shares versions in a ring of 3 slots (keep 2, plus one): its first 3 versions
    # page the memory in, once per job, and are the warm-up; the others warm up on one.
    warm = 3 if transport == "ipc" else 1
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            t, mb = measure_raw(transport, tensors, n, versions + 1, Path(tmp))
            raw += t[1:]
            raw_mb = max(raw_mb, mb)
        with tempfile.TemporaryDirectory() as tmp:
            t, mb = measure_asyncrl(transport, tensors, n, versions + warm, Path(tmp))
            ours += t[warm:]
            ours_mb = max(ours_mb, mb)
    ours_s, raw_s = statistics.median(ours), statistics.median(raw)
    row = {"transport": transport, "engines": n, "asyncrl_s": ours_s, "raw_s": raw_s,
           "ratio": raw_s / ours_s, "asyncrl_extra_mb": ours_mb,
           "raw_extra_mb": raw_mb}  # fmt: skip
    if transport in TARGETS:
        row["target"] = {"want": TARGETS[transport], "met": row["ratio"] >= TARGETS[transport]}
    return row


def main() -> None:
    global BUCKET_BYTES, DEVICE  # flags that the measure functions and children read
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the 135M model only")
    ap.add_argument("--transports", default="pull,dist,ipc,disk")
    ap.add_argument(
        "--models", default="smollm2-135m,qwen2.5-0.5b-shape", help="of: " + ", ".join(MODELS)
    )
    ap.add_argument(
        "--bucket-mib",
        type=int,
        default=BUCKET_BYTES >> 20,
        help="dist bucket size (a job's --update-weight-buffer-size)",
    )
    ap.add_argument("--device", default="cpu", help="cuda: ipc by CUDA IPC (module docstring)")
    ap.add_argument("--out", default="bench/results/weight_sync.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        opts = json.loads(args.child)
        DEVICE = opts.get("device", "cpu")
        role = opts["role"]
        if role == "asyncrl":
            uvloop.run(child_asyncrl(opts))
        else:
            {"raw-zmq": child_raw_zmq, "raw-dist": child_raw_dist, "raw-shm": child_raw_shm,
             "raw-disk": child_raw_disk, "raw-cuda": child_raw_cuda}[role](opts)  # fmt: skip
        return
    BUCKET_BYTES, DEVICE = args.bucket_mib << 20, args.device
    if DEVICE != "cpu":
        if args.transports != "ipc":
            print(f"--device {DEVICE}: the ipc transport alone (module docstring)")
        args.transports = "ipc"
        if "smollm2-135m" in args.models.split(","):
            args.models = args.models.replace("smollm2-135m", "smollm2-135m-shape")
    torch.set_num_threads(2)
    results = []
    models = args.models.split(",")[:1] if args.quick else args.models.split(",")
    for name in models:
        tensors = {k: t.to(DEVICE) for k, t in MODELS[name]().items()}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        print(f"\n{name}: {sum(t.numel() for t in tensors.values()) / 1e6:.1f}M parameters, "
              f"{nbytes / 2**20:,.0f} MiB fp32, {len(tensors)} tensors")  # fmt: skip
        print(f"{'transport':<10}{'engines':>8}{'asyncrl s':>11}{'raw s':>9}{'ratio':>7}"
              f"{'GB/s':>7}{'extra MB':>10}{'raw MB':>8}")  # fmt: skip
        for transport in args.transports.split(","):
            for n in (1, 2):
                row = compare(transport, tensors, n, args.versions, args.rounds)
                row |= {"model": name, "bytes": nbytes}
                results.append(row)
                print(f"{transport:<10}{n:>8}{row['asyncrl_s']:>11.3f}{row['raw_s']:>9.3f}"
                      f"{row['ratio']:>7.2f}{n * nbytes / row['asyncrl_s'] / 1e9:>7.2f}"
                      f"{row['asyncrl_extra_mb']:>10.0f}{row['raw_extra_mb']:>8.0f}")  # fmt: skip
        del tensors
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    out.write_text(json.dumps({"bench": "weight_sync", "time": stamp, "results": results,
                               "bucket_bytes": BUCKET_BYTES, "chunk_bytes": CHUNK_BYTES,
                               "threads": torch.get_num_threads()}, indent=2))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
