"""Linear layers computed as ``(W @ x^T)^T`` for a few rows on the CPU: decode's matmuls.

A decode step multiplies a few rows (one per running sequence) by every weight matrix,
streaming the weights from memory. On this project's 2-core AVX2 machine, torch's
``F.linear`` (``x @ W^T``) streamed them at 2-6 GB/s for 1-64 rows, while the same
product taken as ``W @ x^T`` ran 1.1-2.5x faster for up to 128 rows and 0.85x for 512 and
more (SmolLM2-135M shapes; docs/benchmarks.md has the table). A SmolLM2-135M decode
step went from 117/199/253/552 ms to 95/106/183/419 ms at 1/4/16/64 sequences. So the
engine's CPU model computes ``y = (W @ x^T)^T + b`` when at most ``MAX_ROWS`` rows come
in without gradients, and ``F.linear`` otherwise (prefill, training, other devices).

``use_for`` swaps the ``forward`` of each ``nn.Linear`` instance in a model; the modules,
their parameters and ``state_dict`` stay as they were, so weight updates are unaffected.

Users: ``TorchEngine`` (``torch_engine.py``).
"""

from __future__ import annotations

import types

import torch

#: Above this many rows ``F.linear`` is as fast or faster (measured: 0.85x at 512).
MAX_ROWS = 128


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // max(x.shape[-1], 1)
    if x.device.type != "cpu" or rows > MAX_ROWS or torch.is_grad_enabled():
        return torch.nn.functional.linear(x, self.weight, self.bias)
    y = (self.weight @ x.reshape(rows, x.shape[-1]).t()).t().contiguous()
    if self.bias is not None:
        y += self.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def use_for(model: torch.nn.Module) -> int:
    """Compute every ``nn.Linear`` of ``model`` as above; returns how many."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    for module in linears:
        module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]
    return len(linears)
