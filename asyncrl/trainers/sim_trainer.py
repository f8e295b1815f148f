"""SimTrainer: the ``Trainer`` protocol with no model; each step takes modelled time.

For the cluster simulator, beside ``engines/sim/engine.SimEngine``. A step reads the batch
as the real trainers do, then lasts ``step_s / time_scale`` of wall time from its start,
with (modelled seconds)::

    step_s = step_base_s + step_s_per_token * tokens

where ``tokens`` counts the forwarded tokens of the rows with loss tokens. A version
publishes no tensors (engines load it in their own modelled time).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.policies import PolicyConfig
from asyncrl.trainers.base import StepResult
from asyncrl.trainers.config import TrainerConfig
from asyncrl.trainers.rl_columns import step_result
from asyncrl.trainers.rollout_tensors import RolloutTensors, rollout_tensors, sft_tensors
from asyncrl.types import TrainBatch


class SimTrainer:
    """A model-free trainer with modelled step time (``Trainer`` protocol)."""

    Config = TrainerConfig

    def __init__(self, config: TrainerConfig, algo: PolicyConfig | None = None) -> None:
        self.config = config
        self.algo = algo if algo is not None else PolicyConfig()
        self.version = 0
        self.clock = 0.0  # modelled seconds

    def train_step(self, batch: TrainBatch) -> StepResult:
        """One modelled step on ``batch``; see the module docstring."""
        start = time.perf_counter()
        rows = rollout_tensors(batch, self.config.reward_key)
        metrics = self._take_time(rows, start) | {"reward/mean": float(rows.scores_GN.mean())}
        stale = (self.version - rows.versions)[rows.mask.bool()].float()
        if stale.numel():
            metrics |= {"staleness/mean": float(stale.mean()), "staleness/max": float(stale.max())}
        self.version += 1
        return step_result(self.version, rows, metrics, start)

    def sft_step(
        self,
        tokens: Sequence[np.ndarray],
        loss_masks: Sequence[np.ndarray],
        label_smoothing: float = 0.0,
    ) -> StepResult:
        """One modelled supervised step."""
        start = time.perf_counter()
        rows = sft_tensors(tokens, loss_masks)
        metrics = self._take_time(rows, start)
        self.version += 1
        return step_result(self.version, rows, metrics, start)

    def _take_time(self, rows: RolloutTensors, start: float) -> dict[str, float]:
        """Sleep out the step's modelled time, counted from ``start`` (reading the batch is
        part of the step, not added to it)."""
        sim = self.config.sim
        tokens = sum(len(rows.sequences[i]) for i in range(rows.num_rows) if rows.mask[i].any())
        seconds = sim.step_base_s + sim.step_s_per_token * tokens
        time.sleep(max(0.0, start + seconds / sim.time_scale - time.perf_counter()))
        self.clock += seconds
        return {"time/modelled_step": seconds, "time/modelled_clock": self.clock}

    def export_weights(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """No weights: a version carries no tensors."""
        return {}

    def save_hf(self, path: Path) -> None:
        raise ValueError("the sim trainer has no weights to save as a model")

    def snapshot_checkpoint(self) -> Callable[[Path], None] | None:
        """None: saved in the step's time (its checkpoint is a few bytes)."""
        return None

    def save_checkpoint(self, path: Path) -> None:
        """``trainer.json``: the version and the modelled clock."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {"version": self.version, "clock": self.clock, "backend": "sim"}
        (path / "trainer.json").write_text(json.dumps(state))

    def load_checkpoint(self, path: Path) -> None:
        """Restore ``save_checkpoint``'s version and clock."""
        try:
            state = json.loads((Path(path) / "trainer.json").read_text())
            self.version, self.clock = int(state["version"]), float(state["clock"])
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"trainer checkpoint {path} is unreadable: {exc}") from exc
