"""The job's topology: which actors exist, which endpoints they bind, who connects where.

    controller  hub: control  <- every actor's ControlLink
    buffer      binds: buffer.work (rpc), buffer.results (reliable), buffer.batches (rpc),
                buffer.events(+_snapshot) (pub/sub: APRIL aborts)
    engine-i    binds: engine-i.http (SGLang API; only with rollout.engine.serve: actor)
    rollout-i   connects: buffer.work, buffer.results, trainer.weights(+_snapshot), trainer.blob,
                trainer.group (dist)
                (and engine-i.http, over HTTP)
    reward      binds: reward.score (rpc; only with a reward model)
    trainer     binds: trainer.weights(+_snapshot) (pub/sub), trainer.blob (blob pull),
                trainer.group (the dist transport's rendezvous store, a torch TCPStore);
                connects: buffer.batches

Endpoints are assigned before any actor starts (``Runtime.place``) and travel in each
``ActorSpec``, so a restarted actor binds the same address and its peers reconnect.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncrl.actors.base import ActorSpec
from asyncrl.actors.config import ActorConfig
from asyncrl.wire.sockets import free_tcp_endpoint

ENDPOINTS = (
    "control",
    "buffer.work",
    "buffer.results",
    "buffer.batches",
    "buffer.events",
    "buffer.events_snapshot",
    "trainer.weights",
    "trainer.weights_snapshot",
    "trainer.blob",
    "trainer.group",
)


def binder(endpoint: str) -> str:
    """The actor that binds ``endpoint`` (``controller`` for the control server)."""
    return "controller" if endpoint == "control" else endpoint.split(".", 1)[0]


def endpoint_names(specs: Sequence[ActorSpec]) -> list[str]:
    """The job's endpoints: ``ENDPOINTS``, ``engine-i.http`` per engine actor, and
    ``reward.score`` with a reward actor."""
    names = [*ENDPOINTS, *(f"{s.name}.http" for s in specs if s.role == "engine")]
    return names + [f"{s.name}.score" for s in specs if s.role == "reward"]


def allocate_endpoints(host: str = "127.0.0.1", names: Sequence[str] = ENDPOINTS) -> dict[str, str]:
    """One free tcp endpoint on ``host`` for each of ``names``."""
    return {name: free_tcp_endpoint(host) for name in names}


def engine_actor_names(n: int) -> list[str]:
    """The names of a job's ``n`` engine actors (``engine-i`` serves ``rollout-i``)."""
    return [f"engine-{i}" for i in range(n)]


def rollout_actor_names(n: int) -> list[str]:
    """The names of a job's ``n`` rollout actors."""
    return [f"rollout-{i}" for i in range(n)]


def job_specs(
    *,
    classes: Mapping[str, str],
    num_rollout_actors: int,
    endpoints: Mapping[str, str],
    run_dir: Path,
    wire: Mapping[str, Any],
    common: Mapping[str, Any],
    params: Mapping[str, ActorConfig] | None = None,
    extra_roles: Sequence[str] = (),
    num_engine_actors: int = 0,
) -> list[ActorSpec]:
    """Specs for the buffer, ``num_engine_actors`` engine actors, ``num_rollout_actors``
    rollout actors, the trainer and one actor of each of ``extra_roles`` (named after its
    role, e.g. ``eval``).

    ``classes`` maps role -> actor class path; ``wire`` is the job's ``WireConfig`` (as
    JSON); ``common`` holds ``ActorSpec`` fields shared by all (heartbeat interval, log
    settings); ``params`` maps role -> its actor's settings (``actors/config.py``).
    """
    names = [("buffer", "buffer")]
    names += [(name, "engine") for name in engine_actor_names(num_engine_actors)]
    names += [(name, "rollout") for name in rollout_actor_names(num_rollout_actors)]
    names += [("trainer", "trainer")]
    names += [(role, role) for role in extra_roles]
    return [
        ActorSpec(
            name=name,
            role=role,
            cls=classes[role],
            control=endpoints.get("control"),
            endpoints=dict(endpoints),
            wire=dict(wire),
            log_file=str(run_dir / "logs" / f"{name}.jsonl"),
            params=_params((params or {}).get(role)),
            **common,
        )
        for name, role in names
    ]


def _params(config: ActorConfig | None) -> dict[str, Any]:
    return {} if config is None else config.model_dump(mode="json")
