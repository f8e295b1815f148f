"""RewardModelActor: a reward model in a process of its own, scoring for the whole job.

One actor serves every rollout and eval actor of a job with a ``type: model`` reward: the
model loads once, off the engines' and trainer's processes, and all callers' pairs share
its batches (``rollout/reward_model.py``). It keeps no state: the supervisor restarts it
after a crash, and callers resend lost calls (a score has no side effect) until their
reward's ``timeout_s``.
"""

from __future__ import annotations

from asyncrl.actors.base import Actor
from asyncrl.actors.config import RewardModelActorConfig
from asyncrl.rollout.reward_model import (
    REPLY_CODEC,
    REQUEST_CODEC,
    RewardModel,
    RewardModelError,
    RewardModelReply,
    RewardModelRequest,
)
from asyncrl.wire.rpc import RpcServer

#: The endpoint the reward actor binds.
ENDPOINT = "reward.score"


class RewardModelActor(Actor):
    """Serves the job's reward model; see the module docstring."""

    Config = RewardModelActorConfig
    config: RewardModelActorConfig

    async def setup(self) -> None:
        self.model = await self.hold(RewardModel(self.config.model))
        server = RpcServer(
            self.spec.endpoints[ENDPOINT],
            REQUEST_CODEC,
            REPLY_CODEC,
            self._serve,
            max_concurrency=256,
            hwm=self.wire.hwm,
        )
        await self.open(server, "score")

    async def _serve(self, request: RewardModelRequest, client: bytes) -> RewardModelReply:
        results = await self.model.score_many(request.prompts, request.responses)
        return RewardModelReply(
            scores=[None if isinstance(r, RewardModelError) else r for r in results],
            errors=[str(r) if isinstance(r, RewardModelError) else None for r in results],
        )

    async def run(self) -> None:
        await self.wait_stopping()

    def stats(self) -> dict[str, float]:
        model = getattr(self, "model", None)
        return dict(model.stats) if model is not None else {}
