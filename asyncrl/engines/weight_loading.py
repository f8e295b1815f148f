"""How new weights reach a ``TorchEngine``: safetensors directories and the trainer's group.

``read_safetensors`` loads a directory written by a trainer or by ``save_pretrained``;
``check_names`` refuses tensors the model does not have (before anything is copied, or
before a collective starts); ``WeightGroup`` is the engine's side of SGLang's distributed
update (``docs/sglang_api.md`` 2.2, 2.3): join the trainer's torch.distributed group,
receive each tensor by ``broadcast(src=0)`` in the announced order, leave.

Users: ``TorchEngine`` (``torch_engine.py``), which copies the tensors into its model at a
decode-step boundary.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from asyncrl.engines.base import EngineError


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


class WeightGroup:
    """The one torch.distributed group an engine process joins (the default group).

    ``name`` is the ``group_name`` it was joined under, empty while none is joined.
    """

    def __init__(self) -> None:
        self.name = ""

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
        import torch.distributed as dist

        if dist.is_initialized():
            raise EngineError(f"a weights update group already exists ({self.name})")
        await asyncio.to_thread(
            dist.init_process_group,
            backend=backend,
            world_size=world_size,
            rank=rank,
            init_method=f"tcp://{master_address}:{master_port}",
        )
        self.name = name

    async def receive(
        self,
        name: str,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        model: torch.nn.Module,
        device: torch.device,
    ) -> dict[str, torch.Tensor]:
        """Each tensor by ``broadcast(src=0)``, in list order, once the names are checked."""
        import torch.distributed as dist

        if not dist.is_initialized() or name != self.name:
            raise EngineError(f"no weights update group named {name!r}: init it first")
        if not len(names) == len(dtypes) == len(shapes):
            raise EngineError("names, dtypes and shapes must have the same length")
        tensors = {
            n: torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            for n, dtype, shape in zip(names, dtypes, shapes, strict=True)
        }
        check_names(model, tensors)

        def broadcast_all() -> None:
            for t in tensors.values():
                dist.broadcast(t, src=0)

        await asyncio.to_thread(broadcast_all)
        return tensors

    async def leave(self, name: str) -> None:
        """Destroy the group; ``EngineError`` when no group of that name was joined."""
        import torch.distributed as dist

        if not dist.is_initialized() or name != self.name:
            raise EngineError(f"The group to be destroyed does not exist: {name!r}")
        await asyncio.to_thread(dist.destroy_process_group)
        self.name = ""
