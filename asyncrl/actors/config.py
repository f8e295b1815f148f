"""Each actor's settings, one typed record per role (``Actor.Config``): built and
validated once by the job (``job.py``), sent in ``ActorSpec.params``, read back as
``self.config``. A default the job's config tree owns is not repeated: such a field is
required. Kept apart from the actors, so the controller imports neither torch nor engines.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.buffer.sources import PromptSource
from asyncrl.buffer.versioned import VersionedBuffer
from asyncrl.policies.config import PolicyConfig
from asyncrl.rollout.config import (
    AgentConfig,
    EngineConfig,
    EvalConfig,
    RewardConfig,
    ToolUseConfig,
)
from asyncrl.rollout.reward_config import RewardModelConfig
from asyncrl.trainers.config import TrainerConfig
from asyncrl.weights.config import GroupConfig


class ActorConfig(BaseModel):
    """A role's own settings, what its actor reads at start: built and validated once by
    the job, sent in ``ActorSpec.params`` and read back typed as ``Actor.config``. Each
    actor class declares its own (``Actor.Config``); the base has no fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PublishConfig(BaseModel):
    """How each new version leaves the trainer (``weights/sync.py``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    transport: Literal["pull", "disk", "dist", "ipc"]
    keep: int = Field(ge=1, description="versions kept for slow subscribers (pull, disk, ipc)")
    bucket_bytes: int = Field(64 << 20, gt=0, description="dist, ipc: bytes per bucket")
    dir: str | None = None  # disk: where each version's safetensors directory goes
    group: GroupConfig | None = None  # dist: the broadcast group, this process rank 0
    #: Subscribers the trainer's drain waits for to pull the final version (the eval
    #: actor), for at most ``linger_s``: the weights live in this process.
    final_pullers: tuple[str, ...] = ()
    linger_s: float = 30.0


class TrainerActorConfig(ActorConfig):
    """The trainer actor's settings (``actors/trainer.py``)."""

    trainer: TrainerConfig
    algo: PolicyConfig
    publish: PublishConfig
    num_steps: int = Field(ge=0, description="stop at this version; 0: when data runs out")
    checkpoint_interval: int = Field(ge=0, description="steps between checkpoints; 0: on stop")
    keep_checkpoints: int | None = Field(ge=1, description="newest kept; None: all")
    async_save: bool = Field(False, description="interval checkpoints written in the background")
    max_nonfinite_steps: int = Field(3, ge=1, description="NaN/Inf steps in a row skipped")
    checkpoint_dir: str | None = None
    resume: bool = False  # start from the newest checkpoint in checkpoint_dir
    resume_from: str | None = None  # start from this checkpoint
    job: str | None = None  # marks this job's checkpoints (a restart loads only its own)
    metrics_path: str | None = None
    samples_path: str | None = None  # a few trained samples a step, as text
    log_samples: int = Field(0, ge=0, description="samples a step written to samples_path")
    audit_path: str | None = None
    save_dump: str | None = None  # write each batch taken there too
    load_dump: str | None = None  # train on these dumped batches, not the buffer's


class BatchDumperConfig(ActorConfig):
    """Where the batches go and how many."""

    dump_dir: str
    num_steps: int = Field(ge=0, description="batches to write; 0: until the data is used up")
    metrics_path: str | None = None


class EngineActorConfig(ActorConfig):
    """The engine to serve, and the key its HTTP API takes."""

    engine: EngineConfig
    api_key: str | None = None


class RewardModelActorConfig(ActorConfig):
    """The reward actor's model (``actors/reward_model.py``)."""

    model: RewardModelConfig


class ProbeActorConfig(ActorConfig):
    """Which role to stand in for, and how many probes to send through each channel."""

    role: str
    count: int = Field(ge=1)
    rollouts: int = Field(ge=1, description="rollout actors in the topology")


class WorkflowConfig(ActorConfig):
    """What a workflow runs with: the rollout actor's, and the eval actor's defaults."""

    engine: EngineConfig
    sampling: dict[str, Any] = Field(description="SGLang sampling params of every request")
    reward: RewardConfig
    workflow: str | None = Field(None, description="dotted path; None: single-turn")
    tool_use: ToolUseConfig | None = None
    agent: AgentConfig | None = None
    tokenizer: str | None = Field(None, description="the policy's; None: the engine model's")


class RolloutActorConfig(WorkflowConfig):
    """The rollout actor's settings (``actors/rollout.py``)."""

    max_groups: int = Field(ge=1, description="groups in flight at once")
    metrics_interval: float = Field(gt=0, description="seconds between metrics rows")
    metrics_dir: str | None = Field(None, description="rows go to <metrics_dir>/<name>.jsonl")
    colocate: bool = False
    engine_api_key: str | None = Field(None, description="its engine actor's key (serve: actor)")
    weight_group: GroupConfig | None = Field(None, description="the dist transport's group")
    spill_dir: str | None = Field(
        None,
        description="dist into SGLang-API engines: where a version that cannot go by "
        "broadcast is written for them to load (<spill_dir>/<name>/)",
    )


class EvalActorConfig(WorkflowConfig):
    """The eval actor's settings (``actors/eval.py``)."""

    eval: EvalConfig
    num_steps: int = Field(ge=0, description="the final version; 0: when the trainer stops")
    metrics_path: str
    final_checkpoint: str | None = Field(None, description="the trainer's final HF weights")
    baseline_from_engine: bool = Field(
        False, description="the engine's initial weights are the trainer's version 0"
    )


class BufferActorConfig(ActorConfig):
    """The buffer actor's settings (``actors/buffer.py``)."""

    buffer: VersionedBuffer.Config
    source: PromptSource.Config | None = Field(None, description="None: no prompts (tests)")
    tokenizer: str | None = Field(None, description="the policy's tokenizer directory")
    checkpoint: str | None = Field(None, description="the checkpoint file")
    snapshots: str | None = Field(None, description="its state at each trainer checkpoint")
    trainer_checkpoints: str | None = Field(None, description="the trainer's checkpoints")
    journal: str | None = Field(None, description="the journal file; None: none kept")
    journal_fsync: bool = False
    checkpoint_interval: float = Field(gt=0, description="seconds between checkpoints")
    journal_max_bytes: int = Field(256 * 1024 * 1024, gt=0, description="checkpoint past it")
    resume: bool = Field(False, description="take the state another job left (--resume)")
    job: str = Field("", description="this job's id, written into its checkpoints")
    metrics_path: str | None = None
    metrics_interval: float = Field(gt=0, description="seconds between metrics rows")
    colocate: bool = False
    rollout_actors: tuple[str, ...] = Field((), description="the producers' names")
