"""The attention-kernel choice for shapes that change every call (``asyncrl/sdpa_kernels.py``).

The CUDA path cannot run here (CI has no GPU); the flags it sets are process-wide and
readable on the CPU, so the test holds them: cuDNN off inside, every flag back after, and
nothing changed on the CPU, whose kernels the CPU figures were measured with.
"""

from __future__ import annotations

import torch

from asyncrl.sdpa_kernels import varying_shapes


def _flags() -> dict[str, bool]:
    b = torch.backends.cuda
    return {
        "cudnn": b.cudnn_sdp_enabled(),
        "flash": b.flash_sdp_enabled(),
        "efficient": b.mem_efficient_sdp_enabled(),
        "math": b.math_sdp_enabled(),
    }


def test_cuda_leaves_out_cudnn_and_restores_every_flag() -> None:
    before = _flags()
    assert before["cudnn"], "torch's default enables cuDNN attention"
    with varying_shapes(torch.device("cuda")):
        inside = _flags()
    assert inside == {"cudnn": False, "flash": True, "efficient": True, "math": True}
    assert _flags() == before


def test_cpu_changes_nothing() -> None:
    before = _flags()
    with varying_shapes(torch.device("cpu")):
        assert _flags() == before
