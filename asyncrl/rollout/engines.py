"""The engines a rollout actor generates with, and how new weights reach them.

``EngineHost`` runs the embedded engines (``torch``, ``sim``) behind loopback SGLang-API
servers, puts such a server in front of each vLLM server, or connects to SGLang servers at
``urls``. It is the one owner of their weights: ``version`` and ``last`` change only under
its loading lock, so an engine that rejoins the rotation (``catch_up``) or restarted
(``reload``) never misses an update made meanwhile. Transports: docs/design.md section 6.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from asyncrl.engines.client.sglang import SGLangClient, SGLangError
from asyncrl.engines.config import EngineConfig, sim_shape
from asyncrl.engines.context_bound import ContextBound
from asyncrl.errors import EngineError
from asyncrl.observe.logs import get_logger
from asyncrl.rollout.server_group import ServerGroup, server_buckets
from asyncrl.weights.share import HOST, check_shared
from asyncrl.wire.errors import PeerLost, RemoteError

log = get_logger("asyncrl.rollout")

if TYPE_CHECKING:
    import torch

    from asyncrl.cores import LentThreads
    from asyncrl.engines.base import InferenceEngine, PauseMode
    from asyncrl.engines.server.app import EngineServer
    from asyncrl.engines.sim.engine import SimEngine
    from asyncrl.rollout.base import Generator
    from asyncrl.weights.sync import WeightReceiver
    from asyncrl.wire.messages import WeightVersion


class EngineHost:
    """Starts (or connects to) the engines and owns their weights (module docstring).

    ``generator`` is what workflows generate with (``InProcessGenerator`` for embedded
    engines with ``in_process``, else the client); ``client`` makes the control calls
    (abort, pause, memory, weights) on every engine.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        wait_ready_s: float | None = None,
        api_key: str | None = None,
        spill_dir: Path | None = None,
        seed: str | None = None,
        threads: LentThreads | None = None,
    ) -> None:
        self.config = config
        self.threads = threads  # an embedded CPU engine's thread count (``cores.py``)
        self.seed = seed  # the embedded torch engine's sampling stream (``engine_seed``)
        self.spill_dir = spill_dir  # dist into servers: versions that go by disk instead
        self.server_group: ServerGroup | None = None  # dist into servers: set by the actor
        self._receiver: WeightReceiver | None = None
        self.wait_ready_s = wait_ready_s  # engines started beside us: wait for their health
        self.api_key = api_key  # sent as Authorization: Bearer (engine actors' servers)
        # The key of the servers started here (their loopback ports are open to every
        # local user): made per host, known only to this process.
        self.local_key = secrets.token_urlsafe(24)
        self.engine: InferenceEngine | None = None  # the first embedded engine
        self.sims: list[SimEngine] = []  # every sim engine (engine is the first)
        self.servers: list[EngineServer] = []
        self.client: SGLangClient | None = None
        self.generator: Generator | None = None
        self.version = 0  # the version the engines serve; 0 until the first load
        self.last: WeightVersion | None = None  # its announcement (None: not loaded by us)
        self._loading = asyncio.Lock()  # one weight load at a time into the engines

    async def __aenter__(self) -> EngineHost:
        urls = list(self.config.urls)
        if self.config.type == "torch":
            urls = [await self._start_embedded()]
        elif self.config.type == "sim":
            urls = [await self._start_sim() for _ in range(self.config.sim_engines)]
        elif self.config.type == "vllm":
            urls = [await self._start_vllm(url) for url in urls]
        external = self.config.type in ("sglang", "vllm") and self.config.serve == "embedded"
        health = self.config.health_check_s if external and not self.config.router else None
        key = self.local_key if self.servers else self.api_key
        client_config = SGLangClient.Config(api_key=key, health_check_s=health)
        self.client = SGLangClient(urls, router=self.config.router, config=client_config)
        self.client.transport.on_return = self.catch_up
        await self.client.__aenter__()
        self.generator = self.client
        if self.servers and self.config.in_process:
            from asyncrl.engines.server.in_process import InProcessGenerator

            self.generator = InProcessGenerator(self.servers)
        if self.wait_ready_s is not None:
            await self.wait_ready(self.wait_ready_s)
        if (context := await self._context_length()) is not None:
            self.generator = ContextBound(self.generator, context)
        return self

    async def _context_length(self) -> int | None:
        """The smallest context of the engines: an embedded one's own, a server's from
        ``/get_server_info`` (``context_length``, else ``max_req_input_len + 1``); None
        when a server does not say (its requests then go as asked)."""
        if self.engine is not None or self.servers:
            engines = [self.engine] if self.engine is not None else []
            return min(int(e.context_length) for e in [*engines, *(s.engine for s in self.servers)])
        assert self.client is not None
        try:
            info = await self.client.server_info()
        except Exception as exc:  # an old or odd server: no bound
            log.warning("no context length from the engine", error=str(exc))
            return None
        context = info.get("context_length")
        if not isinstance(context, int) and isinstance(info.get("max_req_input_len"), int):
            context = info["max_req_input_len"] + 1
        return context if isinstance(context, int) else None

    async def wait_ready(self, limit_s: float) -> None:
        """Poll ``/health`` until every engine answers 200 (an engine actor still loading)."""
        assert self.client is not None
        try:
            async with asyncio.timeout(limit_s):
                while True:  # polling: the engine is another process, no event to await
                    if all((await self.client.transport.health()).values()):
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
            if hasattr(server.engine, "close"):  # a VLLMEngine's HTTP session
                await server.engine.close()

    async def _start_embedded(self) -> str:
        from asyncrl.engines.server.app import EngineServer
        from asyncrl.engines.torch.engine import TorchEngine

        cfg = self.config
        assert cfg.model_path is not None
        engine = await asyncio.to_thread(TorchEngine.from_config, cfg, seed=self.seed)
        if self.threads is not None:
            engine.follow_threads(self.threads)
        self.engine = engine
        self.servers.append(EngineServer(engine, api_key=self.local_key))
        return await self.servers[-1].start("127.0.0.1", 0)

    async def _start_vllm(self, url: str) -> str:
        """A vLLM server at ``url`` behind a loopback SGLang-API server of ours
        (``engines/vllm/engine.py``): the rollout side treats it as any server."""
        from asyncrl.engines.server.app import EngineServer
        from asyncrl.engines.vllm.engine import VLLMEngine

        engine = VLLMEngine(url, model_path=self.config.model_path, api_key=self.api_key)
        server = EngineServer(await engine.start(), api_key=self.local_key)  # type: ignore[arg-type]
        self.servers.append(server)
        return await self.servers[-1].start("127.0.0.1", 0)

    async def _start_sim(self) -> str:
        """One more sim engine behind its own server (each draws its own lengths)."""
        from asyncrl.engines.server.app import EngineServer

        sim = _sim_engine(self.config, seed=len(self.sims))
        self.sims.append(sim)
        self.engine = self.engine or sim
        self.servers.append(EngineServer(sim, api_key=self.local_key))  # type: ignore[arg-type]
        return await self.servers[-1].start("127.0.0.1", 0)

    async def abort_prefix(self, prefix: str) -> None:
        """Abort every request whose rid starts with ``prefix``: in the embedded engines
        of this process directly, and each call sent over HTTP by its exact rid (an
        SGLang server aborts only a rid that is live)."""
        for server in self.servers:
            server.engine.abort(prefix, prefix=True)
        if self.client is not None:
            await self.client.abort_prefix(prefix)

    async def load_tensors(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy pulled ``tensors`` into the embedded engine as ``version``."""
        if self.engine is None:
            raise ValueError("only the embedded engine takes tensors; SGLang loads from disk")
        async with self._loading:
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
        have, unless it serves it already (it kept its weights through a network blip).
        Under the loading lock, so an update made meanwhile is not missed."""
        assert self.client is not None
        async with self._loading:
            msg = self.last
            if msg is None or await self.client.weight_version(url) >= msg.version:
                return
            if msg.transport in ("dist", "ipc") and self._receiver is not None:
                await self._via_disk(msg, self._receiver, url=url)
            elif msg.transport != "disk":
                raise ValueError(f"cannot bring {url} to version {msg.version}: not on disk")
            else:
                await self.client.weights.update_weights_from_disk(
                    msg.location, msg.version, url=url
                )
            log.warning(
                "a returning engine was given the current weights", url=url, version=msg.version
            )

    async def load(self, msg: WeightVersion, receiver: WeightReceiver | None) -> bool:
        """Bring every engine (in rotation) to weight version ``msg.version``.

        False when that version is gone before it could be loaded (the trainer stopped,
        dropped it, or pruned its files): a newer announcement follows, so wait for it.
        """
        async with self._loading:
            return await self._load_gone_ok(msg, receiver)

    async def reload(self, receiver: WeightReceiver | None) -> int:
        """An engine actor restarted with its initial weights: if it serves an older version
        than ours, load ours again. If that version is gone, the engines say version 0
        until the next announcement is loaded (so the buffer hands out no work for them).
        Returns the version the engines serve now."""
        assert self.client is not None
        async with self._loading:
            serving, msg = await self.client.weight_version(), self.last
            if msg is None or serving >= msg.version:
                return serving
            self.version = 0
            log.warning("a restarted engine serves old weights", engine=serving, ours=msg.version)
            return msg.version if await self._load_gone_ok(msg, receiver) else 0

    async def _load_gone_ok(self, msg: WeightVersion, receiver: WeightReceiver | None) -> bool:
        try:
            await self._load(msg, receiver)
        except (PeerLost, RemoteError) as exc:
            log.warning("weights not loaded", version=msg.version, error=str(exc))
            return False
        except SGLangError as exc:
            if msg.transport != "disk" or await asyncio.to_thread(Path(msg.location).exists):
                raise
            log.warning("weights gone before loading", version=msg.version, error=str(exc))
            return False
        self.last, self.version = msg, msg.version
        assert self.client is not None
        self.client.transport.expected_version = msg.version
        return True

    async def _load(self, msg: WeightVersion, receiver: WeightReceiver | None) -> None:
        assert self.client is not None
        if self.config.on_update == "abort":
            await self.client.abort(abort_all=True)
        if self.engine is not None:
            if receiver is None:
                raise ValueError(f"version {msg.version}: an embedded engine needs a receiver")
            if self._in_place(msg):

                async def fill(params: dict[str, torch.Tensor]) -> object:
                    return await receiver.fetch(msg, out=params)

                await self.engine.update_weights_in_place(fill, msg.version)  # type: ignore[union-attr]
                return
            tensors = await receiver.fetch(msg)
            await self._update_embedded(tensors, msg.version)
        elif msg.transport == "disk":
            await self.client.weights.update_weights_from_disk(msg.location, msg.version)
        elif msg.transport == "dist" and receiver is not None:
            await self._load_dist(msg, receiver)
        elif msg.transport == "ipc" and receiver is not None:
            await self._load_shared(msg, receiver)
        else:
            raise ValueError(
                f"SGLang engines take weights from disk or by broadcast; the trainer "
                f"publishes by {msg.transport!r}: set --update-weight-transport disk or dist"
            )

    async def _load_dist(self, msg: WeightVersion, receiver: WeightReceiver) -> None:
        """A ``dist`` version into servers: by broadcast when the engines are in its group,
        else (or when the broadcast fails) from disk (``server_group.py``)."""
        assert self.client is not None and msg.manifest is not None
        self._receiver = receiver
        group = self.server_group
        name = await group.for_version(msg.group, msg.formed) if group is not None else None
        if name is not None:
            start = time.perf_counter()
            try:
                await self.client.update_weights(
                    msg.version,
                    buckets=server_buckets(msg.manifest),
                    broadcast=_sent_by_trainer,
                    group_name=name,
                    pause_mode=self._pause_mode,
                )
                receiver.counts["broadcast"] += 1
                log.info(
                    "weights broadcast into the engines",
                    version=msg.version,
                    pause_s=round(time.perf_counter() - start, 4),
                )
                return
            except SGLangError as exc:  # a member died: the engines stay paused, part new
                assert group is not None
                await group.failed(exc)
        elif await self.client.weight_version() >= msg.version:
            return  # e.g. version 0 at the start: the engines load it themselves
        await self._via_disk(msg, receiver)

    async def _load_shared(self, msg: WeightVersion, receiver: WeightReceiver) -> None:
        """An ``ipc`` version into servers on the trainer's host: its handles go to
        ``/update_weights_from_tensor`` as they are; elsewhere, or once dropped, by disk."""
        assert self.client is not None
        self._receiver = receiver
        if msg.host == HOST and receiver.shared:
            start = time.perf_counter()
            try:
                # The servers cannot tell a refilled slot: check its stamp around them.
                await asyncio.to_thread(check_shared, msg.handles, msg.version)
                await self.client.update_weights(
                    msg.version, payloads=msg.handles, pause_mode=self._pause_mode
                )
                await asyncio.to_thread(check_shared, msg.handles, msg.version)
                receiver.counts["shared"] += 1
                log.info(
                    "shared weights into the engines",
                    version=msg.version,
                    pause_s=round(time.perf_counter() - start, 4),
                )
                return
            except (SGLangError, EngineError) as exc:  # dropped meanwhile, or refilled
                log.warning(
                    "shared weights not taken; from disk instead",
                    version=msg.version,
                    error=str(exc),
                )
        await self._via_disk(msg, receiver)

    @property
    def _pause_mode(self) -> PauseMode:
        return "abort" if self.config.on_update == "abort" else "in_place"

    async def _via_disk(
        self, msg: WeightVersion, receiver: WeightReceiver, *, url: str | None = None
    ) -> None:
        """Pull ``msg`` from the trainer, write it under ``spill_dir``, and load it from
        there into one engine (``url``) or all, continuing any paused by a failed update."""
        assert self.client is not None
        if self.spill_dir is None:
            raise ValueError(f"version {msg.version} cannot go by broadcast, and no spill_dir")
        pulled = msgspec.structs.replace(msg, transport="pull", handles=[])
        tensors = await receiver.fetch(pulled)
        path = await asyncio.to_thread(spill, self.spill_dir, msg.version, tensors)
        del tensors
        await self.client.update_weights(
            msg.version, path=str(path), pause_mode=self._pause_mode, url=url
        )
        receiver.counts["pulled"] += 1
        log.warning(
            "weights went to the engines from disk, not by broadcast",
            version=msg.version,
            path=str(path),
        )

    @property
    def lineage(self) -> str:
        """The trainer whose version the engines serve (``WeightVersion.trainer``; empty
        before our first load)."""
        return self.last.trainer if self.last is not None else ""

    @property
    def torn(self) -> bool:
        """An in-place update failed midway: the engine aborts every request until a
        complete version is loaded (``TorchEngine.update_weights_in_place``)."""
        return bool(getattr(self.engine, "torn", False))

    def _in_place(self, msg: WeightVersion) -> bool:
        """Pull, dist and ipc versions go straight into one torch engine's model (no
        staged copy) when ``update_in_place`` and the tensors match the model's."""
        takes = getattr(self.engine, "takes_in_place", None)
        return (
            self.config.update_in_place
            and msg.transport in ("pull", "dist", "ipc")
            and takes is not None
            and takes(msg.manifest)
        )


def engine_seed(seed: int | None, name: str, restarted: bool) -> str | None:
    """An embedded engine's sampling stream: ``seed`` and the actor's ``name``, so two
    actors' engines never sample in lockstep and a rerun with the same seed replays its
    draws; None (fresh OS entropy) for a restarted incarnation, which should not replay
    whatever its predecessor drew before it died."""
    return None if seed is None or restarted else f"{seed}/{name}"


def _sent_by_trainer(bucket: object) -> None:
    """The trainer broadcasts every bucket on its own: the servers only need the calls."""


def spill(root: Path, version: int, tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``tensors`` as the disk transport writes a version (``disk_path``, whole or
    not at all), and remove older versions there."""
    from asyncrl.weights.sync import disk_path, write_version_dir

    final = disk_path(root, version)
    write_version_dir(final, tensors)
    for old in root.glob("weight_v*"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _sim_engine(cfg: EngineConfig, *, seed: int = 0) -> SimEngine:
    """The sim engine of ``cfg``, with the vocabulary and EOS of ``model_path`` if any."""
    from asyncrl.engines.sim.engine import SimEngine

    shape = sim_shape(cfg.model_path) if cfg.model_path else {}
    return SimEngine(cfg.sim, max_running=cfg.max_running, seed=seed, **shape)
