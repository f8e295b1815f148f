"""A trainer over several processes on one host: rank 0 leads, ranks 1..N-1 follow.

Every ``Trainer`` method is collective under DP, TP and PP, so all ranks must make the
same calls in the same order: the leader broadcasts each call (its name and arguments as
MessagePack over a gloo group) before it makes the call itself, one call at a time, and
each follower makes it on receipt. A call that raises (other than ``UntrainableBatch``,
which every rank raises alike before any collective) leaves the ranks out of step: the
trainer is then broken, and ``close()`` kills the followers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from asyncrl.buffer.dump import decode_batch, encode_batch
from asyncrl.weights.group import serve_store
from asyncrl.wire.sockets import free_tcp_endpoint, release_endpoints

if TYPE_CHECKING:
    from asyncrl.policies import PolicyConfig
    from asyncrl.trainers.base import StepResult, Trainer
    from asyncrl.trainers.config import TrainerConfig
    from asyncrl.types import TrainBatch

R = TypeVar("R")
_CALLS = (
    "train_step",
    "sft_step",
    "export_weights",
    "save_hf",
    "save_checkpoint",
    "load_checkpoint",
    "close",
)


def _backend_name(config: TrainerConfig) -> str:
    return "nccl" if config.device == "cuda" else "gloo"


class LeaderTrainer:
    """Rank 0 of a multi-process trainer: the ``Trainer`` protocol, each call made on every
    rank (see the module docstring)."""

    def __init__(self, trainer: Trainer, group: Any, followers: list[subprocess.Popen]) -> None:
        self.trainer = trainer
        self.group = group
        self.followers = followers
        self.broken: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def start(cls, config: TrainerConfig, algo: PolicyConfig | None) -> LeaderTrainer:
        """Start the followers (``python -m asyncrl.trainers.ranks``, each building the same
        backend from the same config), join them in the process group (gloo on the CPU,
        nccl on CUDA, where ``LOCAL_RANK`` picks each rank's GPU), build rank 0's backend."""
        from asyncrl.trainers.backends import backend

        endpoint, n = free_tcp_endpoint(), config.num_ranks
        spec = json.dumps(
            {
                "config": config.model_dump(mode="json"),
                "algo": algo.model_dump(mode="json") if algo is not None else None,
                "address": endpoint,
            }
        ).encode()
        followers = [_start_follower(rank, n, spec) for rank in range(1, n)]
        try:
            store = _store(endpoint, n)
            group = _join(config, store, 0, n)
            trainer = backend(config, algo)
        except BaseException:
            for proc in followers:
                proc.kill()
            raise
        return cls(trainer, group, followers)

    @property
    def version(self) -> int:
        return self.trainer.version

    @version.setter
    def version(self, value: int) -> None:
        self.trainer.version = value

    def _on_all(self, call: str, payload: dict[str, Any], run: Callable[[], R]) -> R:
        """Broadcast ``call``, then ``run()`` it here; one call at a time (two threads'
        broadcasts and collectives must never interleave)."""
        from asyncrl.trainers.base import UntrainableBatch

        with self._lock:
            if self.broken:
                raise RuntimeError(f"the trainer ranks are out of step: {self.broken}")
            self._check_followers()
            _send(msgspec.msgpack.encode({"call": call, **payload}), self.group)
            try:
                return run()
            except UntrainableBatch:
                raise
            except BaseException as exc:
                self.broken = f"{call} raised {type(exc).__name__}: {exc}"
                raise

    def _check_followers(self) -> None:
        dead = [(i + 1, p.returncode) for i, p in enumerate(self.followers) if p.poll() is not None]
        if dead:
            self.broken = f"trainer ranks exited (rank, code): {dead}"
            raise RuntimeError(self.broken)

    def train_step(self, batch: TrainBatch) -> StepResult:
        payload = {"batch": encode_batch(batch)}
        return self._on_all("train_step", payload, partial(self.trainer.train_step, batch))

    def sft_step(
        self,
        tokens: Sequence[np.ndarray],
        loss_masks: Sequence[np.ndarray],
        label_smoothing: float = 0.0,
    ) -> StepResult:
        arrays = {"tokens": [_pack(t) for t in tokens], "masks": [_pack(m) for m in loss_masks]}
        return self._on_all(
            "sft_step",
            arrays | {"label_smoothing": label_smoothing},
            partial(self.trainer.sft_step, tokens, loss_masks, label_smoothing),
        )

    def export_weights(self, copy: bool = True) -> dict[str, torch.Tensor]:
        # The other ranks take part in the gather, if any; their copies are not served.
        return self._on_all("export_weights", {}, partial(self.trainer.export_weights, copy))

    def save_hf(self, path: Path) -> None:
        self._on_all("save_hf", {"path": str(path)}, partial(self.trainer.save_hf, path))

    def snapshot_checkpoint(self) -> Callable[[Path], None] | None:
        """None: saved in the step's time (every rank saves in step with the others)."""
        return None

    def save_checkpoint(self, path: Path) -> None:
        self._on_all(
            "save_checkpoint", {"path": str(path)}, partial(self.trainer.save_checkpoint, path)
        )

    def load_checkpoint(self, path: Path) -> None:
        self._on_all(
            "load_checkpoint", {"path": str(path)}, partial(self.trainer.load_checkpoint, path)
        )

    def close(self, timeout: float = 30.0) -> None:
        """Stop the followers: a ``close`` call they exit 0 on, or, when the ranks are out
        of step (or a call is stuck past ``timeout``), a kill."""
        if self._lock.acquire(timeout=timeout):
            try:
                if not self.broken and all(p.poll() is None for p in self.followers):
                    _send(msgspec.msgpack.encode({"call": "close"}), self.group)
                else:
                    self._kill()
            finally:
                self._lock.release()
        else:
            self._kill()
        for proc in self.followers:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _kill(self) -> None:
        for proc in self.followers:
            if proc.poll() is None:
                proc.kill()


def _pack(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array, dtype=np.int64).tobytes()


def _unpack(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.int64).copy()


def _send(payload: bytes, group: Any) -> None:
    dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0, group=group)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)


