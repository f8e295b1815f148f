"""Buffer throughput: the in-process policy and the BufferActor hub over sockets.

    python bench/buffer.py [--groups 20000] [--producers 4] [--out FILE]

1. **store**: ``VersionedBuffer`` in one process, one core: hand out work, ``put`` a
   finished group of 8 samples x 256 tokens for each item (groups are built before the
   clock starts), ``take_batch`` and bump the version, until ``--groups`` are consumed.
   Rate = groups consumed / seconds. Target: >= 20,000 groups/s.
2. **actor**: a real ``BufferActor`` process (launched by the local runtime, reading a
   jsonl prompt file) serving ``--producers`` producer processes (each asks for work
   over RPC and returns groups of 8 x 256 tokens over the reliable channel) and a
   trainer in this process (asks for batches, publishes a new version after each).
   Rate = groups consumed between the first and the last batch / that time.
   Target: >= 5,000 groups/s.
3. **actor+journal**, **actor+fsync**: the same with the buffer's write-ahead journal
   (every result and hand-out written before it is acknowledged; checkpoints every 30 s),
   and with an fsync per journal write: the cost of crash safety, side by side.

Both runs use B = 32 groups per step, max staleness 4 and a backstop at 8. Writes JSON (default
``bench/results/buffer.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import uvloop

from asyncrl.actors.base import ActorSpec
from asyncrl.buffer.versioned import VersionedBuffer
from asyncrl.runtime.local import LocalRuntime
from asyncrl.runtime.supervisor import Supervisor
from asyncrl.runtime.topology import allocate_endpoints
from asyncrl.types import (
    BatchReply,
    BatchRequest,
    Group,
    Prompt,
    Sample,
    SampleStatus,
    WorkItem,
    WorkReply,
    WorkRequest,
)
from asyncrl.wire.codec import Codec
from asyncrl.wire.control import ControlServer
from asyncrl.wire.messages import WeightVersion
from asyncrl.wire.pubsub import Publisher
from asyncrl.wire.reliable import ReliableSender
from asyncrl.wire.rpc import RpcClient

B, N, TOKENS, ETA = 32, 8, 256, 4
CONFIG = {
    "groups_per_step": B,
    "num_samples_per_prompt": N,
    "max_staleness": ETA,
    "hard_staleness": 2 * ETA,
}


def templates(version: int) -> list[Sample]:
    """The samples of one finished group at ``version`` (uids are filled in per item)."""
    rng = np.random.default_rng(version)
    out = []
    for j in range(N):
        s = Sample(uid="", group_id="", index=j, status=SampleStatus.COMPLETED, reward=j % 2)
        s.append_response(
            rng.integers(0, 32000, TOKENS), rng.standard_normal(TOKENS) * 0.1, version
        )
        out.append(s)
    return out


def finished(item: WorkItem, samples: list[Sample]) -> Group:
    """A finished group for ``item`` sharing the template's token buffers."""
    uid = item.group_uid
    return Group(
        uid=uid,
        prompt_uid=item.prompt.uid,
        samples=[
            msgspec.structs.replace(s, uid=f"{uid}/{j}", group_id=uid)
            for j, s in enumerate(samples)
        ],
    )


