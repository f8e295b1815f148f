"""Several optimizer updates per rollout batch (``trainer.global_batch_size``,
``trainer.ppo_epochs``; asyncrl/trainers/rl_columns.py::update_plan) in TorchTrainer:
a batch is one weight version made of one update per mini-batch of whole groups per
epoch, each update exactly a step on its own rows, with the old log-probs of the
batch's start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.policies import PolicyConfig
from asyncrl.trainers.rl_columns import update_plan
from asyncrl.trainers.rollout_tensors import rollout_tensors
from asyncrl.trainers.torch_trainer import TorchTrainer
from asyncrl.types import TrainBatch
from tests.test_torch_trainer import config, make_batch
from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(path)
    return path


#: Old log-probs taken from the rollout: the loss of an update depends on its rows and
#: the weights alone, so updates inside one step equal steps of their own.
ROLLOUT_OLD = PolicyConfig(use_rollout_logprobs=True)


def weights(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items()}


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], atol=1e-7, rtol=0) for k in a), [
        k for k in a if not torch.allclose(a[k], b[k], atol=1e-7, rtol=0)
    ]


def group_batch(batch: TrainBatch, g: int) -> TrainBatch:
    return TrainBatch(batch_id=batch.batch_id, step=batch.step, groups=[batch.groups[g]])


def test_one_mini_batch_per_group_updates_as_a_step_per_group_would(tiny):
    batch = make_batch(0, num_groups=3, group_size=4)
    mini = TorchTrainer(config(tiny, global_batch_size=4, shuffle_minibatches=False), ROLLOUT_OLD)
    result = mini.train_step(batch)
    one_by_one = TorchTrainer(config(tiny), ROLLOUT_OLD)
    for g in range(3):
        one_by_one.train_step(group_batch(batch, g))
    assert_equal(weights(mini), weights(one_by_one))
    assert mini.version == 1 and one_by_one.version == 3  # a batch is one version
    assert result.metrics["optim_steps"] == 3
    assert mini.policy.scheduler.last_epoch == 3  # the schedule counts updates


def test_each_epoch_takes_the_groups_in_a_new_order_that_every_rank_draws_alike(tiny):
    """Shuffled (the default): each epoch's mini-batches are a permutation of the groups,
    drawn from the seed and the version; the updates are those steps in that order."""
    batch = make_batch(4, num_groups=4, group_size=3)
    rows = rollout_tensors(batch, "score")
    plan = update_plan(rows, 3, 3, shuffle_seed=7)
    assert plan == update_plan(rows, 3, 3, shuffle_seed=7)  # the same on every rank
    epochs = [[part[0] // 3 for part in plan[e * 4 : (e + 1) * 4]] for e in range(3)]
    assert all(sorted(order) == [0, 1, 2, 3] for order in epochs)
    assert len({tuple(order) for order in epochs}) > 1  # orders differ between epochs
    assert update_plan(rows, 3, 1) == [[3 * g + i for i in range(3)] for g in range(4)]
    mini = TorchTrainer(config(tiny, global_batch_size=3, ppo_epochs=2, seed=5), ROLLOUT_OLD)
    mini.train_step(batch)
    order = [part[0] // 3 for part in update_plan(rows, 3, 2, shuffle_seed=mini_seed(5, 0))]
    one_by_one = TorchTrainer(config(tiny, seed=5), ROLLOUT_OLD)
    for g in order:
        one_by_one.train_step(group_batch(batch, g))
    assert order[:4] != [0, 1, 2, 3] or order[4:] != [0, 1, 2, 3]
    assert_equal(weights(mini), weights(one_by_one))


def mini_seed(seed: int, version: int) -> int:
    return seed * 1_000_003 + version  # rl_step.shuffle_seed


def test_epochs_pass_over_the_batch_again(tiny):
    batch = make_batch(1)
    epochs = TorchTrainer(config(tiny, ppo_epochs=2), ROLLOUT_OLD)
    assert epochs.train_step(batch).metrics["optim_steps"] == 2
    twice = TorchTrainer(config(tiny), ROLLOUT_OLD)
    twice.train_step(batch)
    twice.train_step(batch)
    assert_equal(weights(epochs), weights(twice))


def test_whole_batch_as_one_mini_batch_is_the_default_step_exactly(tiny):
    batch = make_batch(2)
    default, whole = TorchTrainer(config(tiny)), TorchTrainer(config(tiny, global_batch_size=12))
    a, b = default.train_step(batch), whole.train_step(batch)
    a_w, b_w = weights(default), weights(whole)
    assert all(torch.equal(a_w[k], b_w[k]) for k in a_w)
    assert a.metrics["loss"] == b.metrics["loss"] and b.metrics["optim_steps"] == 1


def test_later_updates_weigh_against_the_batchs_starting_policy(tiny):
    """The decoupled objective's old log-probs are the batch's start: after the first
    update the ratio moves off 1 (with the training forward's own log-probs as the
    old ones it would stay exactly 1, and PPO's clip would never act)."""
    trainer = TorchTrainer(config(tiny, ppo_epochs=3, lr=1e-2))
    metrics = trainer.train_step(make_batch(3)).metrics
    assert abs(metrics["ratio"] - 1.0) > 1e-3 or metrics["clip_frac"] > 0
    single = TorchTrainer(config(tiny, lr=1e-2)).train_step(make_batch(3)).metrics
    assert single["ratio"] == pytest.approx(1.0, abs=1e-6)