def _receive(group: Any) -> dict[str, Any]:
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return msgspec.msgpack.decode(data.numpy().tobytes())


def _store(endpoint: str, world: int, leader: bool = True) -> dist.TCPStore:
    """The group's rendezvous store at ``endpoint``: the leader's listens on loopback alone
    (torch's own would listen on every interface, unauthenticated); a follower's connects."""
    host, port = urlsplit(endpoint).hostname or "127.0.0.1", urlsplit(endpoint).port or 0
    if not leader:
        return dist.TCPStore(host, port, world, False, timeout=default_pg_timeout)
    try:
        return serve_store(host, port, default_pg_timeout, world, wait_for_workers=False)
    finally:
        release_endpoints([endpoint])  # bound now, or failed: the claim has done its job


def _join(config: TrainerConfig, store: dist.Store, rank: int, world: int) -> Any:
    """This process as ``rank`` of the trainer's group, and the gloo group of the calls."""
    dist.init_process_group(_backend_name(config), store=store, rank=rank, world_size=world)
    return dist.new_group(backend="gloo")


def _start_follower(rank: int, world: int, spec: bytes) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.trainers.ranks"], stdin=subprocess.PIPE, env=env
    )
    assert proc.stdin is not None
    proc.stdin.write(spec)
    proc.stdin.close()
    return proc


def _die_with_parent(poll_s: float = 1.0) -> None:
    """Exit when the leader's process is gone (this process is re-parented). Polled from a
    daemon thread: ``PR_SET_PDEATHSIG`` would fire when the leader's *thread* that started
    us ends, and the leader starts followers from a worker thread."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="leader-watch", daemon=True).start()


def follow(spec: dict[str, Any]) -> None:
    """A follower's life: join, build the backend, make each call the leader broadcasts."""
    from asyncrl.policies import PolicyConfig
    from asyncrl.trainers.backends import backend
    from asyncrl.trainers.config import TrainerConfig

    config = TrainerConfig(**spec["config"])
    algo = PolicyConfig(**spec["algo"]) if spec["algo"] is not None else None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    group = _join(config, _store(spec["address"], world, leader=False), rank, world)
    trainer = backend(config, algo)
    while (msg := _receive(group))["call"] != "close":
        _call(trainer, msg)


def _call(trainer: Trainer, msg: dict[str, Any]) -> None:
    from asyncrl.trainers.base import UntrainableBatch

    call = msg["call"]
    if call == "train_step":
        try:
            trainer.train_step(decode_batch(msg["batch"]))
        except UntrainableBatch:  # the leader skips the same batch; so does every rank
            pass
    elif call == "sft_step":
        tokens, masks = [_unpack(t) for t in msg["tokens"]], [_unpack(m) for m in msg["masks"]]
        trainer.sft_step(tokens, masks, msg["label_smoothing"])
    elif call == "export_weights":
        trainer.export_weights()
    elif call in ("save_hf", "save_checkpoint", "load_checkpoint"):
        getattr(trainer, call)(Path(msg["path"]))
    else:
        raise ValueError(f"unknown trainer call {call!r} (known: {', '.join(_CALLS)})")


def _exit_cleanly() -> None:
    """End a follower whose work is done without the interpreter's teardown: gloo's run-loop
    threads outlive ``destroy_process_group``, and destroying them at exit can abort the
    process ("terminate called without an active exception") after everything finished."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _die_with_parent()
    follow(json.loads(sys.stdin.buffer.read()))
    _exit_cleanly()
