"""One typed config tree for a job, loaded from a preset, a YAML file and ``--flag`` values.

Precedence, lowest first: section defaults, a preset (a function in ``PRESETS``), the YAML
file, then flags (a later flag beats an earlier one). One vocabulary: every leaf's flag is
its YAML key, dotted, ``--`` in front: ``seed`` is ``--seed``, ``rollout.num_actors`` is
``--rollout.num-actors`` (``--rollout.num_actors`` too: ``_`` and ``-`` are the same in a
flag). slime's names for the same concept are aliases (``--rollout-batch-size`` is
``--buffer.groups-per-step``; ``SLIME_FLAGS``, or a field's
``json_schema_extra={"flag": ..., "aliases": [...]}``). A field typed as a pydantic model
is a section; anything else is a leaf. Every flag takes a value, read as JSON, then YAML
(``--seed 3``, ``--x "[1, 2]"``, ``--x true``), except for string leaves, which keep it
verbatim (``--name 007``). ``docs/config.md`` lists every key (``config_reference``).

From argparse: ``add_arguments`` registers each flag with ``default=argparse.SUPPRESS``,
``overrides_from_namespace`` returns what the user typed as ``{"--flag": "text"}``, and
``load_config`` takes that mapping or a ``["--flag", "value", "--flag=value"]`` list.

Every problem becomes one line of a single ``ConfigError``, raised before any process
starts: unknown keys and flags get a did-you-mean, bad values name key, flag, expectation
and value, and values from the file name file and line. Called by the CLI; from the
validated tree the job builds each actor's own settings (``actors/config.py``).
Components own their sections; ``RunConfig`` composes.

Size: the tree and the machinery that reads it (YAML with its line numbers, flags,
did-you-mean, error explanations). The machinery moves to a module of its own when YAML
keys and flags become one vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path, PurePath
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, overload
from urllib.parse import urlsplit

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import ErrorDetails

from asyncrl.buffer.dump import batch_files
from asyncrl.buffer.sources import PromptSource
from asyncrl.buffer.versioned import VersionedBuffer
from asyncrl.errors import InputError
from asyncrl.observe.trackers import check_tracker_setup
from asyncrl.policies.config import PolicyConfig
from asyncrl.rollout.config import EngineConfig, EvalConfig, RolloutConfig
from asyncrl.rollout.reward_config import reward_models
from asyncrl.trainers.config import TrainerConfig, check_group_host
from asyncrl.wire.config import WireConfig
from asyncrl.wire.sockets import check_endpoint

ModelT = TypeVar("ModelT", bound=BaseModel)
Overrides = Sequence[str] | Mapping[str, Any]
_DEST = "config:"
_MISSING = object()


_TP_FLAGS = ("--tp", "--tp-size", "--tensor-parallel-size", "-tp")  # SGLang's, vLLM's


def _server_tp(args: list[str]) -> int:
    """The tensor-parallel size that ``sglang.launch_server`` arguments ask for (1 if none)."""
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag in _TP_FLAGS:
            value = value or (args[i + 1] if i + 1 < len(args) else "1")
            return int(value) if value.isdigit() else 1
    return 1


def _is_loopback_host(host: str) -> bool:
    try:
        check_endpoint(f"tcp://{host}:0")
    except ValueError:
        return False
    return True


class ConfigError(InputError):
    """A config problem, one line each, naming the key, the flag, the value and a hint."""


class KeyConflict(ValueError):
    """A check across sections that blames one key: the error names that key, its flag
    and where it was set (a plain ``ValueError`` of the root would name only "config")."""

    def __init__(self, message: str, path: tuple[str, ...]) -> None:
        super().__init__(message)
        self.path = path


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RayRole(Section):
    """What one actor of a role asks Ray for (its bundle in the role's placement group)."""

    num_cpus: float = Field(0.0, ge=0, allow_inf_nan=False, description="logical CPUs")
    num_gpus: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="GPUs (Ray sets CUDA_VISIBLE_DEVICES)"
    )
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom resources, e.g. {node_a: 1} to pin a node"
    )

    @field_validator("num_gpus")
    @classmethod
    def _whole_above_one(cls, gpus: float) -> float:
        if gpus > 1 and not gpus.is_integer():
            raise ValueError(f"Ray gives a fraction of one GPU or whole GPUs, not {gpus}")
        return gpus

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, resources: dict[str, float]) -> dict[str, float]:
        builtin = sorted(set(resources) & {"CPU", "GPU", "memory", "object_store_memory"})
        if builtin:
            raise ValueError(f"{builtin} are Ray's own resources: use num_cpus / num_gpus")
        bad = {k: v for k, v in resources.items() if not v >= 0 or v == float("inf")}
        if bad:
            raise ValueError(f"resource amounts must be finite and >= 0, got {bad}")
        return resources

    def demand(self) -> dict[str, float]:
        """This role's resources under Ray's names, zeros left out."""
        named = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: v for k, v in named.items() if v > 0}


class RayConfig(Section):
    """The Ray runtime (``--runtime ray``): cluster, resources and placement per role."""

    address: str | None = Field(
        None,
        description="Ray cluster address ('auto', 'HOST:6379', 'ray://HOST:10001'); null: "
        "RAY_ADDRESS when set (ray job submit), else a local cluster sized to the job",
        json_schema_extra={"flag": "ray-address"},
    )
    namespace: str = Field("asyncrl", description="Ray namespace of the job's actors")
    roles: dict[Literal["buffer", "rollout", "engine", "trainer", "eval", "reward"], RayRole] = (
        Field(default_factory=dict, description="resources of each role's actors (default: none)")
    )
    rollout_placement: Literal["spread", "pack"] = Field(
        "spread", description="rollout and engine actors spread over nodes or packed"
    )
    placement_timeout: float = Field(
        120.0, gt=0, description="seconds to wait for the placement groups' resources"
    )

    def role(self, role: str) -> RayRole:
        """The resources of ``role`` (none when not configured)."""
        return self.roles.get(role, RayRole())  # type: ignore[call-overload]


