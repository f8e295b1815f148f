"""The engines a rollout actor generates with, and how new weights reach them.

``EngineConfig.type``:

- ``torch``: the embedded ``TorchEngine`` runs in the rollout actor's process behind the
  SGLang-compatible ``EngineServer`` on a loopback port; workflows reach it through the
  same ``SGLangClient`` as any engine (``in_process``: its non-stream ``/generate`` calls
  are direct calls into the server, not loopback HTTP). Weights are copied straight into
  the model at a decode-step boundary (any transport: pull, disk or dist).
- ``sglang``: SGLang servers (or an ``sglang-router``) at ``urls``, started elsewhere;
  weights go by ``/update_weights_from_disk`` (the ``disk`` transport).
- ``sim``: ``sim_engines`` ``SimEngine``s (no model, time from ``sim``'s latency model),
  each behind its own loopback server, the client rotating over them like over SGLang
  servers; their vocabulary and EOS come from ``model_path``'s ``config.json`` when given
  (so a real trainer can train on their tokens). Weight updates take modelled time.

``on_update``: ``continue`` keeps in-flight requests going (their later tokens carry the
new version; SGLang's ``in_place``), ``abort`` aborts them first so their partial
samples go back to the buffer and resume on the new weights. Colocated jobs ``sleep``
the engines (flush, release memory) before each train step and ``wake`` them for the new
weights. Used by ``actors/rollout.py``.

Engines at ``urls`` are health-checked (``health_check_s``): one that fails
``/health_generate`` leaves the client's rotation, and before it rejoins, ``catch_up``
loads into it the version every other engine has (under the same lock as ``load``, so a
returning engine never misses an update made meanwhile).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from asyncrl.engines.sglang_client import SGLangClient
from asyncrl.observe.logs import get_logger
from asyncrl.rollout.config import EngineConfig, sim_shape

log = get_logger("asyncrl.rollout")

if TYPE_CHECKING:
    import torch

    from asyncrl.engines.server import EngineServer
    from asyncrl.engines.sim_engine import SimEngine
    from asyncrl.engines.torch_engine import TorchEngine
    from asyncrl.trainers.weight_sync import WeightReceiver
    from asyncrl.wire.messages import WeightVersion


class EngineHost:
    """Starts (or connects to) the engines; ``client`` is what workflows generate with."""

    def __init__(
        self, config: EngineConfig, *, wait_ready_s: float | None = None, api_key: str | None = None
    ) -> None:
        self.config = config
        self.wait_ready_s = wait_ready_s  # engines started beside us: wait for their health
        self.api_key = api_key  # sent as Authorization: Bearer (engine actors' servers)
        self.engine: TorchEngine | SimEngine | None = None  # the first embedded engine
        self.sims: list[SimEngine] = []  # every sim engine (engine is the first)
        self.servers: list[EngineServer] = []
        self.client: SGLangClient | None = None
        self.version = 0
        self.last: WeightVersion | None = None  # the version every engine in rotation has
        self._loading = asyncio.Lock()

    async def __aenter__(self) -> EngineHost:
        urls = list(self.config.urls)
        if self.config.type == "torch":
            urls = [await self._start_embedded()]
        elif self.config.type == "sim":
            urls = [await self._start_sim() for _ in range(self.config.sim_engines)]
        external = self.config.type == "sglang" and self.config.serve == "embedded"
        health = self.config.health_check_s if external and not self.config.router else None
        client_config = SGLangClient.Config(api_key=self.api_key, health_check_s=health)
        local = {s.url: s.generate_local for s in self.servers} if self.config.in_process else {}
        self.client = SGLangClient(
            urls, router=self.config.router, config=client_config, local=local
        )
        self.client.on_return = self.catch_up
        await self.client.__aenter__()
        if self.wait_ready_s is not None:
            await self.wait_ready(self.wait_ready_s)
        return self

    async def wait_ready(self, limit_s: float) -> None:
        """Poll ``/health`` until every engine answers 200 (an engine actor still loading)."""
        assert self.client is not None
        try:
            async with asyncio.timeout(limit_s):
                while True:  # polling: the engine is another process, no event to await
                    if all((await self.client.health()).values()):
                        return
                    await asyncio.sleep(0.5)
        except TimeoutError:
            raise TimeoutError(
                f"engines {self.config.urls} not healthy within {limit_s:.0f}s"
            ) from None

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None:
            await self.client.__aexit__(None, None, None)
        for server in self.servers:
            await server.stop()

    async def _start_embedded(self) -> str:
        from asyncrl.engines.server import EngineServer
        from asyncrl.engines.torch_engine import TorchEngine

        cfg = self.config
        assert cfg.model_path is not None
        engine = await asyncio.to_thread(
            TorchEngine.from_pretrained,
            cfg.model_path,
            device=cfg.device,
            dtype=cfg.dtype,
            max_running=cfg.max_running,
        )
        self.engine = engine
        self.servers.append(EngineServer(engine))
        return await self.servers[-1].start("127.0.0.1", 0)

    async def _start_sim(self) -> str:
        """One more sim engine behind its own server (each draws its own lengths)."""
        from asyncrl.engines.server import EngineServer

        sim = _sim_engine(self.config, seed=len(self.sims))
        self.sims.append(sim)
        self.engine = self.engine or sim
        self.servers.append(EngineServer(sim))  # type: ignore[arg-type]
        return await self.servers[-1].start("127.0.0.1", 0)

    async def load_tensors(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy pulled ``tensors`` into the embedded engine as ``version``."""
        if self.engine is None:
            raise ValueError("only the embedded engine takes tensors; SGLang loads from disk")
        await self._update_embedded(tensors, version)
        self.version = version

    async def _update_embedded(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Every embedded engine takes ``version`` (the sim engines together)."""
        engines = self.sims or ([self.engine] if self.engine is not None else [])
        await asyncio.gather(*(e.update_weights_from_tensors(tensors, version) for e in engines))

    async def sleep(self) -> None:
        """Colocated training: drop cached KV, then release the engines' memory (weights
        off the accelerator), as slime does before a train step. Engines must be idle."""
        assert self.client is not None
        await self.client.flush_cache()
        await self.client.release_memory()

    async def wake(self) -> None:
        """Undo ``sleep`` (before new weights are loaded)."""
        assert self.client is not None
        await self.client.resume_memory()

    async def catch_up(self, url: str) -> None:
        """Before the engine at ``url`` rejoins the rotation: load the version the others
        have, unless it serves it already (it kept its weights through a network blip)."""
        assert self.client is not None
        async with self._loading:
            msg = self.last
            if msg is None or await self.client.weight_version(url) >= msg.version:
                return
            if msg.transport != "disk":
                raise ValueError(f"cannot bring {url} to version {msg.version}: not on disk")
            await self.client.update_weights_from_disk(msg.location, msg.version, url=url)
            log.warning("a returning engine was given the current weights", url=url,
                        version=msg.version)  # fmt: skip

    async def load(self, msg: WeightVersion, receiver: WeightReceiver) -> None:
        """Bring every engine (in rotation) to weight version ``msg.version``."""
        async with self._loading:
            await self._load(msg, receiver)
            self.last = msg
            if self.client is not None:
                self.client.expected_version = msg.version

    async def _load(self, msg: WeightVersion, receiver: WeightReceiver) -> None:
        assert self.client is not None
        if self.config.on_update == "abort":
            await self.client.abort(abort_all=True)
        if self.engine is not None:
            tensors = await receiver.fetch(msg)
            await self._update_embedded(tensors, msg.version)
        elif msg.transport == "disk":
            await self.client.update_weights_from_disk(msg.location, msg.version)
        else:
            raise ValueError(
                f"SGLang engines take weights from disk; the trainer publishes by "
                f"{msg.transport!r}: set the trainer's publish transport to disk"
            )
        self.version = msg.version


def _sim_engine(cfg: EngineConfig, *, seed: int = 0) -> SimEngine:
    """The sim engine of ``cfg``, with the vocabulary and EOS of ``model_path`` if any."""
    from asyncrl.engines.sim_engine import SimEngine

    shape = sim_shape(cfg.model_path) if cfg.model_path else {}
    return SimEngine(cfg.sim, max_running=cfg.max_running, seed=seed, **shape)
