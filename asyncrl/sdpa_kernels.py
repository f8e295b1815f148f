"""Which fused attention kernels torch may pick for attention whose shapes keep changing.

On Hopper, sdpa prefers cuDNN's attention for bf16, and cuDNN builds an execution plan
for each new shape; asyncrl's shapes are new at almost every call (the engine's KV grows
each decode step, a packed micro-batch attends per sequence), so building plans took most
of the time (``docs/benchmarks.md``). ``varying_shapes`` leaves flash, memory-efficient and
math attention to choose from on CUDA: the same attention, only the time differs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def varying_shapes(device: torch.device) -> AbstractContextManager[object]:
    """The sdpa kernels for shapes that change call to call: all but cuDNN's on CUDA;
    elsewhere nothing changes."""
    if device.type != "cuda":
        return nullcontext()
    return sdpa_kernel(WITHOUT_CUDNN)
