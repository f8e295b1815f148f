"""``create_trainer``: the training backend a ``TrainerConfig`` names, on its ranks.

Backends are imported lazily: each pulls in its own stack (transformers, megatron-core),
and the config tree must not. With ``num_ranks > 1`` the trainer runs over that many
processes (``ranks.LeaderTrainer``, this process is rank 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.policies import PolicyConfig
    from asyncrl.trainers.base import Trainer
    from asyncrl.trainers.config import TrainerConfig


def create_trainer(config: TrainerConfig, algo: PolicyConfig | None = None) -> Trainer:
    """The trainer ``config`` describes, with the RL objective ``algo``: one process, or
    ``config.num_ranks`` processes led by this one."""
    if config.num_ranks > 1:
        from asyncrl.trainers.ranks import LeaderTrainer

        return LeaderTrainer.start(config, algo)
    return backend(config, algo)


def backend(config: TrainerConfig, algo: PolicyConfig | None = None) -> Trainer:
    """This rank's backend of ``config.backend`` (in the process group, if one exists)."""
    if config.backend == "sim":
        from asyncrl.trainers.sim_trainer import SimTrainer

        return SimTrainer(config, algo)
    if config.backend == "megatron":
        from asyncrl.trainers.megatron_trainer import MegatronTrainer

        return MegatronTrainer(config, algo)
    from asyncrl.trainers.torch_trainer import TorchTrainer

    return TorchTrainer(config, algo)