class RuntimeConfig(Section):
    """Where actors run and how the supervisor watches them."""

    type: Literal["local", "ray"] = Field(
        "local",
        description="runtime for the actors: local child processes or a Ray cluster",
        json_schema_extra={"flag": "runtime"},
    )
    host: str = Field(
        "127.0.0.1",
        description="address the job's channels bind to; non-loopback needs wire.curve_keys",
    )
    heartbeat_interval: float = Field(1.0, gt=0, description="seconds between heartbeats")
    heartbeat_timeout: float = Field(
        10.0, gt=0, description="seconds without a heartbeat before an actor counts as hung"
    )
    startup_timeout: float = Field(
        600.0,
        gt=0,
        description="seconds an actor may take to start and set up (imports, model loads) "
        "before it counts as hung; heartbeat_timeout applies once it runs",
    )
    stop_timeout: float = Field(
        10.0, gt=0, description="seconds an actor gets to drain and stop before SIGKILL"
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per actor process; null: the cores shared among the "
        "processes that run torch (trainer, embedded engines, eval)",
    )
    trainer_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads of the trainer process; null: as threads. Idle "
        "OpenMP threads sleep (OMP_WAIT_POLICY=passive), so a trainer given every core "
        "takes the ones idle engines leave",
    )
    fork_server: bool = Field(
        True,
        description="local actors fork from one process that has imported torch, "
        "transformers and the actors (about 3 s of CPU saved per actor start and restart); "
        "off: each actor is a fresh interpreter",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="restarts of each actor after a crash before the job fails (a rollout "
        "actor's work is requeued, the buffer replays its journal, the trainer resumes from "
        "its checkpoint: only with train.checkpoint_interval > 0); 0: any crash ends the job",
    )
    journal: bool = Field(
        True,
        description="the buffer journals every change before acknowledging it, so a "
        "restarted buffer loses nothing (off: the buffer is not restarted)",
    )
    journal_fsync: bool = Field(
        False,
        description="fsync each journal write: survives a machine crash, not only a "
        "process crash, at the disk's sync latency per batch of results",
    )
    buffer_checkpoint_interval: float = Field(
        60.0, gt=0, description="seconds between buffer checkpoints (each starts a new journal)"
    )
    ray: RayConfig = Field(default_factory=RayConfig, description="the Ray runtime")

    @field_validator("host")
    @classmethod
    def _an_address(cls, host: str) -> str:
        try:
            check_endpoint(f"tcp://{host}:0", allow_remote=True)
        except ValueError:
            raise ValueError(f"{host!r} is not an address to bind") from None
        return host

    @model_validator(mode="after")
    def _timeout_exceeds_interval(self) -> RuntimeConfig:
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must be greater than "
                f"heartbeat_interval ({self.heartbeat_interval}), or a healthy actor "
                "would count as hung between two heartbeats"
            )
        return self


class LogConfig(Section):
    """Logging of the controller and every actor."""

    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="lowest level written", json_schema_extra={"flag": "log-level"}
    )
    format: Literal["console", "json"] = Field(
        "console", description="console output for people or JSON lines for machines"
    )
    use_tensorboard: bool = Field(
        False,
        description="also write the metrics to TensorBoard (RUN_DIR/tensorboard)",
        json_schema_extra={"flag": "use-tensorboard"},
    )
    use_wandb: bool = Field(
        False, description="also log the metrics to W&B", json_schema_extra={"flag": "use-wandb"}
    )
    wandb_project: str = Field(
        "asyncrl", description="W&B project", json_schema_extra={"flag": "wandb-project"}
    )
    wandb_group: str | None = Field(
        None, description="W&B run group", json_schema_extra={"flag": "wandb-group"}
    )
    wandb_mode: Literal["online", "offline"] = Field(
        "online",
        description="offline writes RUN_DIR/wandb for a later `wandb sync`",
        json_schema_extra={"flag": "wandb-mode"},
    )

    @model_validator(mode="after")
    def _trackers_can_start(self) -> LogConfig:
        problems = check_tracker_setup(
            tensorboard=self.use_tensorboard, wandb=self.use_wandb, wandb_mode=self.wandb_mode
        )
        if problems:
            raise ValueError("; ".join(problems))
        return self


class TrainConfig(Section):
    """The training loop of ``asyncrl train``: length, checkpoints, weight transport."""

    num_steps: int = Field(
        0, ge=0, description="stop at this trainer version; 0: when the data is used up"
    )
    checkpoint_interval: int = Field(
        0, ge=0, description="checkpoint every N steps (0: only at the end; a crashed "
        "trainer is restarted only with N > 0)",
        json_schema_extra={"flag": "save-interval"},
    )  # fmt: skip
    keep_checkpoints: int | None = Field(
        None, ge=1, description="keep only the newest N trainer checkpoints (null: all)"
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=1,
        description="steps in a row whose loss or gradient is NaN or infinite that are "
        "skipped (weights untouched) before the job fails",
    )
    log_samples: int = Field(
        2,
        ge=0,
        description="trained samples a step written as text to RUN_DIR/samples.jsonl (and "
        "TensorBoard, W&B): the highest and lowest reward first; 0: none",
        json_schema_extra={"flag": "log-samples"},
    )
    audit_log: bool = Field(
        False,
        description="write RUN_DIR/trained.jsonl: every batch trained, with its group uids "
        "(what `asyncrl chaos` checks exactly-once training against)",
    )
    publish: Literal["pull", "disk", "dist", "ipc"] = Field(
        "pull",
        description="weights to engines: chunked pull from the trainer, safetensors on "
        "disk, broadcast in buckets over a gloo group (dist), or shared memory on the "
        "trainer's host (ipc; pulled elsewhere)",
        json_schema_extra={"flag": "update-weight-transport"},
    )
    dist_trusted_network: bool = Field(
        False,
        description="dist: the weight group's store (torch's TCPStore) and gloo's sockets "
        "take no key, so with a non-loopback host anyone on that network can read and "
        "write them; true: that network is trusted",
    )
    update_weight_buffer_size: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="dist: bytes per broadcast bucket; each side holds two (one on the "
        "wire, one being filled). 64 MiB: gloo's best size on loopback (slime's 512 MiB "
        "suits NCCL). ipc: bytes per shared bucket",
        json_schema_extra={"flag": "update-weight-buffer-size"},
    )
    metrics_interval: float = Field(5.0, gt=0, description="seconds between buffer metrics")
    debug_rollout_only: bool = Field(
        False,
        description="no trainer: write every batch to save_rollout_data (default "
        "RUN_DIR/rollout_data) with the weights fixed at version 0",
        json_schema_extra={"flag": "debug-rollout-only"},
    )
    save_rollout_data: str | None = Field(
        None,
        description="directory to write each train batch to (batch_NNNNNN.msgpack)",
        json_schema_extra={"flag": "save-debug-rollout-data"},
    )
    load_rollout_data: str | None = Field(
        None,
        description="train-only: no buffer or engines; train on the batches of this directory",
        json_schema_extra={"flag": "load-debug-rollout-data"},
    )

    @model_validator(mode="after")
    def _one_debug_mode(self) -> TrainConfig:
        if self.debug_rollout_only and self.load_rollout_data:
            raise ValueError(
                "debug_rollout_only (no trainer) and load_rollout_data (no rollout) together "
                "leave nothing to run: pick one"
            )
        if self.load_rollout_data and self.save_rollout_data:
            raise ValueError("load_rollout_data replays a dump: save_rollout_data would copy it")
        if self.load_rollout_data and not batch_files(Path(self.load_rollout_data).expanduser()):
            raise ValueError(
                f"load_rollout_data: {self.load_rollout_data} holds no batch_NNNNNN.msgpack "
                "files (write them with --debug-rollout-only or --save-debug-rollout-data)"
            )
        return self

    def rollout_data_dir(self, run_dir: Path) -> Path | None:
        """Where batches are written: ``save_rollout_data``, or ``RUN_DIR/rollout_data`` in
        rollout-only mode, else None."""
        if self.save_rollout_data:
            return Path(self.save_rollout_data).expanduser()
        return run_dir / "rollout_data" if self.debug_rollout_only else None


