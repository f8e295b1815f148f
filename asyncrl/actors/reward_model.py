"""RewardModelActor: a reward model in a process of its own, scoring for the whole job.

    rollout-i, eval --RewardModelRequest (rpc)--> reward   binds reward.score

One reward actor serves every rollout actor and the eval actor of a job whose reward (or
a reward term, or an eval set's reward) is ``type: model``: the model is loaded once, off
the engines' and the trainer's processes, and pairs from every caller share its batches
(``rollout/reward_model.py``: ``batch_size`` pairs a forward, ``batch_wait_ms`` to fill
one). A request's pairs are answered together, each with its score or its reason.

It keeps no state: the supervisor restarts it after a crash, and callers send their lost
calls again (a score has no side effect) until their reward's ``timeout_s``.

Settings: ``RewardModelActor.Config`` (the ``RewardModelConfig``).
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
        server = RpcServer(self.spec.endpoints[ENDPOINT], REQUEST_CODEC, REPLY_CODEC,
                           self._serve, max_concurrency=256, hwm=self.wire.hwm)  # fmt: skip
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
