"""How a new weight version reaches a ``TorchEngine``'s model: staged and copied at a step
boundary, adapter-only and merged, written in place during a pause, or received from the
trainer's group. Part of the engine, kept in a module of its own: it reads and sets the
engine's model, version and pause state.

A failed in-place write leaves a mix of two versions: the engine is then ``torn`` and
aborts every request until an update completes, so no token samples from the mix.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import torch

from asyncrl.errors import EngineError
from asyncrl.observe.logs import get_logger
from asyncrl.weights.loading import WeightGroups, check_names, read_safetensors
from asyncrl.weights.lora_merge import AdapterVersion, BaseWeights, is_adapter_version
from asyncrl.wire.codec import torch_dtype
from asyncrl.wire.messages import BlobManifest

if TYPE_CHECKING:
    from asyncrl.engines.torch.engine import TorchEngine

log = get_logger("asyncrl.engine")


class WeightUpdates:
    """An engine's weight updates (module docstring); ``TorchEngine`` serves its SGLang
    routes from here."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.groups = WeightGroups()
        # Adapter versions merge onto the weights the engine started from (lora_merge.py).
        self._base: BaseWeights | None = None
        self._half_loaded = False  # a load into the model's tensors began and did not end

    async def from_disk(self, path: str, version: int | None) -> None:
        """Load every ``*.safetensors`` file of ``path`` at a step boundary."""
        tensors = await asyncio.to_thread(read_safetensors, path)
        await self.from_tensors(tensors, version)
        self.engine.model_path = path

    async def from_tensors(self, tensors: dict[str, torch.Tensor], version: int | None) -> None:
        """Copy ``tensors`` (names as in ``state_dict``) into the model at a step boundary;
        an adapter version (``lora_merge.py``) is merged onto the base weights first."""
        source: dict[str, torch.Tensor] | AdapterVersion = tensors
        if is_adapter_version(tensors):
            if self._base is None:
                self._base = await asyncio.to_thread(BaseWeights, self.engine.base_path)
            params = self.engine.model.state_dict(keep_vars=True)
            source = AdapterVersion(tensors, params, self._base)
        else:
            check_names(self.engine.model, tensors)
        self._half_loaded = False
        try:
            await self.engine.at_boundary(lambda: self._load(source, version))
        except BaseException as exc:
            if self._half_loaded:  # a mix of two versions must not sample
                self._tear(exc)
            raise
        await self._mended()

    def takes_in_place(self, manifest: BlobManifest | None) -> bool:
        """Whether ``in_place`` can write ``manifest``'s tensors straight
        into the model: every name known, of the same shape and dtype, on the CPU."""
        if manifest is None or self.engine.device.type != "cpu":
            return False
        params = self.engine.model.state_dict(keep_vars=True)
        return all(
            (p := params.get(e.name)) is not None
            and list(p.shape) == list(e.shape)
            and p.dtype == torch_dtype(e.dtype)
            and p.is_contiguous()
            for e in manifest.entries
        )

    async def in_place(
        self, fill: Callable[[dict[str, torch.Tensor]], Awaitable[object]], version: int
    ) -> None:
        """Write a new version straight into the model's tensors: no staging copy.

        Decoding stops at the next step boundary (requests and their KV stay, as in an
        ``in_place`` pause), ``await fill(params)`` writes the tensors (``params``: the
        model's, by ``state_dict`` name, tied ones under each), and decoding goes on with
        ``version``. The pause lasts the whole transfer, as SGLang's distributed update
        does. If ``fill`` raises (or is cancelled), the weights are part new and part old:
        until an update completes (``torn``), the engine aborts every request, in flight
        or new, so no token is sampled from a mix and each partial output goes back to
        its caller to resume on a complete version.
        """
        held_by_user = self.engine.paused and not self.engine.torn
        self.engine.hold()
        await self.engine.at_boundary(lambda: None)  # the step under way ends; none runs now
        start = time.perf_counter()
        params = {k: v.detach() for k, v in self.engine.model.state_dict(keep_vars=True).items()}
        try:
            await fill(params)
        except BaseException as exc:
            self._tear(exc)
            raise
        finally:  # the fill may write the tensors' memory, unseen by their version counters
            self.engine.runner.invalidate()
        self.engine.version = version
        pause = time.perf_counter() - start
        self.engine.stats["update_pause_s"] += pause
        log.info("weights updated", version=version, in_place=True, pause_s=round(pause, 4))
        self.engine.torn = False
        if not held_by_user:
            await self.engine.resume()

    def _tear(self, exc: BaseException) -> None:
        """A failed in-place update: abort every request (its partial output returns to
        its caller, to resume on a complete version), and abort new ones at once, until
        an update completes. Held requests are let in only to be aborted."""
        self.engine.torn = True
        log.error(
            "weights torn by a failed update: requests are aborted until one completes",
            version=self.engine.version,
            error=f"{type(exc).__name__}: {exc}",
        )
        self.engine.abort_torn()

    async def _mended(self) -> None:
        """A complete update after a torn one: decoding may go on."""
        if self.engine.torn:
            self.engine.torn = False
            await self.engine.resume()

    def _load(self, tensors: dict[str, torch.Tensor] | AdapterVersion, version: int | None) -> None:
        start = time.perf_counter()  # decoding waits for this: the update's pause
        params = self.engine.model.state_dict(keep_vars=True)  # tied weights under each name
        self._half_loaded = True
        try:
            with torch.no_grad():
                if isinstance(tensors, AdapterVersion):
                    tensors.load_into(params)
                else:
                    for name, t in tensors.items():
                        params[name].copy_(t.to(params[name].device, params[name].dtype))
        finally:  # what was written is seen by the next step either way
            self.engine.runner.invalidate()
        self._half_loaded = False
        if version is not None:
            self.engine.version = version
        pause = time.perf_counter() - start
        self.engine.stats["update_pause_s"] += pause
        log.info(
            "weights updated",
            version=self.engine.version,
            tensors=len(tensors),
            pause_s=round(pause, 4),
        )

    async def join_group(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join the trainer's group as SGLang does (blocking rendezvous, in a thread)."""
        await self.groups.join(master_address, master_port, rank, world_size, group_name, backend)

    async def from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        version: int | None,
        *,
        flattened: bool = False,
    ) -> None:
        """Receive the tensors by ``broadcast(src=0)`` (each in list order, or one
        ``flattened`` bucket of their bytes), then load them."""
        if not len(names) == len(dtypes) == len(shapes):
            raise EngineError("names, dtypes and shapes must have the same length")
        entries = list(zip(names, dtypes, shapes, strict=True))
        tensors = await self.groups.receive(
            group_name, entries, self.engine.model, self.engine.device, flattened=flattened
        )
        await self.from_tensors(tensors, version)

    async def leave_group(self, group_name: str) -> None:
        """Leave the group; ``EngineError`` when no group of that name was joined."""
        await self.groups.leave(group_name)