# -- 1. in-process -------------------------------------------------------------------------
def bench_store(num_groups: int) -> float:
    """Only the buffer's calls are timed; building each finished group is not."""
    buf = VersionedBuffer(VersionedBuffer.Config(**CONFIG))
    buf.offer([Prompt(uid=f"p{i}", prompt_id=f"p{i}", prompt="") for i in range(num_groups)])
    tmpl = {v: templates(v) for v in range(num_groups // B + 2)}
    consumed, busy = 0, 0.0
    while consumed < num_groups:
        t0 = time.perf_counter()
        items = buf.next_work(B)
        busy += time.perf_counter() - t0
        groups = [finished(item, tmpl[item.version]) for item in items]
        t0 = time.perf_counter()
        for group in groups:
            buf.put(group)
        batch = buf.take_batch()
        if batch is not None:
            consumed += len(batch.groups)
            buf.set_version(buf.version + 1)
        busy += time.perf_counter() - t0
    assert buf.statistics().ledger.consumed == num_groups
    return consumed / busy


# -- 2. over sockets -----------------------------------------------------------------------
async def producer(endpoints: dict[str, str], name: str) -> None:
    tmpl: dict[int, list[Sample]] = {}
    async with (
        RpcClient(endpoints["buffer.work"], Codec(WorkRequest), Codec(WorkReply)) as work,
        ReliableSender(endpoints["buffer.results"], Codec(Group)) as results,
    ):
        while True:
            reply = await work.call(WorkRequest(actor=name, max_items=16, wait=1.0))
            if reply.exhausted:
                break
            for item in reply.items:
                if item.version not in tmpl:
                    tmpl[item.version] = templates(item.version)
                await results.send(finished(item, tmpl[item.version]))
        await results.join()


async def bench_actor(
    num_groups: int, num_producers: int, tmp: Path, journal: str | None = None
) -> float:
    """``journal``: None, "journal" (write-ahead journal) or "fsync" (and fsync each write)."""
    data = tmp / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}"}}\n' for i in range(num_groups)))
    ep = allocate_endpoints()
    params = {"buffer": CONFIG, "source": {"path": str(data), "label_key": None},
              "checkpoint_interval": 60.0, "metrics_interval": 5.0}  # fmt: skip
    if journal is not None:
        params |= {"checkpoint": str(tmp / "buffer.ckpt"), "journal": str(tmp / "buffer.journal"),
                   "journal_fsync": journal == "fsync", "checkpoint_interval": 30.0}  # fmt: skip
    spec = ActorSpec(
        name="buffer",
        role="buffer",
        cls="asyncrl.actors.buffer:BufferActor",
        endpoints=ep,
        log_file=str(tmp / "buffer.jsonl"),
        params=params,
    )
    async with ControlServer("tcp://127.0.0.1:0") as hub, LocalRuntime(tmp) as runtime:
        async with Supervisor(runtime, hub, startup_timeout=60) as sup:
            await sup.launch([spec])
            procs = [_spawn_producer(ep, f"producer-{i}") for i in range(num_producers)]
            rate = await trainer(ep, num_groups)
            for proc in procs:
                proc.wait(timeout=60)
            await sup.stop_all(grace=10)
    return rate


async def trainer(ep: dict[str, str], num_groups: int) -> float:
    async with (
        RpcClient(ep["buffer.batches"], Codec(BatchRequest), Codec(BatchReply)) as batches,
        Publisher(ep["trainer.weights"], ep["trainer.weights_snapshot"], Codec(WeightVersion))
        as weights,
    ):  # fmt: skip
        consumed, version, t_first, t_last, acks = 0, 0, 0.0, 0.0, []
        while True:
            req = BatchRequest(trainer="trainer", wait=5.0, ack=acks, version=version)
            reply = await batches.call(req)
            acks = []
            if reply.batch is None:
                if reply.exhausted:
                    break
                continue
            acks = [reply.batch.batch_id]
            t_last = time.perf_counter()
            if not consumed:
                t_first = t_last
            consumed += len(reply.batch.groups)
            version += 1
            weights.publish(
                "weights", WeightVersion(version=version, transport="disk", location="-")
            )
    # Groups the staleness backstop dropped are not counted as served.
    print(f"actor run: {consumed} of {num_groups} groups trained", file=sys.stderr)
    return (consumed - B) / (t_last - t_first)


def _spawn_producer(ep: dict[str, str], name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--role", "producer", "--name", name, "--ep", json.dumps(ep)]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--groups", type=int, default=20_000)
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/buffer.json")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--ep", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "producer":
        uvloop.run(producer(json.loads(args.ep), args.name))
        return
    variants = {"actor": None, "actor+journal": "journal", "actor+fsync": "fsync"}
    runs: dict[str, list[float]] = {"store": [], **{k: [] for k in variants}}
    for _ in range(args.repeats):
        runs["store"].append(bench_store(args.groups))
        for key, journal in variants.items():  # alternated, so drift hits each alike
            with tempfile.TemporaryDirectory() as tmp:
                run = bench_actor(args.groups, args.producers, Path(tmp), journal)
                runs[key].append(uvloop.run(run))
    report(args, runs)


def report(args: argparse.Namespace, runs: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in runs.items()}
    targets = {"store": 20_000, "actor": 5_000, "actor+journal": 5_000, "actor+fsync": 5_000}
    print(f"{'median of ' + str(args.repeats):<52}{'groups/s':>10}{'target':>10}{'ratio':>8}")
    rows = {
        "store": f"VersionedBuffer in-process, {N} x {TOKENS} tok groups",
        "actor": f"BufferActor over sockets, {args.producers} producer processes",
        "actor+journal": "  the same with the write-ahead journal",
        "actor+fsync": "  the same, fsync per journal write",
    }
    for key, label in rows.items():
        ratio = f"{med[key] / med['actor']:.2f}" if key.startswith("actor") else ""
        target = ">=" + format(targets[key], ",")
        print(f"{label:<52}{med[key]:>10,.0f}{target:>10}{ratio:>8}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"bench": "buffer", "groups": args.groups, "producers": args.producers,
              "B": B, "samples_per_group": N, "tokens": TOKENS, "runs": runs,
              "median": med, "targets": targets}  # fmt: skip
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
