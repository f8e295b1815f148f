"""Restart policy of a training job: which actors come back after a crash, and how.

A role is restarted only where the restart can be exact (``restart_budgets``), and
``RestartHooks`` prepare each restart so that no work is lost or done twice.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from asyncrl.actors.base import CHECKPOINTED_STAT, ActorSpec, Incarnation
from asyncrl.observe.logs import get_logger
from asyncrl.wire.errors import PeerLost, RemoteError
from asyncrl.wire.messages import Command

if TYPE_CHECKING:
    from asyncrl.config import RunConfig
    from asyncrl.runtime.supervisor import ActorStatus, Supervisor
    from asyncrl.wire.control import ControlServer

log = get_logger("asyncrl.controller")
_RETRY_S = 0.5


def restart_budgets(cfg: RunConfig) -> dict[str, int]:
    """Restarts per actor of each role (``runtime.max_restarts``), none where a restart
    could not be exact: the trainer needs periodic checkpoints (``train.checkpoint_interval``;
    the buffer keeps every batch after the newest one, and a restarted trainer retrains
    them), the buffer its journal (``runtime.journal``)."""
    n = cfg.runtime.max_restarts
    train = cfg.train
    trainer_exact = train.checkpoint_interval > 0 and not (
        train.debug_rollout_only or train.load_rollout_data
    )
    return {
        "rollout": n,
        "engine": n,
        "eval": n,
        "reward": n,  # stateless: callers send their lost calls again
        "buffer": n if cfg.runtime.journal else 0,
        "trainer": n if trainer_exact else 0,
    }


class RestartHooks:
    """``before_restart`` / ``after_restart`` for the supervisor.

    A rollout actor's work is requeued at the buffer first (asked again for up to
    ``wait_s`` while the buffer itself is restarting). A buffer or trainer starts as
    ``restarted``: from its checkpoint (the buffer's, plus its journal; the newest one this
    job's trainer wrote, then a resync, so the buffer serves again every batch after it).
    Once an incarnation wrote that state, finding it missing ends the job (``RunStateLost``).
    """

    def __init__(
        self,
        control: ControlServer,
        *,
        wait_s: float = 300.0,
        engine_wait_s: float = 900.0,
        checkpoint_interval: int = 0,
    ) -> None:
        self.control = control
        self.wait_s = wait_s
        self.engine_wait_s = engine_wait_s  # an engine's start-up (its model load) and more
        self.checkpoint_interval = checkpoint_interval  # the trainer's (train.*)

    async def before_restart(self, spec: ActorSpec, status: ActorStatus) -> ActorSpec | None:
        """Prepare the restart of ``spec``; returns the spec to start, if changed."""
        if spec.role == "rollout":
            await self._requeue(spec.name)
        elif spec.role == "buffer":
            # Once an incarnation got past its set-up, it wrote a checkpoint (and a
            # journal): from then on, that state missing is an error, not a fresh start.
            return _restarted(spec, wrote_state=status.ran)
        elif spec.role == "trainer":
            # A trainer that reported a complete checkpoint past its start: the restart
            # must find one, not start again from the base model. Not its version: that
            # runs ahead while a checkpoint is written, and a kill then (seconds on a real
            # model) leaves none to find; the buffer still holds every batch since.
            wrote = status.stats.get(CHECKPOINTED_STAT, -1.0) > 0
            return _restarted(spec, wrote_state=self.checkpoint_interval > 0 and wrote)
        return None

    async def after_restart(self, spec: ActorSpec) -> None:
        """Once ``spec`` is up again: a restarted engine's rollout actor reloads its
        weights into it (an idle rollout actor would not notice the engine died)."""
        if spec.role != "engine":
            return
        rollout = spec.name.replace("engine-", "rollout-", 1)
        # One long call: the rollout actor waits for the engine's health, which may take
        # the engine's whole start-up; a second copy of the command would queue behind it.
        cmd = Command(kind="engine_restarted")
        reply = await self._command(rollout, cmd, wait_s=self.engine_wait_s, per_call_s=None)
        log.warning("restarted engine reloaded", engine=spec.name, **reply)

    async def feed_final(self, sup: Supervisor, version: int, path: Path) -> None:
        """Until cancelled: each eval incarnation after the first is told to evaluate the
        final ``version`` from ``path`` (HF weights) once it is up and the path exists (the
        trainer's announcement of it left with the trainer)."""
        told = 0
        while True:
            st = sup.status.get("eval")
            due = st is not None and st.restarts > told and st.hello
            if st is not None and due and await asyncio.to_thread(path.is_dir):
                cmd = Command(kind="evaluate_final", args={"version": version, "path": str(path)})
                try:
                    async with asyncio.timeout(30.0):
                        await self.control.command("eval", cmd)
                    told = st.restarts
                    log.warning(
                        "the restarted eval actor evaluates the final checkpoint",
                        version=version,
                        path=str(path),
                    )
                except (PeerLost, RemoteError, TimeoutError) as exc:
                    log.warning("eval not told of the final checkpoint yet", error=str(exc))
            await asyncio.sleep(_RETRY_S)

    async def _requeue(self, actor: str) -> None:
        reply = await self._command("buffer", Command(kind="requeue", args={"actor": actor}))
        log.warning("requeued a dead producer's work", actor=actor, **reply)

    async def _command(
        self,
        actor: str,
        cmd: Command,
        *,
        wait_s: float | None = None,
        per_call_s: float | None = 30.0,
    ) -> dict[str, object]:
        """``cmd`` to ``actor``, sent again while it is away (restarting) for up to
        ``wait_s`` seconds (default ``self.wait_s``), each try bounded by ``per_call_s``
        (None: the whole wait); a peer that answers with an error fails at once."""
        wait_s = self.wait_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            try:
                async with asyncio.timeout(max(1.0, min(per_call_s or left, left))):
                    return dict((await self.control.command(actor, cmd)).data)
            except (PeerLost, TimeoutError) as exc:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{actor} did not answer {cmd.kind!r} within {wait_s:.0f}s: {exc}"
                    ) from None
            except RemoteError:
                raise
            await asyncio.sleep(_RETRY_S)


def _restarted(spec: ActorSpec, *, wrote_state: bool) -> ActorSpec:
    """``spec`` for a restart; state an earlier incarnation wrote stays expected."""
    expected = spec.incarnation.state_expected or wrote_state
    return msgspec.structs.replace(
        spec, incarnation=Incarnation(restarted=True, state_expected=expected)
    )