def _as_dict(data: Any, key: str) -> dict[str, Any]:
    """``data[key]`` when both are plain dicts (raw config), else empty."""
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, dict) else {}


class RunConfig(Section):
    """The root of a job's configuration: run identity plus one section per component."""

    name: str = Field("asyncrl", min_length=1, description="run name")
    output_dir: str = Field("runs/{name}", description="run directory; {name} is replaced")
    seed: int = Field(0, description="random seed of the job")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="actor runtime")
    wire: WireConfig = Field(default_factory=WireConfig, description="channel limits")
    log: LogConfig = Field(default_factory=LogConfig, description="logging")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="rollout actors")
    trainer: TrainerConfig | None = Field(
        None,
        description="the trainer actor: model, optimizer, backend (needed to train; "
        "--hf-checkpoint sets the model)",
    )
    train: TrainConfig = Field(
        default_factory=TrainConfig,
        description="the training loop around the trainer: steps, checkpoints, weight "
        "publishing, audit",
    )
    buffer: VersionedBuffer.Config = Field(
        default_factory=VersionedBuffer.Config, description="admission, store, APRIL, filters"
    )
    data: PromptSource.Config | None = Field(
        None, description="training prompts (needed to train; --prompt-data sets the file)"
    )
    algo: PolicyConfig = Field(
        default_factory=PolicyConfig, description="RL objective: estimator, loss, KL, corrections"
    )
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="held-out evaluation during training"
    )

    @model_validator(mode="before")
    @classmethod
    def _engines_serve_the_trained_model(cls, data: Any) -> Any:
        """An engine section (rollout's, eval's) without ``model_path`` serves
        ``--hf-checkpoint``'s model when it needs one (a torch engine, or engines launched
        as actors), as a job with no engine section does: ``--rollout.engine.in-process
        false`` alone must not ask for the path again."""
        model = _as_dict(data, "trainer").get("model_path")
        if not model:
            return data
        for name in ("rollout", "eval"):
            section = _as_dict(data, name)
            engine = _as_dict(section, "engine")
            needs = engine.get("type", "torch") == "torch" or engine.get("serve") == "actor"
            if engine and needs and not engine.get("model_path"):
                data = {**data, name: {**section, "engine": {**engine, "model_path": model}}}
        return data

    @model_validator(mode="after")
    def _eval_sets_render_like_the_data(self) -> RunConfig:
        """An eval set that does not say renders its prompts as the training data does: a
        chat model evaluated on raw text would be scored on a task it was not trained on."""
        for s in self.eval.sets:
            if s.apply_chat_template is None:
                s.apply_chat_template = bool(self.data and self.data.apply_chat_template)
        return self

    @model_validator(mode="after")
    def _one_reward_model(self) -> RunConfig:
        """One reward actor a job serves one reward model: two would each take its memory
        and threads beside the engines (give the eval sets the rollout's)."""
        models = reward_models(self.rollout.reward, *(s.reward for s in self.eval.sets))
        if len(models) > 1:
            paths = ", ".join(m.path for m in models)
            raise KeyConflict(
                f"a job serves one reward model, and its rewards name {len(models)} ({paths}): "
                "use the same model settings everywhere",
                ("rollout", "reward"),
            )
        return self

    @model_validator(mode="after")
    def _backend_trains_the_algo(self) -> RunConfig:
        if not self.trainer or self.trainer.backend != "megatron":
            return self
        if self.algo.needs_critic:
            raise KeyConflict(
                f"{self.algo.advantage_estimator} needs a critic, which the megatron backend "
                "does not train: use a critic-free estimator (grpo, rloo, "
                "reinforce_pp_baseline, ...) or --train-backend torch",
                ("algo", "advantage_estimator"),
            )
        return self

    @model_validator(mode="after")
    def _adapter_versions_reach_the_engines(self) -> RunConfig:
        """Only the embedded torch engine merges adapter-only versions (lora_merge.py),
        which reach it by any transport."""
        lora = self.trainer.lora if self.trainer is not None else None
        if lora is None or not lora.enabled or lora.publish != "adapters":
            return self
        engines = [e for e in (self.rollout.engine, self.eval.engine) if e is not None]
        if any(e.type != "torch" or e.serve != "embedded" or e.urls for e in engines):
            raise KeyConflict(
                "trainer.lora.publish adapters: only the embedded torch engine merges "
                "adapter versions onto its base weights; SGLang servers and engine actors "
                "take merged versions: set --lora-publish merged",
                ("trainer", "lora", "publish"),
            )
        base = os.path.realpath(self.trainer.model_path) if self.trainer else ""
        other = [e.model_path for e in engines if e.model_path]
        if any(os.path.realpath(p) != base for p in other):
            raise KeyConflict(
                f"trainer.lora.publish adapters: the engines merge adapters onto the model "
                f"they load ({other[0]}), which must be the trainer's base "
                f"({self.trainer.model_path if self.trainer else None}); drop the engine's "
                "model_path or set --lora-publish merged",
                ("trainer", "lora", "publish"),
            )
        return self

    @model_validator(mode="after")
    def _trained_reward_exists(self) -> RunConfig:
        terms = [t.name for t in self.rollout.reward.terms]
        key = self.trainer.reward_key if self.trainer is not None else "score"
        if terms and key not in ("score", *terms):
            raise KeyConflict(
                f"trainer.reward_key {key!r} is not among the reward's keys (score, "
                f"{', '.join(terms)}): every group would be untrainable",
                ("trainer", "reward_key"),
            )
        return self

    @model_validator(mode="after")
    def _mini_batches_hold_whole_groups(self) -> RunConfig:
        size = self.trainer.global_batch_size if self.trainer is not None else None
        n, groups = self.buffer.num_samples_per_prompt, self.buffer.groups_per_step
        if size is None:
            return self
        if size % n or size > groups * n:
            raise KeyConflict(
                f"trainer.global_batch_size {size} must be a multiple of n_samples_per_prompt "
                f"({n}: a mini-batch holds whole groups, whose samples the advantages "
                f"compare) and at most the rollout batch ({groups} groups x {n} = "
                f"{groups * n} samples)",
                ("trainer", "global_batch_size"),
            )
        return self

    @model_validator(mode="after")
    def _groups_to_compare(self) -> RunConfig:
        """A group-relative advantage of a group of one is ``r - mean(r) = 0``: every
        sample would train with zero loss, silently."""
        estimator = self.algo.advantage_estimator
        group_relative = ("grpo", "dr_grpo", "rloo", "gspo", "cispo", "reinforce_pp_baseline")
        trains = not self.train.debug_rollout_only
        if trains and estimator in group_relative and self.buffer.num_samples_per_prompt < 2:
            raise KeyConflict(
                f"{estimator}'s advantages compare the samples of a prompt's group: with "
                "one sample per prompt each is 0 and nothing is learned; set "
                "--n-samples-per-prompt 2 or more, or use reinforce_pp or ppo",
                ("buffer", "num_samples_per_prompt"),
            )
        return self

    @model_validator(mode="after")
    def _async_needs_a_correction(self) -> RunConfig:
        if not self.train.debug_rollout_only:  # nothing is trained in rollout-only mode
            self.algo.check_async(self.buffer.max_staleness)
        if self.rollout.colocate and self.buffer.max_staleness > 0:
            raise ValueError(
                f"rollout.colocate with max_staleness={self.buffer.max_staleness}: colocated "
                "engines sleep while the trainer steps, so generation cannot run ahead of "
                "training; set --buffer.max-staleness 0 (synchronous) or drop --colocate"
            )
        if self.rollout.tool_use is not None and self.data and not self.data.apply_chat_template:
            raise ValueError(
                "rollout.tool_use needs data.apply_chat_template: the tools' schemas and the "
                "tool messages reach the model through the tokenizer's chat template"
            )
        if self.rollout.agent is not None and (self.rollout.tool_use or self.rollout.workflow):
            raise ValueError(
                "rollout.agent is the workflow, and the agent runs its own tools: drop "
                "rollout.tool_use and rollout.workflow (or drop rollout.agent)"
            )
        if self.train.debug_rollout_only and self.eval.enabled:
            raise ValueError(
                "eval.interval is set but debug_rollout_only never changes the weights: "
                "there is nothing new to evaluate"
            )
        self._engine_actors_fit()
        if not _is_loopback_host(self.runtime.host) and self.wire.curve_keys is None:
            raise ValueError(
                f"runtime.host {self.runtime.host!r} is not loopback: channels bind beyond "
                "this host only encrypted; make keys with `asyncrl keys DIR` and set "
                "--wire.curve-keys DIR"
            )
        if self.train.publish == "dist" and not _is_loopback_host(self.runtime.host):
            check_group_host(f"{self.runtime.host}:0", trusted=self.train.dist_trusted_network)
        return self

    def _one_rank_per_rollout_actor(self, engine: EngineConfig) -> None:
        """dist: each rollout actor's engines are one rank of the weight group (rollout-i
        is rank i + 1), so one server with one TP rank (``rollout/server_group.py``)."""
        flag = "--update-weight-transport dist"
        if engine.router:
            raise ValueError(
                f"{flag} broadcasts to each server, not through a router: list the servers "
                "in urls, or use --update-weight-transport disk"
            )
        if engine.urls and (len(engine.urls) > 1 or self.rollout.num_actors > 1):
            raise ValueError(
                f"{flag} gives each rollout actor one server: {len(engine.urls)} urls for "
                f"{self.rollout.num_actors} rollout actor(s); use --rollout-engine-serve actor "
                "(a server per rollout actor) or --update-weight-transport disk"
            )
        remote = [u for u in engine.urls if not _is_loopback_host(urlsplit(u).hostname or "")]
        if remote:
            raise ValueError(
                f"{flag} into {remote[0]}: a version the group cannot carry (while it forms, "
                "after a failed broadcast) goes to the server through a local folder, which a "
                "server on another host cannot read; use --update-weight-transport disk with "
                "a shared folder, or a server on this host"
            )
        tp = _server_tp(engine.server_args)
        if tp > 1:
            raise ValueError(
                f"{flag} into a server with {tp} tensor-parallel ranks is not supported yet "
                "(one rank per rollout actor): use --update-weight-transport disk"
            )

    def _vllm_has_one_client(self) -> None:
        """A vLLM server takes one client: its pause and weight-update session are the
        server's, so two rollout actors (or an eval engine) at the same url would
        interleave them."""
        engine, other = self.rollout.engine, self.eval.engine
        if engine is None or engine.type != "vllm" or engine.serve != "embedded":
            return
        if self.rollout.num_actors > 1:
            raise ValueError(
                f"rollout.engine.type vllm at urls: a vLLM server takes one client, and "
                f"{self.rollout.num_actors} rollout actors would share it; use "
                "--rollout.engine.serve actor (a vLLM per rollout actor) or one rollout actor"
            )
        if other is not None and other.type == "vllm" and set(other.urls) & set(engine.urls):
            raise ValueError("eval.engine and rollout.engine name the same vLLM server")
        if self.eval.enabled and other is None and not engine.model_path:
            raise ValueError(
                "eval beside vLLM at urls runs its own engine: set rollout.engine.model_path "
                "(the eval actor embeds the torch engine of that model) or eval.engine"
            )

    def _engine_actors_fit(self) -> None:
        self._vllm_has_one_client()
        if self.eval.engine is not None and self.eval.engine.serve == "actor":
            raise ValueError(
                "eval.engine.serve: actor is not supported; the eval actor embeds its engine"
            )
        engine = self.rollout.engine
        if self.train.publish == "dist" and engine is not None:
            self._one_rank_per_rollout_actor(engine)
        if engine is None or engine.serve != "actor":
            return
        if self.train.publish == "pull":
            raise ValueError(
                "rollout.engine.serve: actor serves the engines over HTTP, which take new "
                "weights from disk or by broadcast: set --update-weight-transport disk or dist"
            )
        if self.rollout.colocate:
            raise ValueError("rollout.engine.serve: actor cannot be colocated (yet)")
        if self.eval.enabled and self.eval.engine is None and engine.type == "sglang":
            raise ValueError(
                "eval with launched sglang engines needs its own eval.engine (e.g. the urls "
                "of a server, or an embedded torch engine)"
            )

    def resolved_output_dir(self) -> Path:
        """``output_dir`` with ``{name}`` filled in and ``~`` expanded."""
        return Path(self.output_dir.replace("{name}", self.name)).expanduser()


