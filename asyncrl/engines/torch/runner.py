"""ModelRunner: the model's forward for the scheduler, on the lean path where it covers
the model (``lean_forward.py``), else Hugging Face's own forward with a KV cache."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from asyncrl.engines.torch import cpu_linear as cpu_linear
from asyncrl.engines.torch.lean_forward import lean_forward
from asyncrl.sdpa_kernels import varying_shapes


class ModelRunner:
    """Runs ``model`` forward; owns the packed and fused copies of its weights."""

    def __init__(self, model: torch.nn.Module, *, packed: bool = True, lean: bool = True) -> None:
        self.model = model.eval()
        cpu_linear.use_for(model, packed=packed)
        self.lean = lean_forward(model, packed=packed) if lean else None
        # transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns).
        forward = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward else "past_key_values"
        self.device = next(model.parameters()).device
        self.context_length = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.weights_epoch = 0  # moves at every invalidate: KV computed before is stale

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any, keep: int
    ) -> torch.Tensor:
        """Logits ``[b, keep or t, V]`` of ``ids`` (``keep`` 0: every position); their KV
        goes into ``cache``, filled in place."""
        ids, mask, positions = (t.to(self.device) for t in (ids, mask, positions))
        with varying_shapes(ids.device):  # a new KV length every step: no cuDNN plans
            if self.lean is not None:
                return self.lean(ids, mask, positions, cache, keep)
            return self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_kwarg: cache},
                logits_to_keep=keep,
            ).logits

    def invalidate(self) -> None:
        """Drop the copies made of the weights (packed, fused): the next forward makes
        them again from the weights as they are then; KV computed before is stale."""
        self.weights_epoch += 1
        cpu_linear.invalidate(self.model)
        if self.lean is not None:
            self.lean.invalidate()
