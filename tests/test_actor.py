"""The actor lifecycle in-process: setup, run, drain, teardown, failure, channels, context."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from asyncrl.actors.base import ActorSpec, is_permanent
from asyncrl.observe.logs import configure_logging
from asyncrl.wire import framing
from asyncrl.wire.codec import Codec
from asyncrl.wire.messages import Probe
from asyncrl.wire.reliable import ReliableReceiver, ReliableSender
from tests.actors import Crasher, Recorder


def spec(tmp_path: Path, cls: str = "tests.actors:Recorder", **params: object) -> ActorSpec:
    return ActorSpec(
        name="unit",
        role="test",
        cls=cls,
        drain_timeout=1.0,
        heartbeat_interval=0.05,
        params={"journal": str(tmp_path / "j"), **params},
    )


def journal(tmp_path: Path) -> list[str]:
    return (tmp_path / "j").read_text().split()


async def test_a_stop_request_drains_then_tears_down_and_exits_zero(tmp_path: Path):
    actor = Recorder(spec(tmp_path))
    main = asyncio.create_task(actor.main())
    await asyncio.sleep(0.2)
    assert actor.state == "running" and actor.stats()["ticks"] > 0
    actor.request_stop("test")
    assert await main == 0
    assert journal(tmp_path) == ["setup", "run", "drain", "drained", "teardown"]
    assert actor.state == "stopped"


async def test_a_run_that_raises_fails_the_actor_but_still_tears_down(tmp_path: Path):
    actor = Crasher(spec(tmp_path, "tests.actors:Crasher", after=0.05))
    assert await actor.main() == 1
    assert actor.state == "failed"
    assert journal(tmp_path) == ["setup", "teardown"]


async def test_a_drain_that_overruns_its_timeout_is_cut_short(tmp_path: Path):
    actor = Recorder(spec(tmp_path, drain_seconds=30, linger=30))
    main = asyncio.create_task(actor.main())
    await asyncio.sleep(0.1)
    actor.request_stop("test")
    async with asyncio.timeout(5):
        assert await main == 0
    assert "drained" not in journal(tmp_path) and journal(tmp_path)[-1] == "teardown"


class WithChannel(Recorder):
    async def setup(self) -> None:
        await super().setup()
        self.rx = await self.open(ReliableReceiver("tcp://127.0.0.1:0", Codec(Probe)), "results")


async def test_opened_channels_report_stats_and_close_after_teardown(tmp_path: Path):
    actor = WithChannel(spec(tmp_path))
    main = asyncio.create_task(actor.main())
    await asyncio.sleep(0.2)
    stats = actor.all_stats()
    assert {"results.received", "results.dropped", "ticks", "loop_lag_ms"} <= set(stats)
    with pytest.raises(ValueError, match="already used"):
        await actor.open(ReliableReceiver("tcp://127.0.0.1:0", Codec(Probe)), "results")
    actor.request_stop("test")
    assert await main == 0
    assert actor.rx.closed


async def test_log_lines_carry_actor_role_pid_and_version(tmp_path: Path):
    log_file = tmp_path / "actor.jsonl"
    configure_logging(level="info", fmt="json", file=log_file, actor="unit", role="test", pid=4242)
    actor = Recorder(spec(tmp_path, version=7))
    main = asyncio.create_task(actor.main())
    await asyncio.sleep(0.1)
    actor.request_stop("test")
    assert await main == 0
    lines = [json.loads(line) for line in log_file.read_text().splitlines()]
    stop = next(line for line in lines if line["event"] == "stop requested")
    assert (stop["actor"], stop["role"], stop["pid"], stop["version"]) == ("unit", "test", 4242, 7)


async def test_an_actor_keeps_serving_while_garbage_arrives_on_its_channels(tmp_path: Path):
    actor = WithChannel(spec(tmp_path))
    main = asyncio.create_task(actor.main())
    await asyncio.sleep(0.2)
    attacker = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(actor.rx.endpoint)
    for frame in (b"", b"\xc1", os.urandom(200), framing.pack_batch("x", 1, [], [b"\xc1"])):
        await attacker.send_multipart([frame])
    async with ReliableSender(actor.rx.endpoint, Codec(Probe)) as tx:
        await tx.send(Probe(sender="ok", seq=1, payload=np.arange(3)))
        async with asyncio.timeout(5):
            delivery = await actor.rx.receive()
            delivery.ack()
            await tx.join()
    assert delivery.msg.sender == "ok" and actor.state == "running"
    assert actor.all_stats()["results.dropped"] >= 4
    attacker.close()
    actor.request_stop("test")
    assert await main == 0


def test_a_child_obeys_sigterm_while_a_worker_thread_is_busy_in_setup(tmp_path: Path):
    """The interpreter waits for busy threads at exit; the stop's watchdog does not."""
    busy = spec(tmp_path, "tests.actors:BusySetup")
    child = subprocess.Popen([sys.executable, "-m", "asyncrl.runtime.child"], stdin=subprocess.PIPE)
    assert child.stdin is not None
    child.stdin.write(msgspec.json.encode(busy))
    child.stdin.close()
    deadline = time.monotonic() + 60
    while not (tmp_path / "j").exists():  # in setup, its thread asleep
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    # drain_timeout (1 s) + EXIT_GRACE_S (10 s), well before the thread's 60 s end
    assert child.wait(timeout=30) == 1


def test_a_write_the_disk_refused_is_permanent_and_other_os_errors_are_not():
    """A full disk, a quota, ``ulimit -f``, a read-only mount: the restart would write the
    same file again. A connection refused may pass."""

    def raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
        try:
            try:
                raise cause or exc
            except BaseException as first:
                if cause is None:
                    raise
                raise exc from first
        except BaseException as caught:
            return caught

    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
        assert is_permanent(OSError(code, os.strerror(code)))
    full = OSError(errno.ENOSPC, "No space left on device")
    assert is_permanent(ExceptionGroup("writes", [raised(RuntimeError("save failed"), full)]))
    rust = RuntimeError("Error while serializing: I/O error: File too large (os error 27)")
    assert is_permanent(rust)  # safetensors' SafetensorError under ulimit -f
    assert not is_permanent(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    assert not is_permanent(raised(RuntimeError("retry"), TimeoutError()))
