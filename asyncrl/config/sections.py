"""Config sections that no component owns (``runtime``, its ``ray``, ``log``, ``train``),
the ``Section`` base every one shares, and the errors a config check raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncrl.buffer.dump import batch_files
from asyncrl.errors import InputError
from asyncrl.observe.trackers import check_tracker_setup
from asyncrl.wire.sockets import check_endpoint


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
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="GPUs (Ray sets CUDA_VISIBLE_DEVICES)",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom resources, e.g. {node_a: 1} to pin a node",
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
        Field(
            default_factory=dict,
            description="resources of each role's actors (default: none)",
        )
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
        10.0,
        gt=0,
        description="seconds without a heartbeat before an actor counts as hung",
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
        description="torch threads of the trainer process; null: every core of a local "
        "job's machine (as threads when threads is set, or on Ray). Idle OpenMP threads "
        "sleep (OMP_WAIT_POLICY=passive), so the trainer takes the cores idle engines leave",
    )
    lend_trainer_cores: Literal["auto", "always", "never"] = Field(
        "auto",
        description="a local job's embedded CPU engines run on the trainer's cores too while "
        "it waits for a batch (it marks its steps in the run directory; each engine reads "
        "the mark before its steps). auto: where the engine's model is wide enough for more "
        "threads to pay (hidden size >= 256; a 1M toy ran 0.91x with the loan); never, or "
        "with threads set: their own share only",
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
        60.0,
        gt=0,
        description="seconds between buffer checkpoints (each starts a new journal)",
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
        "info",
        description="lowest level written",
        json_schema_extra={"flag": "log-level"},
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
        False,
        description="also log the metrics to W&B",
        json_schema_extra={"flag": "use-wandb"},
    )
    wandb_project: str = Field(
        "asyncrl",
        description="W&B project",
        json_schema_extra={"flag": "wandb-project"},
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
            tensorboard=self.use_tensorboard,
            wandb=self.use_wandb,
            wandb_mode=self.wandb_mode,
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
        0,
        ge=0,
        description="checkpoint every N steps (0: only at the end; a crashed "
        "trainer is restarted only with N > 0)",
        json_schema_extra={"flag": "save-interval"},
    )
    keep_checkpoints: int | None = Field(
        None, ge=1, description="keep only the newest N trainer checkpoints (null: all)"
    )
    async_save: bool | None = Field(
        None,
        description="write interval checkpoints in the background from a copy of the "
        "state taken between steps, while training goes on (one process, no LoRA, twice "
        "the copy's size free; else in the step's time); a checkpoint counts once on disk. "
        "null: on when the trainer computes on a GPU; on a CPU the write takes the cores "
        "the trainer computes on",
        json_schema_extra={"flag": "async-save"},
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
