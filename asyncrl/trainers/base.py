"""The training-backend seam: the ``Trainer`` protocol and its records (no logic here).

A trainer owns the policy's weights and optimizer. ``actors/trainer.py`` (``TrainerActor``)
calls ``train_step`` once per ``TrainBatch`` and publishes ``export_weights()`` after every
step; ``asyncrl sft`` (``trainers/sft.py``) calls ``sft_step`` and ``save_hf``. Backends:
``torch_trainer.TorchTrainer`` (Hugging Face models, DDP/FSDP) and, later, megatron-core.

Weights always travel under Hugging Face parameter names (the names ``save_pretrained``
writes, tied duplicates dropped), so every engine can load them unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from asyncrl.types import TrainBatch


class UntrainableBatch(ValueError):
    """A batch with no group the trainer can learn from; the step is skipped, not failed."""


class NonFiniteStep(UntrainableBatch):
    """The step's loss or gradient is NaN or infinite: it is skipped, the weights and the
    optimizer untouched (the trainer actor fails the job after
    ``train.max_nonfinite_steps`` of them in a row)."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one optimizer step reports.

    ``version`` is the trainer version after the step (one more than before it);
    ``metrics`` are plain floats (names in the backend's docstring); ``num_tokens`` counts
    loss tokens and ``num_samples`` the sequences trained on, over all ranks.
    """

    version: int
    metrics: dict[str, float] = field(default_factory=dict)
    num_tokens: int = 0
    num_samples: int = 0


@runtime_checkable
class Trainer(Protocol):
    """A training backend. In data-parallel runs every rank calls every method.

    ``version`` counts optimizer steps since the initial weights (0 before the first), and
    is restored by ``load_checkpoint``.
    """

    version: int

    def train_step(self, batch: TrainBatch) -> StepResult:
        """One RL optimizer step on ``batch`` (every rank gets the same batch)."""
        ...

    def sft_step(
        self,
        tokens: Sequence[np.ndarray],
        loss_masks: Sequence[np.ndarray],
        label_smoothing: float = 0.0,
    ) -> StepResult:
        """One supervised step: token ``t`` of a sequence is trained when ``loss_masks[t]``.

        Loss: mean over every masked token of the step of the cross-entropy against the
        target smoothed by ``eps = label_smoothing``: ``(1 - eps) * NLL + eps * U``, where
        ``U = logsumexp(z) - mean_v z_v`` is the cross-entropy against the uniform
        distribution over the vocabulary.
        """
        ...

    def export_weights(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """The current weights under HF names: CPU, contiguous, copies (safe to serve).
        ``copy=False`` lets a backend hand out its weights where they live (on a GPU for
        CUDA IPC), valid only until the next step: the caller copies them at once."""
        ...

    def save_hf(self, path: Path) -> None:
        """Write a Hugging Face model directory (config, safetensors, tokenizer if any)."""
        ...

    def save_checkpoint(self, path: Path) -> None:
        """Save everything a bit-exact resume needs into directory ``path``."""
        ...

    def snapshot_checkpoint(self) -> Callable[[Path], None] | None:
        """``save_checkpoint``'s contents copied aside now; the returned function writes
        them into a directory, from another thread, while training goes on. None where
        this trainer cannot (several processes, state the copy cannot hold, or too
        little free memory for the copy): its caller saves in the step's time."""
        ...

    def load_checkpoint(self, path: Path) -> None:
        """Restore a ``save_checkpoint`` directory (weights, optimizer, RNG, version)."""
        ...
