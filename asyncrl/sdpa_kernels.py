"""Which fused attention kernels torch may pick for attention whose shapes keep changing.

On a Hopper GPU (an H200, torch 2.11, bf16) sdpa prefers cuDNN's attention, and cuDNN
builds an execution plan for each new shape. asyncrl's attention shapes are new at almost
every call: the engine's KV length grows by one each decode step, and a packed
micro-batch attends per sequence, each with its own length. The plan is never reused,
and building it was most of the time (``bench/gpu.sh`` on an H200, 2026-11-27):

- a packed trainer step of SmolLM2's shape (16,429 tokens, 128 sequences, 30 layers):
  3,840 cuDNN forward and 3,840 backward calls at 1.14 ms of CPU each, 8.6 of the
  step's 10.5 s of CPU time, against 0.25 s of GPU time;
- the engine's decode step: two thirds of its Python stack samples (py-spy) in its sdpa
  call, where the engine ran at 0.25x HF ``generate`` (the same cause by inference: no
  kernel profile of it was taken).

``varying_shapes(device)`` leaves flash, memory-efficient and math attention to choose
from on CUDA; elsewhere it changes nothing. The kernels compute the same attention: only
the time differs.

Users: ``TorchEngine._forward`` (both its forwards), ``trainers/packed_attention.py``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def varying_shapes(device: torch.device) -> AbstractContextManager[object]:
    """The sdpa kernels for shapes that change call to call (module docstring)."""
    if device.type != "cuda":
        return nullcontext()
    return sdpa_kernel(WITHOUT_CUDNN)
