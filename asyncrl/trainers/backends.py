"""``create_trainer``: the training backend a ``TrainerConfig`` names.

``torch`` is ``torch_trainer.TorchTrainer``; ``megatron`` is
``megatron_trainer.MegatronTrainer``. Imported lazily: each pulls in its own stack
(transformers, megatron-core), and the config tree must not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.policies import PolicyConfig
    from asyncrl.trainers.base import Trainer
    from asyncrl.trainers.config import TrainerConfig


def create_trainer(config: TrainerConfig, algo: PolicyConfig | None = None) -> Trainer:
    """The backend of ``config.backend`` with ``config`` and the RL objective ``algo``."""
    if config.backend == "megatron":
        from asyncrl.trainers.megatron_trainer import MegatronTrainer

        return MegatronTrainer(config, algo)
    from asyncrl.trainers.torch_trainer import TorchTrainer

    return TorchTrainer(config, algo)
