"""A job's config as each actor's typed config: what ``asyncrl train`` starts each with.

``role_params`` gives ``{role: ActorConfig}``, each built once from the ``RunConfig``;
every path inside the run folder is decided here.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from pathlib import Path
from typing import Any

from asyncrl.actors.config import (
    ActorConfig,
    BatchDumperConfig,
    BufferActorConfig,
    EngineActorConfig,
    EvalActorConfig,
    PublishConfig,
    RewardModelActorConfig,
    RolloutActorConfig,
    TrainerActorConfig,
    WorkflowConfig,
)
from asyncrl.buffer.sources import PromptSource
from asyncrl.buffer.versioned import VersionedBuffer
from asyncrl.checkpoints import snapshot_dir, step_dir, trainer_dir
from asyncrl.config import RunConfig
from asyncrl.engines.config import EngineConfig, sampled_dtype
from asyncrl.preflight import tool_schemas
from asyncrl.rollout.reward_config import RewardModelConfig, reward_models
from asyncrl.runtime.topology import rollout_actor_names
from asyncrl.weights.config import GroupConfig

#: Seconds a finished trainer keeps serving its final weights for the eval actor to pull.
FINAL_LINGER_S = 120.0
_UNBOUNDED = 1 << 30


def _source_params(cfg: RunConfig) -> PromptSource.Config | None:
    """The data source's config; with tool use, the tools' schemas for rows without any."""
    if cfg.data is None or cfg.data.default_tools is not None:
        return cfg.data
    return cfg.data.model_copy(update={"default_tools": tool_schemas(cfg)})


def job_reward_model(cfg: RunConfig) -> RewardModelConfig | None:
    """The reward model the job's reward actor serves: the rollout reward's (or a term's)
    unless the trainer reads its batches from files, and the eval sets' when eval runs
    (``RunConfig`` allows one a job)."""
    rewards = [] if cfg.train.load_rollout_data is not None else [cfg.rollout.reward]
    rewards += [s.reward or cfg.rollout.reward for s in cfg.eval.sets] if cfg.eval.enabled else []
    found = reward_models(*rewards)
    return found[0] if found else None


def extra_roles(cfg: RunConfig) -> list[str]:
    """The roles a job has besides buffer, engines, rollouts and trainer."""
    return ["eval"] * cfg.eval.enabled + ["reward"] * (job_reward_model(cfg) is not None)


def role_params(cfg: RunConfig, run_dir: Path, *, resume: bool) -> dict[str, ActorConfig]:
    """Each role's settings, built once from ``cfg`` (what its actor reads as ``config``)."""
    if cfg.trainer is None:
        raise ValueError("training needs a trainer section (--hf-checkpoint)")
    if cfg.data is None and cfg.train.load_rollout_data is None:
        raise ValueError("training needs data (--prompt-data) or --load-debug-rollout-data")
    # Engine actors' HTTP APIs take this job's key (made here, never written to disk).
    engine_key = secrets.token_urlsafe(24) if engine_actor_count(cfg) else None
    # Marks this job's checkpoints: a restarted trainer or buffer loads only its own job's.
    job = secrets.token_hex(8)
    resumed_at = last_step(run_dir / "metrics.jsonl") if resume else None
    rollout = _rollout_config(cfg, run_dir, engine_key, resumed_at)
    eval_engine = cfg.eval.engine.seeded(cfg.seed) if cfg.eval.engine else _embedded(rollout.engine)
    return {
        "buffer": _buffer_config(cfg, run_dir, resume=resume, job=job),
        "rollout": rollout,
        "trainer": _trainer_config(cfg, run_dir, resume=resume, job=job),
        "engine": EngineActorConfig(engine=rollout.engine, api_key=engine_key),
        "eval": EvalActorConfig(
            **_workflow_fields(rollout)
            # The eval actor's own engine: embedded, whatever serves the rollout.
            | {"engine": eval_engine},
            eval=cfg.eval,
            baseline_from_engine=same_model(eval_engine.model_path, cfg.trainer.model_path),
            num_steps=cfg.train.num_steps,
            final_checkpoint=str(final_policy_dir(run_dir, cfg.train.num_steps)),
            metrics_path=str(run_dir / "metrics" / "eval.jsonl"),
        ),
    } | _reward_config(cfg)


def same_model(engine_path: str | None, trainer_path: str) -> bool:
    """Whether an engine loads the trainer's starting checkpoint (its version 0)."""
    return engine_path is not None and Path(engine_path).resolve() == Path(trainer_path).resolve()


def _reward_config(cfg: RunConfig) -> dict[str, ActorConfig]:
    model = job_reward_model(cfg)
    return {} if model is None else {"reward": RewardModelActorConfig(model=model)}


def _rollout_config(
    cfg: RunConfig, run_dir: Path, engine_key: str | None, resumed_at: int | None
) -> RolloutActorConfig:
    assert cfg.trainer is not None
    r, model = cfg.rollout, cfg.trainer.model_path
    dtype = sampled_dtype(cfg.trainer.dtype, model)
    engine = r.engine or EngineConfig(type="torch", model_path=model, dtype=dtype)
    return RolloutActorConfig(
        engine=engine.seeded(cfg.seed, resumed_at),
        sampling=dict(r.sampling),
        reward=r.reward,
        workflow=r.workflow,
        tool_use=r.tool_use,
        agent=r.agent,
        tokenizer=model,
        max_groups=r.max_groups,
        metrics_dir=str(run_dir / "metrics"),
        metrics_interval=cfg.train.metrics_interval,
        colocate=r.colocate,
        engine_api_key=engine_key,
        weight_group=_weight_group(cfg),
        spill_dir=str(run_dir / "engine_weights"),
    )


def _weight_group(cfg: RunConfig) -> GroupConfig | None:
    """The dist transport's group: the trainer (rank 0) and every rollout actor."""
    if cfg.train.publish != "dist":
        return None
    return GroupConfig(
        world_size=1 + cfg.rollout.num_actors,
        bucket_bytes=cfg.train.update_weight_buffer_size,
        trusted_network=cfg.train.dist_trusted_network,
    )


def _embedded(engine: EngineConfig) -> EngineConfig:
    """The rollout's engine, embedded. vLLM becomes the torch engine of its model when it
    names one: an eval set's sampling may truncate, which vLLM's log-probs do not allow,
    and a vLLM server takes one client (``RunConfig`` asks for ``eval.engine`` when no
    model is named and eval runs)."""
    fields = {**engine.model_dump(), "serve": "embedded"}
    if engine.type == "vllm" and engine.model_path:
        fields |= {"type": "torch", "urls": [], "server_args": [], "vllm_python": None}
    return EngineConfig.model_validate(fields)


def _workflow_fields(rollout: RolloutActorConfig) -> dict[str, Any]:
    """What the eval actor shares with the rollout actor (``WorkflowConfig``)."""
    return {name: getattr(rollout, name) for name in WorkflowConfig.model_fields}


def _trainer_config(
    cfg: RunConfig, run_dir: Path, *, resume: bool, job: str
) -> TrainerActorConfig | BatchDumperConfig:
    assert cfg.trainer is not None
    train = cfg.train
    dump = train.rollout_data_dir(run_dir)
    if train.debug_rollout_only:
        return BatchDumperConfig(
            dump_dir=str(dump),
            num_steps=train.num_steps,
            metrics_path=str(run_dir / "metrics.jsonl"),
        )
    # The eval actor pulls the final version after the last step: the trainer lingers.
    final = {"final_pullers": ("eval",), "linger_s": FINAL_LINGER_S} if cfg.eval.enabled else {}
    publish = PublishConfig(
        transport=train.publish,
        keep=2,
        dir=str(run_dir / "weights") if train.publish == "disk" else None,
        group=_weight_group(cfg),
        bucket_bytes=train.update_weight_buffer_size,
        **final,
    )
    return TrainerActorConfig(
        trainer=cfg.trainer,
        algo=cfg.algo,
        publish=publish,
        num_steps=train.num_steps,
        checkpoint_interval=train.checkpoint_interval,
        keep_checkpoints=train.keep_checkpoints,
        async_save=train.async_save
        if train.async_save is not None
        else cfg.trainer.device.startswith("cuda"),
        max_nonfinite_steps=train.max_nonfinite_steps,
        checkpoint_dir=str(run_dir / "checkpoints" / "trainer"),
        resume=resume,
        job=job,
        metrics_path=str(run_dir / "metrics.jsonl"),
        samples_path=str(run_dir / "samples.jsonl"),
        log_samples=train.log_samples,
        audit_path=str(run_dir / "trained.jsonl") if train.audit_log else None,
        save_dump=str(dump) if dump else None,
        load_dump=train.load_rollout_data,
    )


def _buffer_config(cfg: RunConfig, run_dir: Path, *, resume: bool, job: str) -> BufferActorConfig:
    assert cfg.trainer is not None
    ckpt = run_dir / "checkpoints"
    return BufferActorConfig(
        buffer=_buffer_params(cfg),
        source=_source_params(cfg),
        tokenizer=cfg.trainer.model_path,
        checkpoint=str(ckpt / "buffer.ckpt"),
        snapshots=str(snapshot_dir(run_dir)),
        trainer_checkpoints=str(trainer_dir(run_dir)),
        journal=str(ckpt / "buffer.journal") if cfg.runtime.journal else None,
        journal_fsync=cfg.runtime.journal_fsync,
        checkpoint_interval=cfg.runtime.buffer_checkpoint_interval,
        resume=resume,
        job=job,
        metrics_path=str(run_dir / "metrics" / "buffer.jsonl"),
        metrics_interval=cfg.train.metrics_interval,
        colocate=cfg.rollout.colocate,
        rollout_actors=tuple(rollout_actor_names(cfg.rollout.num_actors)),
    )


def _buffer_params(cfg: RunConfig) -> VersionedBuffer.Config:
    """The buffer's config. Rollout-only lifts the staleness bound: the weights never
    change, so every sample is fresh and admission need not wait for a trainer."""
    if not cfg.train.debug_rollout_only:
        return cfg.buffer
    lifted = {"max_staleness": _UNBOUNDED, "hard_staleness": None, "age_guarantee": None}
    return cfg.buffer.model_copy(update=lifted)


def final_policy_dir(run_dir: Path, steps: int) -> Path:
    """Where the trainer's checkpoint of its last step keeps the HF weights."""
    return step_dir(trainer_dir(run_dir), steps) / "policy"


def last_step(metrics: Path) -> int:
    """The version of the last whole row in ``metrics`` (0 if none; a kill cuts lines)."""
    for line in reversed(metrics.read_text().splitlines() if metrics.exists() else []):
        with contextlib.suppress(json.JSONDecodeError):
            return int(json.loads(line).get("step", 0))
    return 0


def engine_actor_count(cfg: RunConfig) -> int:
    """One engine actor per rollout actor when the engines are served by actors."""
    engine = cfg.rollout.engine
    return cfg.rollout.num_actors if engine is not None and engine.serve == "actor" else 0
