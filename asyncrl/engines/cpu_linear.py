"""Linear layers computed as ``(W @ x^T)^T`` for a few rows on the CPU: decode's matmuls.

A decode step multiplies a few rows (one per running sequence) by every weight matrix,
streaming the weights from memory. On this project's 2-core AVX2 machine, torch's
``F.linear`` (``x @ W^T``) streamed them at 2-6 GB/s for 1-64 rows, while the same
product taken as ``W @ x^T`` ran 1.1-2.5x faster for up to 128 rows and 0.85x for 512 and
more (SmolLM2-135M shapes, streaming 100 distinct weights; docs/benchmarks.md, "The
embedded engine"). A SmolLM2-135M decode step went from 117/199/253/552 ms to
95/106/183/419 ms at 1/4/16/64 sequences. So the engine's CPU model computes
``y = (W @ x^T)^T + b`` when at most ``MAX_ROWS`` rows come in without gradients (decode
steps, and prefills of at most that many tokens), and ``F.linear`` otherwise (larger
prefills, training, other devices).

``use_for`` turns each plain ``nn.Linear`` of a model into a ``DecodeLinear`` (a subclass
that only overrides ``forward``), in place: the engine changes the model it is given.
Parameters and ``state_dict`` stay as they were, so weight updates are unaffected.

Users: ``TorchEngine`` (``torch_engine.py``).
"""

from __future__ import annotations

import torch

#: Above this many rows ``F.linear`` is as fast or faster (measured: 0.85x at 512).
MAX_ROWS = 128


class DecodeLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward takes ``W @ x^T`` for few rows on the CPU (above)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if x.device.type != "cpu" or rows > MAX_ROWS or torch.is_grad_enabled():
            return torch.nn.functional.linear(x, self.weight, self.bias)
        y = (self.weight @ x.reshape(rows, x.shape[-1]).t()).t().contiguous()
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def use_for(model: torch.nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a ``DecodeLinear``; returns how many.
    Subclasses and modules with a forward of their own (hooks) are left alone."""
    linears = [
        m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in vars(m)
    ]
    for module in linears:
        module.__class__ = DecodeLinear
    return len(linears)
