"""The engine's linear layers on the CPU: oneDNN-packed weights, or ``W @ x^T`` for few rows.

A decode step multiplies a few rows by every weight matrix, streaming the weights from
memory. Two ways beat ``F.linear`` (MKL's ``x @ W^T``) there (``docs/benchmarks.md``,
"The embedded engine"): oneDNN with each weight reordered once into its blocked layout
(``_reorder_linear_weight``, then ``_linear_pointwise``, as inductor's CPU freezing does;
a second copy of every linear weight, which ``packed: false`` turns off), and
``(W @ x^T)^T`` where packing is off or the dtype has no oneDNN kernel (bf16 without
AVX512). Parameters and ``state_dict`` stay as they were; a packed copy is remade when
its weight changes, and writes torch's version counter misses need ``invalidate``.
"""

from __future__ import annotations

from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)

#: Above this many rows ``F.linear`` is as fast as ``W @ x^T`` or faster.
MAX_ROWS = 128
#: Weights smaller than this go to ``F.linear``, the fastest below it; from 256x256 on,
#: packed is. The 1M-parameter toy models' linears are all below it.
MIN_ELEMENTS = 256 * 256


def packable(dtype: torch.dtype) -> bool:
    """Whether this CPU has oneDNN kernels for ``dtype`` (bf16 needs AVX512)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False  # fp16 on a CPU: rare, and oneDNN's kernels for it need AMX


class DecodeLinear(torch.nn.Linear):
    """``nn.Linear`` computed without gradients on the CPU as the module docstring says;
    with gradients, on another device, under ``MIN_ELEMENTS`` or, unpacked, past
    ``MAX_ROWS`` rows, it is ``F.linear``."""

    packed: bool  # whether to keep a oneDNN-packed copy of ``weight``
    _packed: tuple[tuple[int, int, torch.dtype, torch.device], torch.Tensor] | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or torch.is_grad_enabled() or self.weight.numel() < MIN_ELEMENTS:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        packed = self._packed_weight() if self.packed else None
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        rows = x.numel() // max(x.shape[-1], 1)
        if rows > MAX_ROWS:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        y = (self.weight @ x.reshape(rows, x.shape[-1]).t()).t().contiguous()
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _packed_weight(self) -> torch.Tensor | None:
        """The packed copy of the current ``weight``, made now if it is missing or stale."""
        key = _identity(self.weight)
        if self._packed is not None and self._packed[0] == key:
            return self._packed[1]
        self._packed = None  # the stale copy goes before the new one is made
        if not packable(self.weight.dtype):
            self.packed = False
            return None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        except RuntimeError as exc:  # an unusual shape or build: this layer goes unpacked
            log.warning("linear weight not packed", shape=list(self.weight.shape), error=str(exc))
            self.packed = False
            return None
        self._packed = (key, packed)
        return packed

    def __getstate__(self) -> dict[str, Any]:
        """A pickled copy carries no packed weight (opaque oneDNN tensors do not pickle)."""
        state = super().__getstate__()
        return {**state, "_packed": None}


class FusedLinear:
    """Linears that take the same input, as one matmul: ``x @ [W1; W2; ...]^T + [b1; ...]``
    split back into each one's output (the q/k/v and the gate/up projections).

    Fused only where the fused weight is a packed one (the CPU, ``packed``, ``packable``,
    at least ``MIN_ELEMENTS``): it takes the memory the parts' packed copies would. It is
    made at the first call and again whenever a part's weight changes as ``_identity``
    sees it, or after ``invalidate``. Elsewhere (a GPU, packing off) each part runs on
    its own weight: a concatenated copy would hold most of a model's linear weights
    again.
    """

    def __init__(self, parts: list[torch.nn.Linear], *, packed: bool = True) -> None:
        self.parts, self.packed = parts, packed
        self.sizes = [p.out_features for p in parts]
        self._fused: tuple[tuple[object, ...], torch.Tensor, torch.Tensor | None] | None = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fused = self._weights() if self._fusable() else None
        if fused is None:
            return tuple(p(x) for p in self.parts)
        weight, bias = fused
        y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return y.split(self.sizes, dim=-1)

    def invalidate(self) -> None:
        self._fused = None

    def _fusable(self) -> bool:
        w = self.parts[0].weight
        return (
            self.packed
            and w.device.type == "cpu"
            and packable(w.dtype)
            and sum(p.weight.numel() for p in self.parts) >= MIN_ELEMENTS
        )

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = tuple(_identity(t) for p in self.parts for t in (p.weight, p.bias) if t is not None)
        if self._fused is not None and self._fused[0] == key:
            return self._fused[1:]
        self._fused = None  # the stale copy goes before the new one is made
        weight = torch.cat([p.weight.detach() for p in self.parts])
        bias = self._bias(weight)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self._fused = (key, packed, bias)
        return packed, bias

    def _bias(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The parts' biases end to end (zeros for a part without one), or None."""
        if all(p.bias is None for p in self.parts):
            return None
        return torch.cat(
            [
                p.bias.detach() if p.bias is not None else weight.new_zeros(p.out_features)
                for p in self.parts
            ]
        )


def _identity(weight: torch.Tensor) -> tuple[int, int, torch.dtype, torch.device]:
    """What changes when ``weight`` is written in place through torch, or replaced."""
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor has no version counter
        version = -1
    return version, weight.data_ptr(), weight.dtype, weight.device


def use_for(model: torch.nn.Module, *, packed: bool = True) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a ``DecodeLinear`` in place (the engine
    changes the model it is given); returns how many. Subclasses and modules with a
    forward of their own (hooks) are left alone."""
    linears = [
        m
        for m in model.modules()
        if type(m) in (torch.nn.Linear, DecodeLinear) and "forward" not in vars(m)
    ]
    for module in linears:
        module.__class__ = DecodeLinear
        module.packed, module._packed = packed, None
    return len(linears)


def invalidate(model: torch.nn.Module) -> None:
    """Drop every packed copy: call after writing weights by a path that torch's version
    counter does not see (a transport filling the tensors' memory, a collective); the
    copies are made again, lazily, from the new weights."""
    for module in model.modules():
        if isinstance(module, DecodeLinear):
            module._packed = None
