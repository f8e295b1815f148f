"""EngineActor: one inference server as an actor of its own (``rollout.engine.serve: actor``).

It serves the SGLang HTTP API on ``engine-i.http`` for rollout-i: the embedded
``TorchEngine`` in this process, or an SGLang or vLLM server it launches, tethered so that
the server dies with it (``runtime/tether.py``). A server that exits, or that fails
``HEALTH_FAILURES`` health checks in a row and passes none for ``unhealthy_after_s``, fails
the actor for the supervisor to restart (``docs/ray.md``, SGLang servers as engine actors).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
import zlib
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from asyncrl.actors.base import Actor
from asyncrl.actors.config import EngineActorConfig
from asyncrl.engines.config import EngineConfig
from asyncrl.observe.logs import get_logger

log = get_logger("asyncrl.engine")

#: Consecutive failed health checks that fail the actor.
HEALTH_FAILURES = 3
_LINE_LIMIT = 1024 * 1024


def engine_url(endpoint: str) -> str:
    """The HTTP base URL of an engine's ``tcp://host:port`` endpoint."""
    parts = urlsplit(endpoint)
    return f"http://{parts.hostname}:{parts.port}"


def sglang_command(cfg: EngineConfig, host: str, port: int, seed: str | None = None) -> list[str]:
    """The SGLang server's command line, tethered to this process (``runtime/tether.py``).

    No ``--dtype``: SGLang's own default (the checkpoint's dtype) is what a GPU server
    wants; ``--dtype`` in ``server_args`` sets it. ``--random-seed`` comes from
    ``seed`` (``rollout/engines.py::engine_seed``: the job's seed and this actor's name,
    None for a restarted incarnation) unless the server arguments set one: a rerun's
    servers sample as the first run's did, and two servers not in lockstep.
    """
    named = any(a.split("=")[0] == "--random-seed" for a in cfg.server_args)
    seeded = [] if seed is None or named else ["--random-seed", str(zlib.crc32(seed.encode()))]
    return [
        sys.executable, "-m", "asyncrl.runtime.tether",
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(cfg.model_path), "--host", host, "--port", str(port),
        *seeded, *cfg.server_args,
    ]  # fmt: skip


