"""Ray runtime: every actor is a Ray actor, placed by its role's resources (``--runtime ray``).

``place`` reserves a placement group per role (``runtime.ray.roles``) and starts an
``ActorHost`` per actor in its bundle; ``start`` runs the actor in that host's event loop.
A channel binds on the node of the actor that owns it, on a port a host there found free
(beyond one host only with CurveZMQ). A worker that dies ends its actor with
``WORKER_LOST`` and Ray's cause. ``docs/ray.md`` has placement, addresses and failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
from collections import defaultdict, deque
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec

from asyncrl.actors.base import ActorSpec
from asyncrl.config import RayConfig
from asyncrl.observe.logs import get_logger
from asyncrl.runtime.topology import binder, endpoint_names

log = get_logger("asyncrl.runtime.ray")

#: Exit code reported for an actor whose Ray worker died (the cause says how).
WORKER_LOST = 1
_TRIES_FOR_DISTINCT_PORTS = 5


class ActorHost:
    """Runs one asyncrl actor inside a Ray worker process (used as a Ray actor class)."""

    def __init__(self, cwd: str, out_path: str) -> None:
        if os.path.isdir(cwd):  # relative paths in the config mean what they mean locally
            os.chdir(cwd)
        _redirect_output(out_path)
        self.actor: Any = None
        self.stop_requested = False
        import ray

        ctx = ray.get_runtime_context()
        print(  # where this incarnation ran, for the reader of <actor>.out
            f"asyncrl: ray node {ctx.get_node_id()} ({ray.util.get_node_ip_address()}), "
            f"worker pid {os.getpid()}",
            flush=True,
        )

    async def node(self) -> dict[str, Any]:
        """Where this host runs: Ray node id, node address, hostname and pid."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
        }

    async def endpoints(self, names: list[str], host: str | None) -> dict[str, str]:
        """A free ``tcp://host:port`` on this node for each of ``names`` (``host`` None:
        this node's address, as Ray knows it)."""
        import ray

        from asyncrl.wire.sockets import free_tcp_endpoint

        host = host or ray.util.get_node_ip_address()
        return {name: free_tcp_endpoint(host) for name in names}

    async def run(self, raw: bytes) -> int:
        """Build the actor from its JSON spec and run its lifecycle; its exit code."""
        from asyncrl.runtime.child import load_actor, raise_open_file_limit

        raise_open_file_limit()  # as the local runtime's children do
        try:
            self.actor = load_actor(raw)
        except ValueError as exc:
            print(f"asyncrl actor: {exc}", flush=True)
            return 2
        if self.stop_requested:  # asked to stop while it was loading
            self.actor.request_stop("runtime stop")
        return int(await self.actor.main())

    async def stop(self) -> None:
        """Ask the actor to drain and stop (what SIGTERM does to a local actor)."""
        self.stop_requested = True
        if self.actor is not None:
            self.actor.request_stop("runtime stop")


def _redirect_output(path: str) -> None:
    """Send this process's stdout and stderr (fds 1 and 2) to ``path``, appended."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:  # no such folder on this node: Ray's worker logs keep the output
        return
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)


class RayActor:
    """One actor running in a Ray worker (implements ``runtime.base.ActorHandle``)."""

    def __init__(self, spec: ActorSpec, host: Any, info: dict[str, Any], out_path: Path) -> None:
        self.spec, self.host, self.info, self.out_path = spec, host, info, out_path
        self.cause: str | None = None
        self._code: int | None = None
        self.finished: asyncio.Task[int] | None = None

    @property
    def pid(self) -> int | None:
        """The Ray worker's pid."""
        return self.info.get("pid")

    @property
    def node_id(self) -> str:
        """The Ray node the actor runs on."""
        return str(self.info.get("node_id", ""))

    @property
    def exit_code(self) -> int | None:
        """None while running; the actor's exit code, or ``WORKER_LOST``."""
        return self._code

    async def wait(self) -> int:
        """Wait for the actor to end; its exit code."""
        assert self.finished is not None, "wait() on an actor that was never started"
        return await asyncio.shield(self.finished)

    async def follow(self, ref: Any) -> int:
        """Await the host's ``run`` and record how it ended; then free the worker."""
        import ray

        try:
            self._code = int(await ref)
        except ray.exceptions.RayActorError as exc:
            self._code, self.cause = WORKER_LOST, _ray_cause(exc)
        except ray.exceptions.RayError as exc:  # the host itself raised
            self._code, self.cause = WORKER_LOST, f"ray: {type(exc).__name__}: {exc}"
        with contextlib.suppress(Exception):
            ray.kill(self.host, no_restart=True)
        return self._code

    def tail(self, n: int = 40) -> list[str]:
        """The last ``n`` lines of the actor's console output (when this host can read it)."""
        try:
            with self.out_path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * 1024))
                lines = deque(f.read().decode(errors="replace").splitlines(), maxlen=n)
        except OSError:
            return []
        return list(lines)