def debug_cpu() -> RunConfig:
    """A tiny CPU dry run: two rollout actors, fast heartbeats, quick stops."""
    return RunConfig(
        name="debug-cpu",
        runtime=RuntimeConfig(heartbeat_interval=0.5, stop_timeout=5.0),
        rollout=RolloutConfig(num_actors=2),
    )


PRESETS: dict[str, Callable[[], BaseModel]] = {"debug_cpu": debug_cpu}


#: slime's names (aliases of the key flags) for leaves of sections that components own
#: (``docs/design.md`` section 8); a field's own ``json_schema_extra`` adds more.
SLIME_FLAGS: dict[tuple[str, ...], str] = {
    ("buffer", "groups_per_step"): "rollout-batch-size",
    ("buffer", "num_samples_per_prompt"): "n-samples-per-prompt",
    ("buffer", "mask_resumed_tokens"): "mask-offpolicy-in-partial-rollout",
    ("data", "path"): "prompt-data",
    ("eval", "interval"): "eval-interval",
    ("eval", "sets"): "eval-sets",
    ("data", "input_key"): "input-key",
    ("data", "label_key"): "label-key",
    ("data", "metadata_key"): "metadata-key",
    ("data", "tools_key"): "tool-key",
    ("data", "apply_chat_template"): "apply-chat-template",
    ("data", "shuffle"): "rollout-shuffle",
    ("data", "seed"): "rollout-seed",
    ("data", "num_epochs"): "num-epoch",
    ("data", "num_rollouts"): "num-rollout",
    ("algo", "advantage_estimator"): "advantage-estimator",
    ("algo", "eps_clip"): "eps-clip",
    ("algo", "eps_clip_high"): "eps-clip-high",
    ("algo", "eps_clip_c"): "eps-clip-c",
    ("algo", "loss_aggregation"): "loss-aggregation",
    ("algo", "normalize_advantages"): "normalize-advantages",
    ("algo", "kl_coef"): "kl-coef",
    ("algo", "use_kl_loss"): "use-kl-loss",
    ("algo", "kl_loss_coef"): "kl-loss-coef",
    ("algo", "kl_loss_type"): "kl-loss-type",
    ("algo", "entropy_coef"): "entropy-coef",
    ("algo", "gamma"): "gamma",
    ("algo", "lambd"): "lambd",
    ("algo", "value_clip"): "value-clip",
    ("algo", "use_rollout_logprobs"): "use-rollout-logprobs",
    ("algo", "off_policy_correction"): "off-policy-correction",
    ("algo", "is_low"): "tis-clip-low",
    ("algo", "is_high"): "tis-clip",
    ("trainer", "model_path"): "hf-checkpoint",
    ("trainer", "lr"): "lr",
    ("trainer", "weight_decay"): "weight-decay",
    ("trainer", "adam_eps"): "adam-eps",
    ("trainer", "grad_clip"): "clip-grad",
    ("trainer", "warmup_steps"): "lr-warmup-iters",
    ("trainer", "max_tokens_per_microbatch"): "max-tokens-per-gpu",
    ("trainer", "ref_model_path"): "ref-load",
}