class EngineActor(Actor):
    """Starts one engine server and keeps checking its health; see the module docstring."""

    Config = EngineActorConfig
    config: EngineActorConfig

    async def setup(self) -> None:
        self.cfg = self.config.engine
        self.api_key = self.config.api_key
        parts = urlsplit(self.spec.endpoints[f"{self.name}.http"])
        host, port = str(parts.hostname), int(parts.port or 0)
        self.url = f"http://{host}:{port}"
        self.proc: asyncio.subprocess.Process | None = None
        self._output: deque[str] = deque(maxlen=40)
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.session = await self.hold(aiohttp.ClientSession(headers=auth))
        if self.cfg.type == "torch":
            await self._start_embedded(host, port)
        elif self.cfg.type == "vllm":
            await self._start_vllm(host, port)
        else:
            await self._start_sglang(host, port)
        log.info("engine serving", url=self.url, kind=self.cfg.type)

    async def _start_embedded(self, host: str, port: int) -> None:
        from asyncrl.engines.server.app import EngineServer
        from asyncrl.engines.torch.engine import TorchEngine
        from asyncrl.rollout.engines import engine_seed

        seed = engine_seed(self.cfg.seed, self.name, self.spec.incarnation.restarted)
        engine = await asyncio.to_thread(TorchEngine.from_config, self.cfg, seed=seed)
        if (threads := self.lent_threads()) is not None:
            engine.follow_threads(threads)
        self.server = EngineServer(
            engine, server_args={"host": host, "port": port}, api_key=self.api_key
        )
        await self.server.start(host, port)
        self._stack.push_async_callback(self.server.stop)

    async def _start_sglang(self, host: str, port: int) -> None:
        """``sglang_command`` with the job's key as ``--api-key``; ready once
        ``/health_generate`` answers 200."""
        from asyncrl.rollout.engines import engine_seed

        seed = engine_seed(self.cfg.seed, self.name, self.spec.incarnation.restarted)
        command = sglang_command(self.cfg, host, port, seed)
        key = ["--api-key", self.api_key] if self.api_key else []
        await self._launch(command, key, dict(os.environ), self.url)

    async def _start_vllm(self, host: str, port: int) -> None:
        """vLLM's server on a loopback port of its own, and ours on the actor's endpoint
        speaking SGLang's API over it (``engines/vllm/engine.py``). Ready once vLLM's
        ``/health`` answers 200 and our server has made its one-token warm-up through it."""
        from asyncrl.engines.server.app import EngineServer
        from asyncrl.engines.vllm.engine import VLLMEngine
        from asyncrl.engines.vllm.launch import vllm_command, vllm_env, vllm_python
        from asyncrl.rollout.engines import engine_seed

        seed = engine_seed(self.cfg.seed, self.name, self.spec.incarnation.restarted)
        inner = free_port()
        command = vllm_command(
            vllm_python(self.cfg.vllm_python),
            str(self.cfg.model_path),
            "127.0.0.1",
            inner,
            dtype=self.cfg.dtype,
            seed=seed,
            extra=self.cfg.server_args,
        )
        url = f"http://127.0.0.1:{inner}"
        tether = [sys.executable, "-m", "asyncrl.runtime.tether"]
        await self._launch([*tether, *command], [], vllm_env(), url, health="/health")
        engine = await VLLMEngine(url, model_path=str(self.cfg.model_path)).start()
        self._stack.push_async_callback(engine.close)
        self.server = EngineServer(
            engine,  # type: ignore[arg-type]
            server_args={"host": host, "port": port},
            api_key=self.api_key,
        )
        await self.server.start(host, port)
        self._stack.push_async_callback(self.server.stop)

    async def _launch(
        self,
        command: list[str],
        secret: list[str],
        env: dict[str, str],
        url: str,
        health: str = "/health_generate",
    ) -> None:
        """Start ``command`` (``secret`` appended, not logged) in its own process group and
        wait until ``url`` answers ``health`` with 200."""
        kind = self.cfg.type
        log.info(f"starting {kind}", command=" ".join(command))
        self.proc = await asyncio.create_subprocess_exec(
            *command,
            *secret,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # one group: stopping it stops its scheduler processes
            limit=_LINE_LIMIT,
        )
        self._stack.push_async_callback(self._stop_server)
        pump = asyncio.create_task(self._pump(), name=f"{self.name}.output")
        self._stack.push_async_callback(_cancel, pump)
        try:
            async with asyncio.timeout(self.cfg.startup_timeout):
                while not await self._healthy(limit_s=5.0, url=url, path=health):
                    self._check_alive()
                    await asyncio.sleep(1.0)
        except TimeoutError:
            raise RuntimeError(
                f"the {kind} server at {url} was not healthy within "
                f"{self.cfg.startup_timeout:.0f}s; last output: {list(self._output)[-5:]}"
            ) from None

    async def run(self) -> None:
        failures, passed = 0, time.monotonic()
        while not self.stopping:
            await asyncio.sleep(self.cfg.health_interval)
            self._check_alive()
            if await self._healthy(limit_s=self.cfg.health_interval * 2):
                failures, passed = 0, time.monotonic()
                continue
            failures += 1
            silent = time.monotonic() - passed
            if failures >= HEALTH_FAILURES and silent >= self.cfg.unhealthy_after_s:
                raise RuntimeError(
                    f"engine at {self.url} failed {failures} health checks in a row "
                    f"(none passed for {silent:.0f}s)"
                )

    def stats(self) -> dict[str, float]:
        return {"engine.pid": float(self.proc.pid if self.proc else os.getpid())}

    async def _healthy(
        self, *, limit_s: float, url: str | None = None, path: str = "/health_generate"
    ) -> bool:
        """``GET /health_generate`` (a one-token generation) answered 200."""
        try:
            async with self.session.get(
                f"{url or self.url}{path}", timeout=aiohttp.ClientTimeout(total=limit_s)
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.returncode is not None:
            raise RuntimeError(
                f"the {self.cfg.type} server exited with code {self.proc.returncode}; last output: "
                f"{list(self._output)[-5:]}"
            )

    async def _pump(self) -> None:
        """Copy the server's output into this actor's log (and keep the last lines)."""
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            try:
                line = await self.proc.stdout.readline()
            except ValueError:  # a line over the limit; asyncio dropped it, keep reading
                line = b"[asyncrl: an output line over the limit was dropped]\n"
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            self._output.append(text)
            print(text, file=sys.stderr, flush=True)

    async def _stop_server(self) -> None:
        """SIGTERM the server's process group, then SIGKILL after ``drain_timeout``; the
        group is killed even when its leader is gone (its scheduler processes may not be)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.spec.drain_timeout):
                await self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()


def free_port() -> int:
    """A loopback port free now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