def _ray_cause(exc: BaseException) -> str:
    """Ray's account of an actor's death, without its troubleshooting boilerplate."""
    text = " ".join(str(exc).split())
    for marker in ("The actor is dead because", "Worker exit type"):
        at = text.find(marker)
        if at >= 0:
            return "ray: " + text[at:].split(" Some common causes")[0][:400]
    return f"ray: {type(exc).__name__}: {text[:400]}"


class RayRuntime:
    """Starts actors as Ray actors; use as ``async with RayRuntime(dir, cfg.runtime.ray)``."""

    def __init__(self, run_dir: str | Path, config: RayConfig, *, host: str = "127.0.0.1"):
        self.run_dir = Path(run_dir).resolve()
        self.config = config
        self.host = host
        self.actors: list[RayActor] = []
        self._hosts: dict[str, Any] = {}  # placed, not yet started
        self._options: dict[str, dict[str, Any]] = {}  # actor name -> Ray options
        self._groups: list[Any] = []
        self._started_ray = False
        self.controller_host = host  # the control server's address (the node IP multi-host)
        self._tg = asyncio.TaskGroup()

    async def __aenter__(self) -> RayRuntime:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        import ray

        if ray.is_initialized():
            for actor in self.actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor.host, no_restart=True)
            for host in self._hosts.values():
                with contextlib.suppress(Exception):
                    ray.kill(host, no_restart=True)
            for group in self._groups:
                with contextlib.suppress(Exception):
                    ray.util.remove_placement_group(group)
        try:
            return await self._tg.__aexit__(et, exc, tb)
        finally:
            if self._started_ray:
                await asyncio.to_thread(ray.shutdown)

    # -- placing ----------------------------------------------------------------------
    async def place(self, specs: Sequence[ActorSpec]) -> dict[str, str]:
        """Reserve each actor's resources, start its host, and return the job's endpoints,
        each on the node of the actor that binds it."""
        await self._connect(specs)
        bind_host = await asyncio.to_thread(self._bind_host)
        await self._reserve(specs)
        engines = {s.name: s for s in specs if s.role == "engine"}
        for spec in engines.values():
            self._hosts[spec.name] = self._new_host(spec)
        for spec in specs:
            if spec.name in engines:
                continue
            engine = spec.name.replace("rollout-", "engine-", 1)
            beside = spec.role == "rollout" and engine in self._hosts
            if beside and isinstance(self._options[spec.name]["scheduling_strategy"], str):
                # No bundle (neither role asks for resources): follow the engine's node.
                node = (await self._node(self._hosts[engine], engine))["node_id"]
                self._options[spec.name]["scheduling_strategy"] = _on_node(node)
            self._hosts[spec.name] = self._new_host(spec)
        return await self._endpoints(specs, bind_host)

    async def _connect(self, specs: Sequence[ActorSpec]) -> None:
        import ray

        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = {
            "namespace": self.config.namespace,
            "log_to_driver": False,  # actor output goes to <run_dir>/logs/<actor>.out
        }
        address = self.config.address or os.environ.get("RAY_ADDRESS")
        if address:
            kwargs["address"] = address
        else:  # a local cluster with as many logical CPUs as the job asks for
            need = math.ceil(_total_demand(self.config, specs).get("CPU", 0.0))
            kwargs.update(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False)
        await asyncio.to_thread(ray.init, **kwargs)
        self._started_ray = True
        log.info("ray connected", address=address or "local", resources=ray.cluster_resources())

    def _bind_host(self) -> str | None:
        """``runtime.host`` when every node is on this host; None (each node's own address)
        for a cluster that spans hosts, which needs CurveZMQ (see module doc)."""
        import ray

        from asyncrl.wire import security

        here = ray.util.get_node_ip_address()
        hosts = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})
        if set(hosts) <= {here}:
            return self.host
        if security.active() is None:
            raise ValueError(
                f"this Ray cluster spans hosts {hosts} (the controller is on {here}): its "
                "channels must bind each node's address, which asyncrl allows only "
                "encrypted; make keys with `asyncrl keys DIR` on the shared filesystem and "
                "set --wire.curve-keys DIR (docs/ray.md)"
            )
        self.controller_host = here
        return None

    async def _reserve(self, specs: Sequence[ActorSpec]) -> None:
        """Check the cluster can hold the job, then create and wait for the groups.

        Each role's actors share one group, one bundle each. With engine actors,
        ``engine-i`` and ``rollout-i`` share bundle ``i`` (the sum of both roles' demands),
        so a rollout actor's resources are reserved on its engine's node.
        """
        import ray

        _check_capacity(_total_demand(self.config, specs), ray.cluster_resources())
        groups: dict[str, list[list[ActorSpec]]] = defaultdict(list)
        for spec in specs:
            groups[spec.role].append([spec])
        if "engine" in groups:
            for i, pair in enumerate(groups.pop("rollout", [])):
                groups["engine"][i] += pair
        for role, bundles in groups.items():
            await self._reserve_role(role, bundles)

    async def _reserve_role(self, role: str, bundles: list[list[ActorSpec]]) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        demand: dict[str, float] = defaultdict(float)
        for spec in bundles[0]:
            for key, amount in self.config.role(spec.role).demand().items():
                demand[key] += amount
        if not demand:  # Ray refuses empty bundles: place by strategy alone
            spread = self._strategy(role) == "SPREAD" or role == "eval"
            for spec in (s for bundle in bundles for s in bundle):
                self._options[spec.name] = self._resources(spec) | {
                    "scheduling_strategy": _spread(spread)
                }
            return
        group = placement_group([dict(demand)] * len(bundles), strategy=self._strategy(role))
        self._groups.append(group)
        await self._ready(group, role, dict(demand), len(bundles))
        for i, bundle in enumerate(bundles):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
            for spec in bundle:
                self._options[spec.name] = self._resources(spec) | {"scheduling_strategy": strategy}

    def _resources(self, spec: ActorSpec) -> dict[str, Any]:
        res = self.config.role(spec.role)
        opts: dict[str, Any] = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus}
        if res.resources:
            opts["resources"] = dict(res.resources)
        return opts

    def _strategy(self, role: str) -> str:
        if role in ("rollout", "engine") and self.config.rollout_placement == "spread":
            return "SPREAD"
        return "PACK"  # trainer ranks together; a single-actor role has one bundle anyway

    async def _ready(self, group: Any, role: str, demand: dict[str, float], n: int) -> None:
        try:
            async with asyncio.timeout(self.config.placement_timeout):
                await group.ready()
        except TimeoutError:
            raise TimeoutError(
                f"Ray could not place {n} {role} actor(s) of {demand} each within "
                f"{self.config.placement_timeout:.0f}s (runtime.ray.placement_timeout); "
                "the cluster's free resources do not fit the placement"
            ) from None

    def _new_host(self, spec: ActorSpec) -> Any:
        import ray

        cls = ray.remote(ActorHost)
        opts = {"max_restarts": 0, "max_concurrency": 64, **self._options[spec.name]}
        out = str(self.run_dir / "logs" / f"{spec.name}.out")
        return cls.options(**opts).remote(os.getcwd(), out)

    async def _endpoints(self, specs: Sequence[ActorSpec], bind_host: str | None) -> dict[str, str]:
        """Ask each binding actor's host for its ports; ``control`` is the controller's."""
        from asyncrl.wire.sockets import free_tcp_endpoint

        names = endpoint_names(specs)
        here = bind_host or self.controller_host
        for _ in range(_TRIES_FOR_DISTINCT_PORTS):
            out = {"control": free_tcp_endpoint(here)}
            wanted: dict[str, list[str]] = defaultdict(list)
            for name in names:
                if binder(name) in self._hosts:
                    wanted[binder(name)].append(name)
            for actor, mine in wanted.items():
                # An engine's HTTP API has no key and serves only the rollout actor on its
                # own node: loopback there, whatever the cluster.
                host = "127.0.0.1" if all(n.endswith(".http") for n in mine) else bind_host
                out |= await self._hosts[actor].endpoints.remote(mine, host)
            for name in names:  # roles this job lacks (train-only: no buffer)
                out.setdefault(name, free_tcp_endpoint(here))
            # Hosts on one machine draw ports independently: make sure none drew the same.
            if len(set(out.values())) == len(out):
                return out
        raise RuntimeError("could not draw distinct ports for the job's channels")

    async def _node(self, host: Any, name: str) -> dict[str, Any]:
        """Where ``host`` runs, once Ray has scheduled it (bounded: a host whose resources
        never free up would otherwise wait for ever)."""
        import ray

        try:
            async with asyncio.timeout(self.config.placement_timeout):
                return dict(await host.node.remote())
        except TimeoutError:
            ray.kill(host, no_restart=True)
            raise TimeoutError(
                f"Ray did not start actor {name} within {self.config.placement_timeout:.0f}s "
                "(runtime.ray.placement_timeout): its resources are not free on any node it "
                "may use"
            ) from None

    # -- the Runtime protocol ---------------------------------------------------------
    async def start(self, spec: ActorSpec) -> RayActor:
        """Run ``spec`` in its placed host (a new host in the same place on a restart)."""
        host = self._hosts.pop(spec.name, None)
        if host is None:
            if spec.name not in self._options:
                raise ValueError(f"actor {spec.name!r} was not placed (call place() first)")
            host = self._new_host(spec)
        info = await self._node(host, spec.name)
        handle = RayActor(spec, host, info, self.run_dir / "logs" / f"{spec.name}.out")
        ref = host.run.remote(msgspec.json.encode(spec))
        handle.finished = self._tg.create_task(handle.follow(ref), name=f"ray.{spec.name}")
        self.actors.append(handle)
        log.info("actor placed", actor=spec.name, node=handle.node_id[:12], pid=handle.pid)
        return handle

    async def stop(self, handle: RayActor, grace: float) -> int:  # type: ignore[override]
        """Ask the actor to stop, wait up to ``grace`` seconds, then kill its worker."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(grace):
                await handle.host.stop.remote()
        try:
            async with asyncio.timeout(grace):
                return await handle.wait()
        except TimeoutError:
            self.kill(handle)
            return await handle.wait()

    def kill(self, handle: RayActor) -> None:  # type: ignore[override]
        """Kill the actor's worker now."""
        import ray

        with contextlib.suppress(Exception):
            ray.kill(handle.host, no_restart=True)


def _on_node(node_id: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def _spread(spread: bool) -> str:
    return "SPREAD" if spread else "DEFAULT"


def _total_demand(config: RayConfig, specs: Sequence[ActorSpec]) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    for spec in specs:
        for key, amount in config.role(spec.role).demand().items():
            total[key] += amount
    return dict(total)


def _check_capacity(need: dict[str, float], have: dict[str, float]) -> None:
    """Refuse a job that asks for more of a resource than the whole cluster has."""
    short = {k: (v, have.get(k, 0.0)) for k, v in need.items() if v > have.get(k, 0.0) + 1e-9}
    if short:
        parts = ", ".join(f"{k}: needs {v:g}, has {h:g}" for k, (v, h) in sorted(short.items()))
        raise ValueError(
            f"the job asks Ray for more than the cluster has ({parts}); see runtime.ray.roles"
        )
