"""Engines at urls, health-checked by the rollout side: one that fails ``/health_generate``
leaves the rotation, and before it serves again it is given the weights every other engine
has. Two real embedded engines behind the real HTTP server; one is made to fail its probe
(alive, answering ``/health``, but not generating), then killed and replaced by a fresh
engine that starts from the initial weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from asyncrl.engines.config import EngineConfig
from asyncrl.engines.server.app import EngineServer
from asyncrl.engines.torch.engine import TorchEngine
from asyncrl.rollout.engines import EngineHost
from asyncrl.wire.messages import WeightVersion
from tests.polling import until
from tests.test_sglang_client import free_port
from tests.tiny_model import build_tiny_model

SAMPLING = {"max_new_tokens": 2, "temperature": 0.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rotation") / "model"
    build_tiny_model(path)
    return path


def version_on_disk(model: Path, directory: Path, version: int) -> WeightVersion:
    """The model's own weights, published as ``version`` (as the trainer's disk transport)."""
    directory.mkdir(parents=True)
    shutil.copy(model / "model.safetensors", directory / "model.safetensors")
    return WeightVersion(version=version, transport="disk", location=str(directory))


async def serve(model: Path, port: int) -> EngineServer:
    server = EngineServer(TorchEngine.from_pretrained(str(model)))
    await server.start("127.0.0.1", port)
    return server


async def test_a_failing_engine_leaves_the_rotation_and_returns_with_the_current_weights(
    model: Path, tmp_path: Path
):
    ports = [free_port(), free_port()]
    a, b = [await serve(model, p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    config = EngineConfig(type="sglang", urls=urls, health_check_s=0.2)
    try:
        async with EngineHost(config) as host:
            client = host.client
            assert client is not None
            await host.load(version_on_disk(model, tmp_path / "v3", 3), receiver=None)
            assert (a.engine.version, b.engine.version) == (3, 3)

            # b is up (/health 200) but cannot generate: /health_generate fails.
            healthy_probe = b.probe

            async def broken(timeout_s: float = 0.0) -> None:
                raise TimeoutError("stuck")

            b.probe = broken  # type: ignore[method-assign]
            await until(lambda: client.transport.in_rotation() == [urls[0]])
            outs = [await client.generate([5, 6, 7], SAMPLING) for _ in range(6)]
            assert all(o.weight_version == 3 for o in outs)
            # A weight update meanwhile goes to the engines in rotation only.
            await host.load(version_on_disk(model, tmp_path / "v4", 4), receiver=None)
            assert (a.engine.version, b.engine.version) == (4, 3)

            # It passes again: it gets version 4 before it rejoins.
            b.probe = healthy_probe  # type: ignore[method-assign]
            await until(lambda: len(client.transport.in_rotation()) == 2)
            assert b.engine.version == 4

            # Killed: a weight update meanwhile takes it out instead of failing.
            await b.stop()
            await host.load(version_on_disk(model, tmp_path / "v5", 5), receiver=None)
            assert a.engine.version == 5 and client.transport.in_rotation() == [urls[0]]
            # Replaced by a fresh engine at version 0 on the same port: caught up first.
            b = await serve(model, ports[1])
            assert b.engine.version == 0
            await until(lambda: len(client.transport.in_rotation()) == 2)
            assert b.engine.version == 5
            outs = [await client.generate([5, 6, 7], SAMPLING, prefer=urls[1]) for _ in range(3)]
            assert all(o.weight_version == 5 for o in outs)
    finally:
        await a.stop()
        await b.stop()