#: What ``asyncrl train --help`` shows; ``--help-all`` shows every key.
EVERYDAY: tuple[tuple[str, ...], ...] = (
    ("name",), ("output_dir",), ("seed",),
    ("data", "path"), ("data", "input_key"), ("data", "label_key"),
    ("data", "apply_chat_template"), ("data", "num_epochs"),
    ("trainer", "model_path"), ("trainer", "backend"), ("trainer", "lr"),
    ("trainer", "dtype"), ("trainer", "max_tokens_per_microbatch"),
    ("buffer", "groups_per_step"), ("buffer", "num_samples_per_prompt"),
    ("buffer", "max_staleness"), ("buffer", "over_provision"), ("buffer", "filters"),
    ("rollout", "num_actors"), ("rollout", "sampling"), ("rollout", "workflow"),
    ("rollout", "engine", "type"), ("rollout", "engine", "urls"),
    ("rollout", "reward", "type"),
    ("algo", "advantage_estimator"), ("algo", "off_policy_correction"),
    ("algo", "kl_loss_coef"),
    ("train", "num_steps"), ("train", "checkpoint_interval"), ("train", "publish"),
    ("eval", "interval"), ("eval", "sets"),
    ("runtime", "type"), ("log", "level"), ("log", "use_tensorboard"), ("log", "use_wandb"),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """One leaf of the tree as a command-line option (a row of ``flag_table``)."""

    flag: str
    path: tuple[str, ...]
    annotation: str
    default: Any
    description: str
    metavar: str
    aliases: tuple[str, ...]
    required: bool
    parse: Callable[[str], Any] = dataclasses.field(repr=False, compare=False)

    @property
    def is_switch(self) -> bool:
        """A bool flag: given alone (``--use-kl-loss``) it means true, as in slime."""
        return self.metavar == _BOOL_METAVAR


def flag_table(model: type[BaseModel] = RunConfig) -> dict[str, FlagSpec]:
    """``{"--flag": FlagSpec}`` for every leaf of ``model``, aliases included (the dotted
    key flag first, then slime's names).

    Used by ``load_config``, ``add_arguments`` and the CLI's unknown-option check. Two
    leaves claiming one flag is a programming error and raises ``ValueError``.
    """
    table: dict[str, FlagSpec] = {}
    for spec in _leaves(model):
        for flag in (spec.flag, *spec.aliases):
            if flag in table:
                raise ValueError(
                    f"{flag} names both {'.'.join(table[flag].path)} and {'.'.join(spec.path)}"
                )
            table[flag] = spec
    return table


def _leaves(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[FlagSpec]:
    for name, field in model.model_fields.items():
        section = _section_model(field.annotation)
        if section is not None:
            yield from _leaves(section, (*prefix, name))
        else:
            yield _leaf_spec((*prefix, name), field)


def _section_meanings(
    model: type[BaseModel], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[str, str]]:
    """``(dotted section, its field's description)`` for every section of ``model``."""
    for name, field in model.model_fields.items():
        if (section := _section_model(field.annotation)) is not None:
            yield ".".join((*prefix, name)), field.description or ""
            yield from _section_meanings(section, (*prefix, name))


def _leaf_spec(path: tuple[str, ...], field: pydantic.fields.FieldInfo) -> FlagSpec:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    required = field.is_required()
    named = [extra.get("flag"), SLIME_FLAGS.get(path), *(extra.get("aliases") or ())]
    flag = key_flag(path)
    aliases = dict.fromkeys(_as_flag(str(a)) for a in named if a and _as_flag(str(a)) != flag)
    return FlagSpec(
        flag=flag,
        path=path,
        annotation=_type_text(field.annotation),
        default=None if required else field.get_default(call_default_factory=True),
        description=field.description or "",
        metavar=_metavar(field.annotation),
        aliases=tuple(aliases),
        required=required,
        parse=_value_parser(field.annotation),
    )


def key_flag(path: tuple[str, ...]) -> str:
    """The flag of the key at ``path``: ``("rollout", "num_actors")`` is
    ``--rollout.num-actors``."""
    return "--" + ".".join(part.replace("_", "-") for part in path)


def normal_flag(token: str) -> str:
    """``token`` (``--flag`` or ``--flag=value``) as the table spells the flag: ``_`` and
    ``-`` are one in a key flag, so ``--rollout.num_actors`` is ``--rollout.num-actors``.
    Other tokens (values, slime's names, an SGLang server's flags) are left as they are."""
    name, eq, value = token.partition("=")
    if not (name.startswith("--") and "." in name):
        return token
    return name.replace("_", "-") + eq + value


def _bools_for_numbers(
    data: Any, model: type[BaseModel], loc: tuple[str, ...] = ()
) -> Iterator[ErrorDetails]:
    """A boolean where a number goes: pydantic takes ``true`` as 1, and YAML reads
    ``yes``/``no``/``on``/``off`` as booleans, so ``num_steps: true`` trained 1 step and
    ``lr: yes`` at 1.0."""
    if not isinstance(data, dict):
        return
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            continue
        members = set(_non_null(field.annotation))
        if isinstance(value, bool) and members & {int, float} and bool not in members:
            message = ("expected a number, not a boolean (YAML reads true, false, yes, no, "
                       "on and off as booleans)")  # fmt: skip
            yield ErrorDetails(type="bool_for_number", loc=(*loc, key), msg=message, input=value)
        elif float in members and not isinstance(value, bool) and not _finite(value):
            message = "expected a finite number"
            yield ErrorDetails(type="not_finite", loc=(*loc, key), msg=message, input=value)
        elif (section := _section_model(field.annotation)) is not None:
            yield from _bools_for_numbers(value, section, (*loc, key))


def _finite(value: Any) -> bool:
    """False for NaN and the infinities, as numbers or as text (``--lr inf``)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return True  # not a number at all: pydantic says what is wrong with it
    return math.isfinite(number)


def _section_model(ann: Any) -> type[BaseModel] | None:
    """The model of a section field (``Model`` or ``Model | None``), else None."""
    members = _non_null(ann)
    ann = members[0] if len(members) == 1 else None
    is_model = get_origin(ann) is None and isinstance(ann, type) and issubclass(ann, BaseModel)
    return ann if is_model else None


def _as_flag(name: str) -> str:
    return "--" + name.lstrip("-").replace("_", "-")


def _type_text(ann: Any) -> str:
    if get_origin(ann) is None and isinstance(ann, type):
        return ann.__name__
    return str(ann).replace("typing.", "")


def _non_null(ann: Any) -> list[Any]:
    """The members of a union other than None; ``[ann]`` for anything else."""
    if get_origin(ann) in (Union, types.UnionType):
        return [a for a in get_args(ann) if a is not type(None)]
    return [ann]


_BOOL_METAVAR = "{true,false}"


def _metavar(ann: Any) -> str:
    members = _non_null(ann)
    ann = members[0] if len(members) == 1 else Any
    origin = get_origin(ann) or ann
    if origin is Literal:
        return "{" + ",".join(_show(a) for a in get_args(ann)) + "}"
    named = {bool: _BOOL_METAVAR, list: "LIST", tuple: "LIST", set: "LIST", dict: "MAP"}
    return named.get(origin) or (ann.__name__.upper() if isinstance(ann, type) else "VALUE")


def _is_text(ann: Any) -> bool:
    if get_origin(ann) is Literal:
        return all(isinstance(a, str) for a in get_args(ann))
    return isinstance(ann, type) and issubclass(ann, str | PurePath)


def _value_parser(ann: Any) -> Callable[[str], Any]:
    """How a flag's raw text becomes a value: verbatim for strings, YAML for the rest."""
    if not all(_is_text(a) for a in _non_null(ann)):
        return _parse_yaml
    if type(None) in get_args(ann):
        return lambda raw: None if raw in ("null", "~") else raw
    return str


def _parse_yaml(raw: str) -> Any:
    """JSON first (YAML 1.1 reads ``1e-300``, inside ``{...}`` too, as a string), then YAML."""
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _show(value: Any) -> str:
    """A value as the user would type it: strings bare, the rest as JSON (null, true)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def add_arguments(
    parser: argparse.ArgumentParser,
    model: type[BaseModel] = RunConfig,
    *,
    show: Callable[[FlagSpec], bool] = lambda spec: True,
) -> None:
    """Add every flag of ``model`` to ``parser``, one argument group per section.

    Called by the CLI so ``asyncrl train --help`` lists options with their meaning and
    default: those ``show`` picks (the rest are accepted, and listed by ``--help-all``).
    Values stay raw text; read them back with ``overrides_from_namespace``.
    """
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in {spec.path: spec for spec in flag_table(model).values()}.values():
        section = ".".join(spec.path[:-1]) or "general"
        if section not in groups:
            groups[section] = parser.add_argument_group(section)
        groups[section].add_argument(
            spec.flag,
            *spec.aliases,
            dest=_DEST + spec.flag,
            default=argparse.SUPPRESS,
            metavar=spec.metavar,
            help=_help_text(spec) if show(spec) else argparse.SUPPRESS,
            **({"nargs": "?", "const": "true"} if spec.is_switch else {}),
        )


def everyday(spec: FlagSpec) -> bool:
    """An option ``asyncrl train --help`` shows (``EVERYDAY``)."""
    return spec.path in EVERYDAY


def _help_text(spec: FlagSpec) -> str:
    default = "required" if spec.required else f"default: {_show(spec.default)}"
    return f"{spec.description} ({default})".replace("%", "%%")


def overrides_from_namespace(ns: argparse.Namespace) -> dict[str, str]:
    """``{"--flag": raw text}`` for the config flags the user gave, for ``load_config``."""
    return {key.removeprefix(_DEST): v for key, v in vars(ns).items() if key.startswith(_DEST)}


@overload
def load_config(
    path: str | Path | None = None, overrides: Overrides = (), *, preset: str | None = None
) -> RunConfig: ...
@overload
def load_config(
    path: str | Path | None = None,
    overrides: Overrides = (),
    *,
    preset: str | None = None,
    model: type[ModelT],
) -> ModelT: ...
def load_config(
    path: str | Path | None = None,
    overrides: Overrides = (),
    *,
    preset: str | None = None,
    model: type[BaseModel] = RunConfig,
) -> BaseModel:
    """Build and validate the config of a job; raises ``ConfigError`` listing every problem.

    ``preset`` names a base in ``PRESETS``; ``path`` is a YAML file (or None); ``overrides``
    is ``["--flag", "value", "--flag=value", ...]`` or ``{"--flag": value}`` (from
    ``overrides_from_namespace``). Called by the CLI and by tests.
    """
    table = flag_table(model)
    data = _preset_data(preset)
    origins: dict[tuple[str, ...], str] = {}
    if path is not None:
        file_data, origins = _read_yaml(Path(path))
        _merge(data, file_data)
    values, problems = _flag_values(overrides, table)
    for spec, raw in values:
        _set(data, spec.path, spec.parse(raw) if isinstance(raw, str) else raw)
        for depth in range(1, len(spec.path) + 1):
            origins.pop(spec.path[:depth], None)
    loose = list(_bools_for_numbers(data, model))  # values pydantic would take
    problems += [_explain(err, table, origins) for err in loose]
    try:
        cfg = model.model_validate(data)
    except pydantic.ValidationError as exc:
        said = {tuple(err["loc"]) for err in loose}
        errors = [err for err in exc.errors() if tuple(map(str, err["loc"])) not in said]
        problems += [_explain(err, table, origins) for err in errors]
    if problems:
        raise ConfigError("\n".join(problems))
    return cfg


def _preset_data(name: str | None) -> dict[str, Any]:
    if name is None:
        return {}
    if name not in PRESETS:
        known = ", ".join(PRESETS)
        raise ConfigError(f"unknown preset {name!r}{_hint(name, PRESETS)} (known: {known})")
    return PRESETS[name]().model_dump()


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """The mapping in ``path`` and, for every key in it, ``"file:line"``."""
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    text = path.read_text()
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}{_yaml_problem(exc)}") from None
    if node is None:
        return {}, {}
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(
            f"{path}:{node.start_mark.line + 1}: the top level must be a mapping "
            f"(key: value lines), got a {type(data).__name__}"
        )
    _refuse_duplicates(node, path, ())
    return data, {key: f"{path}:{line}" for key, line in _key_lines(node, ())}


def _refuse_duplicates(node: yaml.MappingNode, path: Path, prefix: tuple[str, ...]) -> None:
    """YAML keeps the last of two equal keys and drops the first silently: refuse them."""
    first: dict[str, int] = {}
    for key, value in node.value:
        name, line = str(key.value), key.start_mark.line + 1
        if name in first:
            dotted = ".".join((*prefix, name))
            raise ConfigError(
                f"{path}:{line}: duplicate key '{dotted}' (first at line {first[name]}): "
                "YAML would keep only this one; write the key once"
            )
        first[name] = line
        if isinstance(value, yaml.MappingNode):
            _refuse_duplicates(value, path, (*prefix, name))


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or problem is None:
        return f": invalid YAML: {exc}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    where = f" ({context} that starts at line {context_mark.line + 1})" if context_mark else ""
    return f":{mark.line + 1}:{mark.column + 1}: invalid YAML: {problem}{where}"


def _key_lines(
    node: yaml.MappingNode, prefix: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], int]]:
    for key, value in node.value:
        path = (*prefix, str(key.value))
        yield path, key.start_mark.line + 1
        if isinstance(value, yaml.MappingNode):
            yield from _key_lines(value, path)


def _flag_values(
    overrides: Overrides, table: dict[str, FlagSpec]
) -> tuple[list[tuple[FlagSpec, Any]], list[str]]:
    """Known ``(spec, raw value)`` pairs in order, and one problem line per bad option."""
    pairs = overrides.items() if isinstance(overrides, Mapping) else _split_options(overrides)
    values: list[tuple[FlagSpec, Any]] = []
    problems: list[str] = []
    for flag, raw in pairs:
        flag = normal_flag(flag)
        if not flag.startswith("--"):
            problems.append(f"expected an option like --flag VALUE, got {flag!r}")
        elif flag not in table:
            problems.append(f"unknown option {flag}{_hint(flag, table, quote=False)}")
        elif raw is _MISSING and table[flag].is_switch:
            values.append((table[flag], "true"))
        elif raw is _MISSING:
            problems.append(f"option {flag} needs a value: {flag} {table[flag].metavar}")
        else:
            values.append((table[flag], raw))
    return values, problems


def _split_options(tokens: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """``--flag value`` and ``--flag=value`` as pairs; a value never starts with ``--``."""
    rest = [tokens] if isinstance(tokens, str) else list(tokens)
    while rest:
        token = rest.pop(0)
        flag, eq, value = token.partition("=")
        if token.startswith("--") and eq:
            yield flag, value
        elif token.startswith("--") and rest and not rest[0].startswith("--"):
            yield token, rest.pop(0)
        else:
            yield token, _MISSING


def _hint(word: str, options: Any, *, quote: bool = True) -> str:
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    if not match:
        return ""
    return f" (did you mean '{match[0]}'?)" if quote else f" (did you mean {match[0]}?)"


def _merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _set(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(data.get(key), dict):
            data[key] = {}
        data = data[key]
    data[path[-1]] = value


def _explain(err: ErrorDetails, table: dict[str, FlagSpec], origins: dict[tuple, str]) -> str:
    """One pydantic error as a line: where it came from, key (flag), expectation, value."""
    loc = tuple(str(part) for part in err["loc"])
    blamed = (err.get("ctx") or {}).get("error")
    if isinstance(blamed, KeyConflict):
        loc = blamed.path
    source = _longest_prefix(origins, loc)
    prefix = f"{source}: " if source else ""
    if err["type"] == "extra_forbidden":
        return f"{prefix}unknown key '{'.'.join(loc)}'{_key_hint(loc, table)}"
    spec = _longest_prefix({s.path: s for s in table.values()}, loc)
    head = ".".join(loc) or "config"  # the key, which is also the flag
    head += f" ({spec.aliases[0]})" if spec and spec.aliases else ""  # slime's name
    message = err["msg"].removeprefix("Value error, ")
    hide = err["type"] == "missing" or isinstance(blamed, KeyConflict)
    hide = hide or (spec is None and isinstance(err.get("input"), dict))
    got = "" if hide else f", got {json.dumps(err.get('input'), default=str)}"
    return f"{prefix}{head}: {message}{got}"


def _longest_prefix(mapping: Mapping[tuple, Any], loc: tuple[str, ...]) -> Any:
    return next((mapping[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in mapping), None)


def _key_hint(loc: tuple[str, ...], table: dict[str, FlagSpec]) -> str:
    """Did-you-mean for an unknown key, against every section and leaf path of the tree;
    a flag's name written as a key (slime's ``rollout_batch_size``) names its key."""
    as_flag = _as_flag(loc[-1]) if loc else ""
    if as_flag in table and table[as_flag].path != loc:
        key = ".".join(table[as_flag].path)
        return f" ({as_flag} is a flag; its key is '{key}')"
    paths = {".".join(s.path[:n]) for s in table.values() for n in range(1, len(s.path) + 1)}
    return _hint(".".join(loc), sorted(paths))


def config_reference(model: type[BaseModel] = RunConfig) -> str:
    """``docs/config.md``: every key of ``model`` with its flag, slime's names, type,
    default and meaning, one table per section (``make config-doc`` writes it; a test
    keeps it current)."""
    specs = list({spec.path: spec for spec in flag_table(model).values()}.values())
    sections: dict[str, list[FlagSpec]] = {}
    for spec in specs:
        sections.setdefault(".".join(spec.path[:-1]) or "(top level)", []).append(spec)
    out = [
        "# Configuration reference",
        "",
        "Generated from the config schema (`asyncrl/config.py`) by `make config-doc`; do not "
        "edit by hand. Every key is a YAML key and, dotted, a flag of `asyncrl train`: "
        "`rollout.num_actors` is `--rollout.num-actors`. Other names are slime's, accepted "
        "as aliases. `asyncrl train --help` shows the everyday keys (marked *), "
        "`--help-all` all of them.",
    ]
    meanings = dict(_section_meanings(model))
    for section, rows in sections.items():
        out += ["", f"## {section}", ""]
        if meanings.get(section):
            out += [meanings[section][0].upper() + meanings[section][1:] + ".", ""]
        out += ["| key | flag | type | default | meaning |"]
        out += ["|---|---|---|---|---|"]
        for spec in rows:
            names = ", ".join(f"`{a}`" for a in (spec.flag, *spec.aliases))
            key = "`" + ".".join(spec.path) + "`" + (" *" if spec.path in EVERYDAY else "")
            default = "required" if spec.required else f"`{_show(spec.default)}`"
            cells = [key, names, f"`{spec.metavar}`", default, spec.description]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"


def dump_resolved(cfg: BaseModel, path: str | Path) -> None:
    """Write the full resolved config as JSON (nulls kept); the CLI calls it per run."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(cfg.model_dump_json(indent=2) + "\n")
