"""A trainer over 2 processes (asyncrl/trainers/ranks.py): this process leads, a follower
process makes every call with it. megatron with TP=2, PP=2, and DP=2 with the distributed
optimizer and overlapped gradient reduction, and the torch trainer's DDP, each against the
same backend on one rank: the same losses, gradient norms, entropy, KL and weights over two
steps, and a checkpoint that resumes bit-exactly."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch.distributed as dist

from asyncrl.policies import PolicyConfig
from asyncrl.trainers.backends import create_trainer
from asyncrl.trainers.config import TrainerConfig
from asyncrl.trainers.ranks import LeaderTrainer
from tests.megatron_shim import cpu_megatron
from tests.test_megatron_trainer import ALGO, max_diff
from tests.test_torch_trainer import make_batch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def world() -> Iterator[None]:
    """The shim here and in the follower (through tests/megatron_site); the process
    groups torn down after each trainer."""
    with warnings.catch_warnings(), cpu_megatron(), pytest.MonkeyPatch.context() as mp:
        warnings.simplefilter("ignore")
        mp.setenv("PYTHONPATH", str(ROOT / "tests" / "megatron_site"))
        mp.setenv("ASYNCRL_TEST_MEGATRON_CPU", "1")
        yield
        leave()


def leave() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def config(path: Path, **overrides: Any) -> TrainerConfig:
    # eps: see the parity test; 40-token micro-batches: several per rank (1F1B with M > 1,
    # no_sync under overlapped reduction, the M x D loss scaling across ranks).
    values = {"model_path": str(path), "lr": 1e-3, "adam_eps": 1e-5,
              "max_tokens_per_microbatch": 40}  # fmt: skip
    return TrainerConfig(**(values | overrides))


def two_steps(trainer: Any) -> list[dict[str, float]]:
    return [trainer.train_step(make_batch(i)).metrics for i in range(2)]


LAYOUTS = {
    "megatron-tp2": {"backend": "megatron", "megatron": {"tensor_parallel": 2}},
    "megatron-pp2": {"backend": "megatron", "megatron": {"pipeline_parallel": 2}},
    "megatron-dp2-distopt-overlap": {
        "backend": "megatron",
        "megatron": {"distributed_optimizer": True, "overlap_grad_reduce": True},
    },
    "torch-ddp2": {"backend": "torch"},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_train_like_one(world, tiny_dir, ref_dir, tmp_path, layout: str):
    settings = LAYOUTS[layout]
    common = {"backend": settings["backend"], "ref_model_path": str(ref_dir)}
    one = create_trainer(config(tiny_dir, **common), ALGO)
    want, want_weights = two_steps(one), one.export_weights()
    leave()
    leader = create_trainer(config(tiny_dir, num_ranks=2, **(common | settings)), ALGO)
    assert isinstance(leader, LeaderTrainer)
    try:
        got = two_steps(leader)
        for w, g in zip(want, got, strict=True):
            for key in ("loss", "grad_norm", "entropy", "kl"):
                assert abs(w[key] - g[key]) < 1e-5, (key, w[key], g[key])
        assert got[0]["kl"] > 0.01  # the reference model differs: the KL term is live
        assert max_diff(leader.export_weights(), want_weights) < 1e-5
        leader.save_checkpoint(tmp_path / "ckpt")
        after = leader.train_step(make_batch(2)).metrics
        after_weights = leader.export_weights()
        leader.load_checkpoint(tmp_path / "ckpt")
        assert leader.version == 2
        again = leader.train_step(make_batch(2)).metrics
        assert again["loss"] == after["loss"] and again["grad_norm"] == after["grad_norm"]
        # The update itself: Adam's moments and step counts came back too.
        assert max_diff(leader.export_weights(), after_weights) == 0.0
    finally:
        leader.close()
    assert [p.returncode for p in leader.followers] == [0]


def test_a_call_that_raises_leaves_the_ranks_closed_by_a_kill(world, tiny_dir, tmp_path):
    leader = create_trainer(config(tiny_dir, backend="torch", num_ranks=2), PolicyConfig())
    assert isinstance(leader, LeaderTrainer)
    with pytest.raises(ValueError, match="unreadable"):
        leader.load_checkpoint(tmp_path / "missing")
    out_of_step = "out of step: load_checkpoint raised CheckpointUnreadable"
    with pytest.raises(RuntimeError, match=out_of_step):
        leader.train_step(make_batch(0))
    leader.close(timeout=10)
    assert all(p.returncode is not None for p in leader.followers)


def test_a_dead_follower_fails_the_leaders_next_call(world, tiny_dir):
    leader = create_trainer(config(tiny_dir, backend="torch", num_ranks=2), PolicyConfig())
    assert isinstance(leader, LeaderTrainer)
    leader.train_step(make_batch(0))
    leader.followers[0].kill()
    leader.followers[0].wait()
    with pytest.raises(RuntimeError, match=r"trainer ranks exited \(rank, code\): \[\(1, -9\)\]"):
        leader.train_step(make_batch(1))
    leader.close()


def test_the_ranks_listen_on_loopback_alone(world, tiny_dir):
    """The group's rendezvous store (torch's own listens on every interface and answers
    anyone, unauthenticated) and gloo's pairs: every socket the ranks open is on loopback."""

    def listening(pid: int | None = None) -> set[tuple[str, int]]:
        conns = psutil.Process(pid).net_connections(kind="inet")
        return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}

    before = listening()  # this process's own, from earlier tests
    leader = create_trainer(config(tiny_dir, backend="torch", num_ranks=2), PolicyConfig())
    assert isinstance(leader, LeaderTrainer)
    try:
        leader.train_step(make_batch(0))
        opened = listening() - before
        for follower in leader.followers:
            opened |= listening(follower.pid)
    finally:
        leader.close()
    assert opened and all(ip in ("127.0.0.1", "::1") for ip, _ in opened), opened
