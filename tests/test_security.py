"""CurveZMQ (``asyncrl.wire.security``): with the job's keys every channel works encrypted;
a peer without them can neither send nor receive; keys are made by ``asyncrl keys``; a
non-loopback bind needs them; a training job runs with every channel encrypted."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgspec
import psutil
import pytest
import zmq
import zmq.asyncio
import zmq.auth

from asyncrl.actors.base import is_permanent
from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.engines.server.app import EngineServer
from asyncrl.engines.torch.engine import TorchEngine
from asyncrl.errors import InputError
from asyncrl.job import run_job
from asyncrl.runtime.chaos import Chaos
from asyncrl.runtime.supervisor import Supervisor
from asyncrl.weights.config import check_group_host
from asyncrl.wire import framing, security
from asyncrl.wire.codec import WIRE_VERSION, Codec
from asyncrl.wire.messages import WeightVersion
from asyncrl.wire.pubsub import Publisher, Subscriber
from asyncrl.wire.reliable import ReliableReceiver, ReliableSender
from asyncrl.wire.sockets import bind
from tests.test_reliable import CODEC, item
from tests.test_train import (
    LONG_RUN,
    accounted,
    eval_flags,
    job_flags,
    last_buffer_metrics,
    lines,
    write_prompts,
)
from tests.tiny_model import build_tiny_model

WV = Codec(WeightVersion)


@pytest.fixture
def keys(tmp_path: Path) -> Iterator[security.JobKeys]:
    security.generate(tmp_path / "keys")
    yield security.enable(tmp_path / "keys")
    security.disable()


def stranger(tmp_path: Path, kind: int, curve: bool) -> zmq.asyncio.Socket:
    """A raw socket of a peer that knows the job's public key but holds another key pair
    (``curve``), or speaks plain ZeroMQ."""
    sock = zmq.asyncio.Context.instance().socket(kind)
    sock.linger = 0
    if curve:
        _, secret_file = zmq.auth.create_certificates(tmp_path, "stranger")
        public, secret = zmq.auth.load_certificate(secret_file)
        job = security.active()
        assert job is not None
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = (
            public,
            secret,
            job.public,
        )
    return sock


async def test_channels_work_encrypted_with_the_job_keys(keys, endpoint: str):
    async with ReliableReceiver(endpoint, CODEC) as rx, ReliableSender(rx.endpoint, CODEC) as tx:
        for i in range(100):
            await tx.send(item(i))
        seen: list[int] = []
        async with asyncio.timeout(20):
            while len(seen) < 100:
                batch = await rx.receive_batch()
                seen += [m.uid for m in batch]
                batch.ack()
            await tx.join()
    assert seen == list(range(100))
    async with (
        Publisher(endpoint, endpoint, WV) as pub,
        Subscriber(pub.endpoint, pub.snapshot_endpoint, WV, ["weights"]) as sub,
    ):
        pub.publish("weights", WeightVersion(version=7, transport="disk", location="/w"))
        async with asyncio.timeout(10):
            assert (await sub.receive()).msg.version == 7


@pytest.mark.parametrize("curve", [True, False], ids=["another-key", "plain"])
async def test_a_peer_without_the_job_key_can_neither_send_nor_receive(
    keys, endpoint: str, tmp_path: Path, curve: bool
):
    async with ReliableReceiver(endpoint, CODEC) as rx:
        body, _ = CODEC.encode_parts(item(1))
        frame = framing.pack(framing.Request(v=WIRE_VERSION, id=1, nbuf=0, body=msgspec.Raw(body)))
        queued = 0
        # connect() attaches the DEALER's pipe at once, so a send right after it queues;
        # a refused handshake can leave the socket without a pipe for good (no send queued
        # in 3 s after one, measured), so a try that lost that race takes a new socket.
        async with asyncio.timeout(10):
            while not queued:
                intruder = stranger(tmp_path, zmq.DEALER, curve)
                intruder.connect(rx.endpoint)
                try:
                    await intruder.send(frame, flags=zmq.NOBLOCK)
                    queued += 1
                except zmq.Again:
                    intruder.close()
                    await asyncio.sleep(0.01)
        assert queued > 0  # sent on its way: the receiver's silence is the refusal
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.0):
                await rx.receive_batch()
        intruder.close()
        # The same receiver takes the job's own sender at once: the silence above was
        # the intruder's, not a broken channel.
        async with ReliableSender(rx.endpoint, CODEC) as tx:
            await tx.send(item(2))
            async with asyncio.timeout(10):
                assert [m.uid for m in await rx.receive_batch()] == [2]
    async with Publisher(endpoint, endpoint, WV) as pub:
        eavesdropper = stranger(tmp_path, zmq.SUB, curve)
        eavesdropper.subscribe(b"")
        eavesdropper.connect(pub.endpoint)
        for v in range(30):
            pub.publish("weights", WeightVersion(version=v, transport="disk", location="/w"))
            await asyncio.sleep(0.03)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await eavesdropper.recv_multipart()
        eavesdropper.close()


def test_asyncrl_keys_makes_a_certificate_and_never_overwrites_one(tmp_path: Path, capsys):
    assert main(["keys", str(tmp_path / "k")]) == 0
    secret = tmp_path / "k" / "job.key_secret"
    assert (tmp_path / "k" / "job.key").is_file() and secret.is_file()
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert security.load(tmp_path / "k").public in secret.read_bytes()
    before = secret.read_bytes()
    assert main(["keys", str(tmp_path / "k")]) == 2
    assert "already holds a job certificate" in capsys.readouterr().err
    assert secret.read_bytes() == before


def _a_non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent; picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_the_weight_group_listens_beyond_loopback_only_on_a_trusted_network():
    """torch's store and gloo have no keys: a dist group served on another address (an
    explicit group address, a multi-node Ray job) needs the network marked trusted."""
    for address in ("127.0.0.1:29500", "tcp://127.0.0.5:1", "localhost:1", "[::1]:1"):
        check_group_host(address, trusted=False)
    for address in ("10.0.0.1:29500", "tcp://[2001:db8::1]:1", "trainer-node:29500"):
        with pytest.raises(InputError, match="take no key"):
            check_group_host(address, trusted=False)
        check_group_host(address, trusted=True)
    assert is_permanent(InputError("x"))  # the trainer's set-up fails once, not restarted


async def test_a_non_loopback_bind_needs_the_job_keys(tmp_path: Path):
    address = _a_non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    with pytest.raises(ValueError, match="not on loopback"):
        bind(sock, f"tcp://{address}:0")
    sock.close()
    security.generate(tmp_path / "keys")
    security.enable(tmp_path / "keys")
    try:
        async with (
            ReliableReceiver(f"tcp://{address}:0", CODEC) as rx,
            ReliableSender(rx.endpoint, CODEC) as tx,
        ):
            await tx.send(item(5))
            async with asyncio.timeout(10):
                assert [m.uid for m in await rx.receive_batch()] == [5]
    finally:
        security.disable()


@pytest.mark.slow
async def test_a_training_job_runs_with_every_channel_encrypted(tmp_path: Path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    security.generate(tmp_path / "keys")
    flags = [*job_flags(tmp_path, steps=3), "--wire.curve-keys", str(tmp_path / "keys")]
    result = await run_job(load_config(overrides=flags))
    assert result.ok, result.error
    assert security.active() is None  # the job turned CURVE off again in this process
    run_dir = tmp_path / "run"
    assert accounted(last_buffer_metrics(run_dir))
    for actor in ("buffer", "rollout-0", "trainer"):
        events = [json.loads(x)["event"] for x in lines(run_dir / "logs" / f"{actor}.jsonl")]
        assert "curve enabled" in events, actor


def test_no_wire_module_can_unpickle():
    """Nothing on a wire is pickled: no channel module imports a pickle-based decoder."""
    import asyncrl.wire

    banned = re.compile(r"^\s*(import|from)\s+(pickle|cPickle|cloudpickle|dill|marshal|shelve)\b"
                        r"|torch\.load\(|pickle\.loads?\(", re.M)  # fmt: skip
    wire = Path(asyncrl.wire.__file__).parent
    found = {p.name: banned.findall(p.read_text()) for p in wire.glob("*.py")}
    assert {name: hits for name, hits in found.items() if hits} == {}
    assert len(found) >= 10  # the scan saw the package


def _listening(process: psutil.Process, name: str) -> list[tuple[str, str, int]]:
    """``(name, address, port)`` of each socket ``process`` listens on (none once gone)."""
    try:
        conns = process.net_connections(kind="inet")
    except psutil.NoSuchProcess:
        return []
    return [(name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]


class ProbeListeners(Chaos):
    """Once the trainer has stepped twice, records every listening socket of the job's
    processes and what each HTTP listener answers without a key; then ends the job."""

    def __init__(
        self, run_dir: Path, routes: list[tuple[str, str]], before: list[tuple[str, str, int]]
    ) -> None:
        super().__init__([])
        self.run_dir, self.routes = run_dir, routes
        self.before = set(before)  # the test process's own (earlier tests'), not the job's
        self.listeners: list[tuple[str, str, int]] = []  # actor, address, port
        self.answers: dict[tuple[int, str, str], int] = {}  # (port, method, path) -> status
        self.error = ""
        self.done = False  # the probe ran to its end (a job that ends first cancels it)

    async def run(self, sup: Supervisor) -> None:
        try:  # the job swallows a chaos task's error: keep it for the test to show
            await self._probe(sup)
        except Exception as exc:
            self.error = repr(exc)
            raise

    async def _probe(self, sup: Supervisor) -> None:
        await sup.wait_until(lambda _: sup.up)
        await sup.wait_until(lambda st: st["trainer"].version >= 2)
        mine = _listening(psutil.Process(), "controller")  # alone: the actors
        self.listeners += [x for x in mine if x not in self.before]
        for name, handle in sup.handles.items():  # are its children, and so are others'
            assert handle.pid is not None
            actor = psutil.Process(handle.pid)
            for process in [actor, *actor.children(recursive=True)]:
                self.listeners += _listening(process, name)
        timeout = aiohttp.ClientTimeout(total=60)  # /health generates a token under load
        async with aiohttp.ClientSession(timeout=timeout) as http, asyncio.TaskGroup() as tg:
            for _, address, port in self.listeners:  # at once: a silent peer costs 5 s
                tg.create_task(self._try_routes(http, f"http://{address}:{port}", port))
        self.done = True
        await self._stop_trainer(sup, "probed")

    async def _try_routes(self, http: aiohttp.ClientSession, url: str, port: int) -> None:
        # "/" needs no engine work (a 401 or 404 at once; /health generates a token). A
        # ZeroMQ peer keeps the connection open and never answers: a few seconds tell.
        try:
            async with http.get(url + "/", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            return  # not HTTP: a ZeroMQ channel, the weight group's store or gloo
        for method, path in self.routes:
            async with http.request(method, url + path, json={"abort_all": True}) as resp:
                self.answers[(port, method, path)] = resp.status


@pytest.mark.slow
async def test_every_listener_of_a_job_is_on_loopback_and_its_http_routes_need_a_key(
    tmp_path: Path,
):
    """With the dist weight group (whose store torch binds to every interface unless it
    is handed a bound socket), an eval actor and an engine actor: each listening socket
    is on loopback, and each route of each engine's HTTP API but /health is a 401."""
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    model = str(tmp_path / "model")
    app = EngineServer(TorchEngine.from_pretrained(model)).app
    routes = sorted({(r.method, r.resource.canonical) for r in app.router.routes()
                     if r.method != "HEAD" and r.resource is not None})  # fmt: skip
    flags = [*job_flags(tmp_path, steps=400), *LONG_RUN, *eval_flags(tmp_path, 1000),
             "--update-weight-transport", "dist", "--rollout.num-actors", "2",
             "--rollout.engine.model-path", model, "--rollout.engine.serve", "actor",
             "--num-epoch", "1000"]  # fmt: skip
    before = _listening(psutil.Process(), "controller")
    probe = ProbeListeners(tmp_path / "run", routes, before)  # it, not the data, ends the job
    result = await run_job(load_config(overrides=flags), chaos=probe)
    assert result.ok, result.error
    assert not probe.error, probe.error
    assert probe.done, "the job ended before the probe did"
    actors = {name for name, _, _ in probe.listeners}
    assert {"controller", "buffer", "trainer", "eval", "engine-0", "engine-1"} <= actors, actors
    exposed = [x for x in probe.listeners if x[1] not in ("127.0.0.1", "::1")]
    assert not exposed, exposed
    servers = {port for port, _, _ in probe.answers}
    assert len(servers) == 3, probe.listeners  # the engine actors' and the eval actor's
    opened = {k: v for k, v in probe.answers.items() if (v != 401) != (k[2] == "/health")}
    assert not opened, opened
