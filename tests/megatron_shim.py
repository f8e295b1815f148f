"""Test-only: megatron-core on a CPU-only torch (never imported by the package).

megatron-core 0.16.1 calls CUDA in code paths that have nothing to do with a GPU: the
model-parallel RNG tracker (``torch.cuda.get_rng_state``), RoPE's ``inv_freq.to(
torch.cuda.current_device())``, ``torch.cuda.synchronize`` in pipeline p2p, and tensors
made with ``device="cuda"`` in its optimizers.
``cpu_megatron()`` redirects each of these to the CPU for the block and undoes it after:

- ``torch.cuda.current_device`` answers ``"cpu"``; its RNG state calls use the CPU RNG;
  ``synchronize`` does nothing; megatron's ``_set_cuda_rng_state`` sets the CPU state;
- a ``TorchFunctionMode`` rewrites ``device="cuda..."`` to ``"cpu"``, makes ``.cuda()``
  a no-op and ``.to("cuda")`` stay on the CPU, and reports ``torch.cuda.*`` type names
  from ``Tensor.type()`` (megatron asserts on ``torch.cuda.FloatTensor``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _cpu(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):  # a CUDA ordinal
        return "cpu"
    return device


class _CudaToCpu(TorchFunctionMode):
    """Keeps every tensor on the CPU whatever device megatron asks for."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = (args[0], *(_cpu(a) for a in args[1:]))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        return func(*args, **kwargs)


def _patches() -> list[tuple[Any, str, Any]]:
    """``(object, attribute, replacement)`` for each CUDA call redirected to the CPU."""
    import megatron.core.tensor_parallel.random as mrandom

    def set_state(state: torch.Tensor, *_: Any, **__: Any) -> None:
        torch.set_rng_state(state)

    # With the shim the CPU RNG stands in for the CUDA one, which megatron notes each fork.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    return [
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "get_rng_state", lambda *_a, **_k: torch.get_rng_state()),
        (torch.cuda.random, "get_rng_state", lambda *_a, **_k: torch.get_rng_state()),
        (torch.cuda, "manual_seed", torch.manual_seed),
        (torch.cuda, "synchronize", lambda *_a, **_k: None),
        (mrandom, "_set_cuda_rng_state", set_state),
    ]


def install_for_process() -> None:
    """The shim for the rest of this process, in every thread: the redirections stay, the
    mode is entered in this thread and around every job of a thread pool (the trainer
    actor runs its steps through ``asyncio.to_thread``). Used by ``megatron_site``."""
    from concurrent.futures import thread

    for obj, name, new in _patches():
        setattr(obj, name, new)
    _CudaToCpu().__enter__()
    run = thread._WorkItem.run

    def run_on_cpu(self: Any) -> None:
        with _CudaToCpu():
            run(self)

    thread._WorkItem.run = run_on_cpu  # type: ignore[method-assign]


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Within the block, megatron-core runs on the CPU (see the module docstring)."""
    patches = _patches()
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        with _CudaToCpu():
            yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_ranks(rank: int, world: int, port: int, *, tp: int = 1, pp: int = 1) -> Iterator[None]:
    """This process as ``rank`` of a gloo group of ``world`` on ``port``, megatron's model
    parallel groups (``tp`` x ``pp``) set up and its RNG seeded, on the CPU; all undone
    after the block (megatron's import warnings silenced)."""
    import torch.distributed as dist

    with warnings.catch_warnings(), cpu_megatron():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        address = f"tcp://127.0.0.1:{port}"
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
        try:
            parallel_state.initialize_model_parallel(tp, pp)
            model_parallel_cuda_manual_seed(0)
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
