"""``TrainerConfig``: the trainer's settings (the ``trainer`` config section).

Kept apart from the backends so the config tree (and ``asyncrl --help``) reads it without
importing torch; ``TorchTrainer.Config`` and ``MegatronTrainer.Config`` are this class.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncrl.hardware import low_precision_pays


class MegatronConfig(BaseModel):
    """megatron-core's parallel layout (``backend: megatron``); data parallel is the rest.

    The trainer's ``num_ranks`` processes hold ``TP * PP * DP`` ranks, so TP x PP must
    divide ``num_ranks``.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    tensor_parallel: int = Field(
        1, ge=1, description="TP size", json_schema_extra={"flag": "tensor-model-parallel-size"}
    )
    pipeline_parallel: int = Field(
        1, ge=1, description="PP size", json_schema_extra={"flag": "pipeline-model-parallel-size"}
    )
    distributed_optimizer: bool = Field(
        False,
        description="shard optimizer state over DP ranks (ZeRO-1)",
        json_schema_extra={"flag": "use-distributed-optimizer"},
    )
    overlap_grad_reduce: bool = Field(
        False,
        description="reduce gradient buckets during the last micro-batch's backward",
        json_schema_extra={"flag": "overlap-grad-reduce"},
    )
    transformer_impl: Literal["auto", "local", "transformer_engine"] = Field(
        "auto",
        description="layer spec: transformer_engine (fused kernels, THD packing), local "
        "(plain torch; packing by a block-diagonal mask), auto: TE when installed",
        json_schema_extra={"flag": "transformer-impl"},
    )


