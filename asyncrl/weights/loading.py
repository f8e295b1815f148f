"""How new weights reach a ``TorchEngine``: safetensors directories and the trainer's group.

``read_safetensors`` loads a directory; ``check_names`` refuses tensors the model does not
have before anything is copied (or a collective starts); ``WeightGroups`` is the engine's
side of SGLang's distributed update (``docs/sglang_api.md`` 2.2, 2.3).
"""

from __future__ import annotations

import asyncio
import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.errors import EngineError
from asyncrl.weights.payload import bucket_layout, piece


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in directory ``path``."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def check_names(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Raise ``EngineError`` for a name the model lacks or a shape that differs."""
    known = model.state_dict(keep_vars=True)
    unknown = sorted(set(tensors) - set(known))
    if unknown:
        raise EngineError(f"unknown weight names: {unknown[:5]}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(known[name].shape):
            raise EngineError(
                f"{name}: shape {tuple(t.shape)} does not match {tuple(known[name].shape)}"
            )


#: How long a member waits for the whole group to arrive, and for each broadcast.
JOIN_TIMEOUT_S = 120.0
RECEIVE_TIMEOUT_S = 300.0


def join_as_sglang(
    address: str, port: int, rank: int, world_size: int, name: str, backend: str
) -> dist.ProcessGroup:
    """Join group ``name`` exactly as an SGLang server does (its ``init_custom_process_group``):
    a ``tcp://`` rendezvous with rank 0, the store prefixed with ``name``, and torch's own
    group helper. Blocks until every rank arrived (``JOIN_TIMEOUT_S``)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
    store, rank, world_size = next(
        rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(name, store),
        group_name=name,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class WeightGroups:
    """The weight-update groups an engine process joined, by ``group_name`` (SGLang keeps
    one per name too, so a trainer can form a new group before the old one is left)."""

    def __init__(self) -> None:
        self._groups: dict[str, dist.ProcessGroup] = {}

    async def join(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        name: str,
        backend: str,
    ) -> None:
        """Rendezvous with the trainer (rank 0) in a thread: it blocks until all joined."""
        if name in self._groups:
            raise EngineError(f"a weights update group named {name!r} exists already")
        self._groups[name] = await asyncio.to_thread(
            join_as_sglang, master_address, master_port, rank, world_size, name, backend
        )

    async def receive(
        self,
        name: str,
        entries: list[tuple[str, str, list[int]]],
        model: torch.nn.Module,
        device: torch.device,
        *,
        flattened: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The tensors ``(name, dtype, shape)`` broadcast from rank 0, once their names are
        checked: one broadcast each, in order, or with ``flattened`` one of all their
        bytes, concatenated in order (SGLang's ``flattened_bucket``)."""
        group = self._groups.get(name)
        if group is None:
            raise EngineError(f"no weights update group named {name!r}: init it first")
        tensors = {
            n: torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            for n, dtype, shape in entries
        }
        check_names(model, tensors)
        if not flattened:
            await asyncio.to_thread(receive_broadcasts, group, list(tensors.values()))
            return tensors
        layout = bucket_layout(tensors.items())
        flat = torch.empty(layout[-1].end_idx if layout else 0, dtype=torch.uint8, device=device)
        await asyncio.to_thread(receive_broadcasts, group, [flat])
        return {meta.name: piece(flat, meta) for meta in layout}

    async def leave(self, name: str) -> None:
        """Destroy group ``name``; ``EngineError`` when no group of that name was joined."""
        group = self._groups.pop(name, None)
        if group is None:
            raise EngineError(f"The group to be destroyed does not exist: {name!r}")
        await asyncio.to_thread(dist.destroy_process_group, group)


def receive_broadcasts(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Receive each of ``tensors`` in place by ``broadcast(src=0)``, in list order."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = datetime.timedelta(seconds=RECEIVE_TIMEOUT_S)
    works = [group.broadcast([t], opts) for t in tensors]
    for work in works:
        work.wait()