class SimTrainerConfig(BaseModel):
    """The sim backend's step time (modelled seconds; ``sim_trainer.SimTrainer``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    step_base_s: float = Field(1.0, ge=0, description="a step's fixed cost")
    step_s_per_token: float = Field(
        1e-4, ge=0, description="per forwarded token (forward, backward, old log-probs)"
    )
    time_scale: float = Field(1.0, gt=0, description="modelled seconds per wall second")


class LoraConfig(BaseModel):
    """LoRA adapters on the policy (``trainers/lora.py``); rank 0 trains every weight."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    rank: int = Field(
        0,
        ge=0,
        description="adapter rank r; 0: no adapters, every weight is trained",
        json_schema_extra={"flag": "lora-rank"},
    )
    alpha: float = Field(
        16.0,
        gt=0,
        description="adapter scale: an adapted linear adds (alpha / r) B A to its weight",
        json_schema_extra={"flag": "lora-alpha"},
    )
    target_modules: Annotated[list[str], Field(min_length=1)] | Literal["all-linear"] = Field(
        "all-linear",
        description="module names adapted (peft's target_modules, e.g. [q_proj, v_proj]); "
        "all-linear: every linear of the decoder layers (not the output head)",
        json_schema_extra={"flag": "lora-target-modules", "aliases": ["target-modules"]},
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="dropout on an adapter's input while training",
        json_schema_extra={"flag": "lora-dropout"},
    )

    publish: Literal["merged", "adapters"] = Field(
        "merged",
        description="what a weight version carries: merged (full weights, any engine and "
        "transport) or adapters (A, B and alpha/r only; the embedded engine merges them "
        "onto its base weights; any transport)",
        json_schema_extra={"flag": "lora-publish"},
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class TrainerConfig(BaseModel):
    """Model, optimizer, micro-batching and parallelism of the trainer."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    backend: Literal["torch", "megatron", "sim"] = Field(
        "torch",
        description="torch (HF models, DDP/FSDP), megatron (megatron-core, TP/PP/DP), or "
        "sim (no model: each step takes modelled time; for the cluster simulator)",
        json_schema_extra={"flag": "train-backend"},
    )
    sim: SimTrainerConfig = Field(
        default_factory=SimTrainerConfig, description="the sim backend's step time"
    )
    megatron: MegatronConfig = Field(
        default_factory=MegatronConfig, description="megatron-core layout (backend megatron)"
    )
    num_ranks: int = Field(
        1,
        ge=1,
        description="trainer processes on this host (DP, or TP x PP x DP for megatron); "
        "each takes the GPU of its LOCAL_RANK",
        json_schema_extra={"flag": "trainer-num-ranks"},
    )

    model_path: str = Field(..., min_length=1, description="HF model directory of the policy.")
    dtype: Literal["auto", "float32", "bf16-mixed", "bfloat16", "float16"] = Field(
        "auto",
        description="auto: bf16-mixed on a GPU, and on a CPU with native bf16 for a model at "
        "least 256 wide; else float32 (the start line says which); float32; bf16-mixed: fp32 "
        "master weights and optimizer state, bf16 "
        "compute (torch: autocast; megatron: its bf16 model with fp32 main params); "
        "bfloat16 / float16: weights and optimizer state themselves in that dtype (pure "
        "low precision, torch only)",
    )
    attn_implementation: str | None = Field(
        None,
        description="transformers attention (sdpa, eager, flash_attention_2); default: "
        "asyncrl_packed when packing (sdpa per packed sequence, no L x L mask), else "
        "transformers' choice. flash-attention packs by position_ids alone.",
    )
    device: str = Field("cpu", description="cpu, or cuda (each rank takes its LOCAL_RANK).")
    lr: float = Field(1e-6, gt=0, description="Peak AdamW learning rate (--lr).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (--weight-decay).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon (--adam-eps).")
    grad_clip: float | None = Field(
        1.0, ge=0, description="Max global grad norm (--clip-grad); null or 0: no clipping."
    )
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After warmup: constant, or cosine decay to min_lr_ratio."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Linear warmup, in optimizer updates (--lr-warmup-iters)."
    )
    total_steps: int | None = Field(
        None,
        ge=1,
        description="Optimizer updates of the cosine schedule, warmup included (a version "
        "is ppo_epochs x mini-batches of them).",
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor, times lr.")
    max_tokens_per_microbatch: int | None = Field(
        None,
        ge=1,
        description="Token budget of a micro-batch (slime --max-tokens-per-gpu); null: 1024 "
        "on CPU (SmolLM2-135M trained as fast as with 4096 there, in half the memory), 8192 "
        "on CUDA.",
    )
    packing: bool = Field(True, description="Pack micro-batches into one row (else pad).")
    share_prompts: bool = Field(
        True,
        description="Packed with asyncrl_packed attention: a group's prompt once per "
        "micro-batch, each response attending to it (the same logits and gradients, fewer "
        "tokens); false: every sample packed whole",
    )
    seed: int = Field(0, description="Seeds torch, numpy and random at construction.")
    reward_key: str = Field("score", description="Entry of a dict reward that is trained on.")
    ref_model_path: str | None = Field(
        None,
        description="Reference model for KL (loaded when the algo needs it); default model_path.",
    )
    critic: bool | None = Field(
        None, description="Train a critic; default: when the estimator needs one (ppo)."
    )
    critic_model_path: str | None = Field(
        None, description="Initial critic weights; default model_path (fresh value head)."
    )
    critic_lr: float | None = Field(None, gt=0, description="Critic LR; default lr.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward (memory for compute)."
    )
    compile: bool = Field(
        False,
        description="torch.compile every decoder layer's MLP and RMSNorms (dynamic shapes): "
        "their elementwise work fused, attention eager; the first micro-batches pay the "
        "compile (tens of seconds)",
    )
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp", description="Data parallelism when a process group of >1 ranks exists."
    )
    lora: LoraConfig = Field(
        default_factory=LoraConfig, description="LoRA adapters on the policy (rank 0: off)"
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="samples per optimizer update: a rollout batch is cut into mini-batches "
        "of whole groups (a multiple of n_samples_per_prompt); null: one update per batch",
        json_schema_extra={"flag": "global-batch-size"},
    )
    ppo_epochs: int = Field(
        1,
        ge=1,
        description="passes over each rollout batch (each pass one update per mini-batch); "
        "a batch is still one weight version",
        json_schema_extra={"flag": "ppo-epochs", "aliases": ["num-iterations"]},
    )
    shuffle_minibatches: bool = Field(
        True,
        description="each epoch cuts the batch's groups into mini-batches in a new order "
        "(seeded by trainer.seed and the version); false: always in the batch's order",
    )

    @property
    def microbatch_tokens(self) -> int:
        """``max_tokens_per_microbatch``, or the device's default when unset."""
        if self.max_tokens_per_microbatch is not None:
            return self.max_tokens_per_microbatch
        return 8192 if self.device.startswith("cuda") else 1024

    @model_validator(mode="after")
    def _dtype_for_the_machine(self) -> TrainerConfig:
        """``auto`` becomes this machine's choice (``hardware.low_precision_pays``)."""
        if self.dtype == "auto":
            pays = self.backend != "sim" and low_precision_pays(self.model_path, self.device)
            self.dtype = "bf16-mixed" if pays else "float32"
        return self

    @model_validator(mode="after")
    def _sim_is_one_process(self) -> TrainerConfig:
        if self.backend != "sim":
            return self
        if self.num_ranks > 1:
            raise ValueError(
                "trainer.backend=sim models a step's time in one process: num_ranks must be 1 "
                "(its step_base_s and step_s_per_token stand for the whole trainer)"
            )
        unused = {
            "lora": self.lora.enabled,
            "global_batch_size": self.global_batch_size is not None,
            "ppo_epochs": self.ppo_epochs > 1,
            "compile": self.compile,
        }
        if wrong := [k for k, set_ in unused.items() if set_]:
            raise ValueError(
                f"trainer.backend=sim trains no model, so {', '.join(wrong)} would be ignored: "
                "drop them (model a longer step with sim.step_s_per_token instead)"
            )
        return self

    @model_validator(mode="after")
    def _megatron_fits(self) -> TrainerConfig:
        if self.backend != "megatron":
            return self
        if self.dtype == "float16":
            raise ValueError(
                "trainer.backend=megatron trains in float32 or bf16-mixed: float16's dynamic "
                "loss scale skips steps that overflow, which this trainer does not account for"
            )
        if self.dtype == "bfloat16":
            raise ValueError(
                "trainer.backend=megatron keeps fp32 main weights in its optimizer whenever it "
                "computes in bf16: set dtype bf16-mixed (pure bfloat16 is the torch backend's)"
            )
        m = self.megatron
        if self.num_ranks % (m.tensor_parallel * m.pipeline_parallel):
            raise ValueError(
                f"trainer.num_ranks={self.num_ranks} is not a multiple of TP "
                f"{m.tensor_parallel} x PP {m.pipeline_parallel} (the rest is data parallel): "
                "set --trainer-num-ranks"
            )
        torch_only = {
            "lora": self.lora.enabled,
            "parallel": self.parallel != "ddp",
            "attn_implementation": self.attn_implementation is not None,
            "critic": bool(self.critic),
            "critic_model_path": self.critic_model_path is not None,
            "compile": self.compile,
        }
        wrong = [k for k, bad in torch_only.items() if bad]
        if wrong:
            raise ValueError(
                f"trainer.backend=megatron does not use {', '.join(wrong)} (torch-backend "
                "settings: megatron shards with megatron.tensor_parallel/pipeline_parallel, "
                "runs its own attention and fused kernels, and trains no critic or LoRA "
                "adapters, one update a batch): drop them"
            )
        return self

    @model_validator(mode="after")
    def _lora_fits(self) -> TrainerConfig:
        if self.lora.enabled and self.parallel == "fsdp":
            raise ValueError(
                "trainer.lora with parallel=fsdp: LoRA trains under ddp (its frozen base is "
                "replicated; the adapters are small): set --trainer.parallel ddp"
            )
        return self

    @model_validator(mode="after")
    def _schedule(self) -> TrainerConfig:
        if self.lr_schedule == "cosine" and (
            self.total_steps is None or self.total_steps <= self.warmup_steps
        ):
            raise ValueError(
                f"lr_schedule=cosine needs total_steps > warmup_steps "
                f"(got total_steps={self.total_steps}, warmup_steps={self.warmup_steps})"
            )
        return self
