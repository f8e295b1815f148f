"""TorchTrainer: RL and SFT steps on a Hugging Face causal LM with AdamW.

Built by ``actors/trainer.py::build_trainer`` (RL, with the job's ``PolicyConfig``) and by
``asyncrl sft``. One ``train_step(batch)``::

    rows        rollout_tensors: usable groups -> sequences and [B, T] mask, behaviour
                log-probs, token versions; scores [G, n]
    plan        plan_ranks: this rank's token-budget micro-batches (packed, a group's
                prompt once: share_prompts), padded with an empty micro-batch up to the
                busiest rank's count
    no-grad     reference log-probs (KL) and the old log-probs with them, critic values:
                each rank scores its rows, a sum over ranks fills [B, T] (without a
                reference the old log-probs are the training forward's, detached:
                rl_columns.py)
    advantages  compute_advantages on the whole batch (on every rank, identically)
    grad        per micro-batch: forward, rl_loss (+ value loss) against the step's
                LossScale, backward of world_size * loss; gradients sync on the last one
    update      clip (the pre-clip norm is reported), AdamW, LR schedule, version += 1

Because every denominator is the step's (``LossScale`` over the whole batch, which every
rank holds, so no count needs an all-reduce), summing micro-batch losses over micro-batches
and ranks gives the loss of the batch taken whole: accumulation and DDP/FSDP reproduce a
single big batch's gradient (``parallel.py`` explains the ``world_size`` factor).

The step's metrics are listed in ``docs/design.md`` ("Trainer metrics").
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch._inductor.config as inductor_config
from torch import nn

from asyncrl.errors import CheckpointUnreadable
from asyncrl.hardware import available_memory
from asyncrl.observe.logs import get_logger
from asyncrl.policies import (
    LossScale,
    PolicyConfig,
    sft_loss,
    value_loss,
)
from asyncrl.trainers import packed_attention
from asyncrl.trainers.base import NonFiniteStep, StepResult
from asyncrl.trainers.config import LoraConfig, TrainerConfig
from asyncrl.trainers.learner import (
    Learner,
    OptimSettings,
    SavedState,
    copy_tokenizer,
    step_together,
    write_model_dir,
)
from asyncrl.trainers.packing import (
    MicroBatch,
    forward_selected,
    smoothed_logprobs,
    to_rows,
)
from asyncrl.trainers.parallel import DataParallel
from asyncrl.trainers.rl_columns import (
    Columns,
    Scored,
    Tally,
    batch_metrics,
    pad_row,
    step_columns,
    step_result,
    update_plan,
)
from asyncrl.trainers.rl_step import mean_of_updates, policy_loss, rank_microbatches, shuffle_seed
from asyncrl.trainers.rng import load_rng, rng_state, seed_everything, set_rng_state
from asyncrl.trainers.rollout_tensors import RolloutTensors, rollout_tensors, sft_tensors
from asyncrl.trainers.token_stats import token_logprobs, token_stats
from asyncrl.types import TrainBatch

log = get_logger("asyncrl.trainer")

MicroStep = Callable[[MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class TorchTrainer:
    """The torch training backend (``Trainer`` protocol); see the module docstring."""

    Config = TrainerConfig
    #: True: score the old log-probs in a no-grad forward before the step, as with a
    #: reference model, even without one (equal to the default up to round-off; tests).
    score_old_logprobs = False

    def __init__(self, config: Config, algo: PolicyConfig | None = None) -> None:
        self.config = config
        self.algo = algo if algo is not None else PolicyConfig()
        self.dp = DataParallel.detect(config.parallel)
        self.device = self.dp.device(config.device)
        # bf16-mixed: fp32 weights (and so fp32 AdamW state), bf16 matmuls under autocast.
        self.mixed = config.dtype == "bf16-mixed"
        self.dtype = torch.float32 if self.mixed else getattr(torch, config.dtype)
        seed_everything(config.seed)
        self.version = 0
        self.policy = self._trainable(self._load_lm(config.model_path), config.lr, config.lora)
        self.attn = str(self.policy.model.config._attn_implementation)
        # With LoRA the reference is the policy with its adapters off: no second copy.
        self.ref_is_base = self.algo.needs_ref and self._adapters_off_is_the_ref()
        self.ref = self._load_ref() if self.algo.needs_ref and not self.ref_is_base else None
        self.critic = self._load_critic() if self._wants_critic() else None

    # -- models ---------------------------------------------------------------------------
    def _optim(self, lr: float) -> OptimSettings:
        c = self.config
        return OptimSettings(
            lr=lr,
            weight_decay=c.weight_decay,
            betas=c.betas,
            eps=c.adam_eps,
            schedule=c.lr_schedule,
            warmup_steps=c.warmup_steps,
            total_steps=c.total_steps,
            min_lr_ratio=c.min_lr_ratio,
        )

    def _model_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"dtype": self.dtype}
        if self.config.attn_implementation:
            kwargs["attn_implementation"] = self.config.attn_implementation
        elif self.config.packing:  # each packed sequence attends alone: no L x L scores
            kwargs["attn_implementation"] = packed_attention.register()
        return kwargs

    def _load_lm(self, path: str) -> nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, **self._model_kwargs())

    def _compute(self) -> AbstractContextManager[Any]:
        """Where forwards run: under bf16 autocast with ``bf16-mixed`` (its backward runs
        in the same dtypes), plainly otherwise."""
        if not self.mixed:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _trainable(self, model: nn.Module, lr: float, lora: LoraConfig | None = None) -> Learner:
        if self.config.gradient_checkpointing:
            _enable_checkpointing(model)
        if self.config.compile:
            compile_blocks(model)
        return Learner.build(model, self.dp, self.device, self._optim(lr), lora)

    def _adapters_off_is_the_ref(self) -> bool:
        """LoRA on the reference's own weights (``ref_model_path`` unset or the policy's
        base): the policy with its adapters disabled computes the reference exactly."""
        c = self.config
        return self.policy.adapters is not None and c.ref_model_path in (None, c.model_path)

    def _load_ref(self) -> nn.Module:
        model = self._load_lm(self.config.ref_model_path or self.config.model_path)
        model = model.to(self.device).eval().requires_grad_(False)
        if self.config.compile:
            compile_blocks(model)
        return self.dp.shard_frozen(model)

    def _wants_critic(self) -> bool:
        wanted = self.algo.needs_critic if self.config.critic is None else self.config.critic
        if wanted != self.algo.needs_critic:
            raise ValueError(
                f"trainer.critic={self.config.critic} with advantage_estimator="
                f"{self.algo.advantage_estimator}: only ppo uses a critic (leave critic unset)"
            )
        return wanted

    def _load_critic(self) -> Learner:
        """The ``ppo`` critic: ``AutoModelForTokenClassification`` with one label from the
        policy's checkpoint (or ``critic_model_path``). transformers keeps that class for
        every decoder, with the causal LM's inputs (packed rows, 4D masks) and loading;
        a fresh head starts at 0. Token ``t``'s value is read where the policy predicts it."""
        from transformers import AutoConfig, AutoModelForTokenClassification

        path = self.config.critic_model_path or self.config.model_path
        hf_config = AutoConfig.from_pretrained(path)
        hf_config.num_labels = 1
        hf_config.classifier_dropout = 0.0  # transformers' default 0.1 would make V random
        model, info = AutoModelForTokenClassification.from_pretrained(
            path, config=hf_config, output_loading_info=True, **self._model_kwargs()
        )
        head = model.score
        if any(k.startswith("score.") for k in info["missing_keys"]):
            with torch.no_grad():  # a fresh value head predicts 0
                head.weight.zero_()
                if head.bias is not None:
                    head.bias.zero_()
        return self._trainable(model, self.config.critic_lr or self.config.lr)

    def _learners(self) -> list[Learner]:
        return [self.policy] if self.critic is None else [self.policy, self.critic]

    # -- the RL step ----------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> StepResult:
        """One RL step on ``batch``: one weight version, made of one optimizer update per
        mini-batch per epoch (``update_plan``); see the module docstring."""
        start, c = time.perf_counter(), self.config
        rows = rollout_tensors(batch, self.config.reward_key)
        mbs = self._microbatches(rows)
        seed = shuffle_seed(c, self.version)
        plan = update_plan(rows, c.global_batch_size, c.ppo_epochs, seed)
        # Several updates: the old log-probs are the batch's start, scored before any.
        cols = self._columns(rows, mbs, score_old=self.score_old_logprobs or len(plan) > 1)
        extra = batch_metrics(rows, cols, self.version)
        updates: list[dict[str, float]] = []
        failures: list[NonFiniteStep] = []
        for part in plan:
            part_mbs = mbs if len(plan) == 1 else self._microbatches(rows, part)
            try:
                updates.append(self._update(part_mbs, cols, part))
            except NonFiniteStep as exc:  # that update moved nothing; the others stand
                failures.append(exc)
        if not updates:
            raise failures[0]  # nothing moved: the whole step is skipped
        metrics = mean_of_updates(updates)
        if failures:
            metrics["nonfinite_updates"] = float(len(failures))
        self.version += 1
        return step_result(self.version, rows, metrics | extra | {"optim_steps": len(plan)}, start)

    def _update(self, mbs: list[MicroBatch], cols: Columns, part: list[int]) -> dict[str, float]:
        """One optimizer update on the micro-batches ``mbs`` of the rows ``part``."""
        scale = LossScale.of(cols["mask"][part], self.algo.max_response_len)

        def micro_step(mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return self._rl_micro_step(mb, cols, scale)

        metrics = self._accumulate(mbs, cols["mask"], micro_step, self._learners())
        stepped = step_together(self._learners(), self.config.grad_clip)  # all or none
        if self.critic is not None:
            metrics["critic/grad_norm"] = stepped[1][0]
        grad_norm, lr = stepped[0]
        return metrics | {"grad_norm": grad_norm, "lr": lr}

    def _microbatches(
        self, rows: RolloutTensors, part: list[int] | None = None, *, share_prompts: bool = True
    ) -> list[MicroBatch]:
        """This rank's micro-batches of the rows (of ``part``), padded to equal counts."""
        return rank_microbatches(
            rows,
            part,
            max_tokens=self.config.microbatch_tokens,
            world=self.dp.world_size,
            rank=self.dp.rank,
            equal_counts=True,
            layout="packed" if self.config.packing else "padded",
            share_prompts=share_prompts and self.config.share_prompts,
            attn_implementation=self.attn,
            dtype=self.dtype,
            device=self.device,
        )

    def _columns(self, rows: RolloutTensors, mbs: list[MicroBatch], score_old: bool) -> Columns:
        """``[B + 1, T]`` tensors of the step (the extra row is the empty stand-in's)."""
        shape = (rows.num_rows + 1, rows.width)

        def score(model: Scored) -> torch.Tensor:
            if model == "critic":
                assert self.critic is not None
                return self._score(self.critic.model, mbs, shape, lm=False)
            if model == "ref" and self.ref_is_base:
                assert self.policy.adapters is not None
                with self.policy.adapters.peft_model.disable_adapter():
                    return self._score(self.policy.model, mbs, shape)
            return self._score(self.policy.model if model == "policy" else self.ref, mbs, shape)

        return step_columns(
            self.algo,
            rows,
            self.device,
            score,
            ref=self.ref is not None or self.ref_is_base,
            critic=self.critic is not None,
            score_old=score_old,
        )

    @torch.no_grad()
    def _score(
        self, model: nn.Module, mbs: list[MicroBatch], shape: tuple[int, int], *, lm: bool = True
    ) -> torch.Tensor:
        """Log-probs (``lm``) or critic values of every row, ``[B + 1, T]``.

        Each rank fills its own rows; one row belongs to one rank, so a sum over ranks
        assembles the batch exactly.
        """
        out = torch.zeros(shape, device=self.device)
        for mb in mbs:
            with self._compute():
                pred = forward_selected(model, mb, lm=lm)
            values = (
                token_logprobs(pred, mb.targets, mb.inv_temperature) if lm else pred[:, 0].float()
            )
            out[mb.rows] = to_rows(values, mb)
        out[-1] = 0.0
        return self.dp.all_reduce_sum(out)

    def _rl_micro_step(
        self, mb: MicroBatch, cols: Columns, scale: LossScale
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with self._compute():
            logits = forward_selected(self.policy.wrapped, mb)
        logp_N, entropy_N = token_stats(logits, mb.targets, mb.inv_temperature)
        loss, metrics = policy_loss(self.algo, cols, mb, logp_N, entropy_N, scale)
        if self.critic is not None:
            with self._compute():
                values = forward_selected(self.critic.wrapped, mb, lm=False)[:, 0].float()
            values = to_rows(values, mb)
            v_loss, v_metrics = value_loss(
                values,
                cols["values"][mb.rows],
                cols["returns"][mb.rows],
                cols["mask"][mb.rows],
                clip=self.algo.value_clip,
                aggregation=self.algo.loss_aggregation,
                scale=scale,
            )
            metrics |= v_metrics | {"value_loss": v_loss.detach()}
            loss = loss + v_loss
        return loss, metrics

    # -- the SFT step ---------------------------------------------------------------------
    def sft_step(
        self,
        tokens: Sequence[np.ndarray],
        loss_masks: Sequence[np.ndarray],
        label_smoothing: float = 0.0,
    ) -> StepResult:
        """One supervised step: token-mean smoothed cross-entropy (``Trainer.sft_step``)."""
        start = time.perf_counter()
        rows = sft_tensors(tokens, loss_masks)
        mbs = self._microbatches(rows, share_prompts=False)  # SFT rows have no prompt
        mask = pad_row(rows.mask.to(self.device))
        scale = LossScale.of(rows.mask)

        def micro_step(mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            with self._compute():
                logits = forward_selected(self.policy.wrapped, mb)
            logprobs = smoothed_logprobs(logits, mb.targets, label_smoothing)
            loss = sft_loss(to_rows(logprobs, mb), mask[mb.rows], scale=scale)
            return loss, {"loss": loss.detach()}

        metrics = self._accumulate(mbs, mask, micro_step, [self.policy])
        return self._finish(start, rows, metrics)

    # -- shared by both steps -------------------------------------------------------------
    def _accumulate(
        self, mbs: list[MicroBatch], mask: torch.Tensor, step: MicroStep, learners: list[Learner]
    ) -> dict[str, float]:
        """Backward ``world_size * loss`` of each micro-batch; the last one syncs gradients."""
        tally = Tally()
        for i, mb in enumerate(mbs):
            with _synced(learners, i == len(mbs) - 1):
                loss, metrics = step(mb)
                (loss * self.dp.world_size).backward()
            tally.add(metrics, float(mask[mb.rows].sum()))
        return tally.reduce(sorted(tally.sums), self._all_reduce_sum)

    def _all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.dp.all_reduce_sum(x.to(self.device))

    def _finish(self, start: float, rows: RolloutTensors, metrics: dict[str, float]) -> StepResult:
        grad_norm, lr = self.policy.step(self.config.grad_clip)
        self.version += 1
        return step_result(self.version, rows, metrics | {"grad_norm": grad_norm, "lr": lr}, start)

    # -- weights and checkpoints ----------------------------------------------------------
    def export_weights(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """What a weight version carries: HF-named CPU copies of the policy (a collective
        under FSDP: rank 0 gets them), or with LoRA ``trainer.lora.publish``'s choice
        (``Learner.version_weights``); ``copy=False``: live tensors where there are any."""
        return self.policy.version_weights(copy)

    def save_hf(self, path: Path) -> None:
        """An HF model directory (config, ``model.safetensors``, tokenizer if the source
        has one) that ``AutoModelForCausalLM.from_pretrained`` and ``TorchEngine`` load."""
        path = Path(path)
        weights = self.policy.hf_weights()
        if self.dp.rank == 0:
            write_model_dir(path, self.policy.model, weights)
            copy_tokenizer(self.config.model_path, path)
        self.dp.barrier()

    def save_checkpoint(self, path: Path) -> None:
        """``policy/`` (and ``critic/``): complete HF folders (weights, config, generation
        config, tokenizer and chat template; with LoRA the merged weights);
        ``optimizer/{policy,critic}/``: optimizer and schedule; ``adapter/`` with LoRA (peft's
        layout); ``rng/rank{r}.pt``; ``trainer.json`` (version, configs). Every rank calls
        it; ``path`` is shared."""
        self._checkpoint_writer(copy=False)(Path(path))

    def snapshot_checkpoint(self) -> Callable[[Path], None] | None:
        """``Trainer.snapshot_checkpoint``: CPU copies of the weights, optimizer state and
        RNG (about the checkpoint's size), on one process without LoRA, when the machine
        has twice the copy's size free."""
        if self.dp.enabled or self.policy.adapters is not None:
            return None
        need = sum(learner.state_bytes() for learner in self._learners())
        free = available_memory()
        if free is None or 2 * need > free:
            return None
        return self._checkpoint_writer(copy=True)

    def _checkpoint_writer(self, copy: bool) -> Callable[[Path], None]:
        """The function that writes this moment's state in ``save_checkpoint``'s layout.
        ``copy``: every learner's state copied now, apart from the live one; else each
        taken as it is written, so rank 0 holds one gathered state at a time (FSDP)."""
        learners = {"policy": self.policy, "critic": self.critic}
        live = {name: learner for name, learner in learners.items() if learner is not None}
        copies = {name: learner.saved_state(True) for name, learner in live.items() if copy}

        def taken(name: str) -> SavedState | None:
            if name not in live:
                return None
            return copies[name] if copy else live[name].saved_state()

        rng, rank, dp = rng_state(), self.dp.rank, self.dp
        state = {
            "version": self.version,
            "world_size": self.dp.world_size,
            "config": self.config.model_dump(mode="json"),
            "algo": self.algo.model_dump(mode="json"),
        }
        source = self.config.model_path

        def write(path: Path) -> None:
            if (policy := taken("policy")) is not None:
                policy.write(path / "policy", path / "optimizer" / "policy", source,
                             adapter=path / "adapter")  # fmt: skip
            del policy  # written: its memory goes before the critic's is gathered
            if (critic := taken("critic")) is not None:
                critic.write(path / "critic", path / "optimizer" / "critic")
            (path / "rng").mkdir(parents=True, exist_ok=True)
            torch.save(rng, path / "rng" / f"rank{rank}.pt")
            if rank == 0:
                (path / "trainer.json").write_text(json.dumps(state, indent=2))
            dp.barrier()

        return write

    def _load_critic_state(self, path: Path) -> None:
        assert self.critic is not None
        if not (path / "critic").is_dir():
            raise CheckpointUnreadable(
                f"trainer checkpoint {path} has no critic/, and this trainer trains one: "
                "resume with the advantage estimator it was written with"
            )
        self.critic.load(path / "critic", path / "optimizer" / "critic")

    def _rng_file(self, path: Path, world_size: int) -> Path | None:
        """This rank's RNG state; None where the checkpoint was written by another number
        of ranks (the streams then start from the seed, said once)."""
        rng = path / "rng" / f"rank{self.dp.rank}.pt"
        if rng.is_file():
            return rng
        if world_size == self.dp.world_size:
            raise CheckpointUnreadable(
                f"trainer checkpoint {path} is unreadable: {rng} is missing (written by "
                f"{world_size} rank(s), as this trainer has)"
            )
        log.warning("RNG streams restart from the seed", checkpoint=str(path),
                    written_by=world_size, ranks=self.dp.world_size)  # fmt: skip
        return None

    def load_checkpoint(self, path: Path) -> None:
        """Restore a ``save_checkpoint`` directory; the next steps repeat bit-exactly.

        Every part is checked: a missing or truncated file (weights, optimizer, critic,
        this rank's RNG state when written by as many ranks) is ``CheckpointUnreadable``,
        never a restart or a silently reseeded stream.
        """
        path = Path(path)
        try:
            state = json.loads((path / "trainer.json").read_text())
            version = int(state["version"])
            self.policy.load(
                path / "policy", path / "optimizer" / "policy", adapter=path / "adapter"
            )
            if self.critic is not None:
                self._load_critic_state(path)
            rng = self._rng_file(path, int(state.get("world_size", 1)))
            rng_state = load_rng(rng) if rng is not None else None
        except CheckpointUnreadable:
            raise
        except Exception as exc:  # json, safetensors, torch.load: all mean the same here
            raise CheckpointUnreadable(
                f"trainer checkpoint {path} is unreadable (truncated or incomplete?): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if rng_state is not None:
            set_rng_state(rng_state)
        self.version = version


@contextmanager
def _synced(learners: list[Learner], enabled: bool) -> Iterator[None]:
    with ExitStack() as stack:
        for learner in learners:
            stack.enter_context(learner.sync(enabled))
        yield


def _enable_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing (transformers 5 renamed the method)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compile_blocks(model: nn.Module) -> int:
    """``torch.compile`` in place (``nn.Module.compile``: parameter names unchanged) every
    module transformers names ``*MLP`` or ``*RMSNorm``, with dynamic shapes: their
    elementwise work (SiLU x gate, the norm's mean, rsqrt and scale, autocast's casts)
    fuses. Attention stays eager: its packed segments are Python values a graph would be
    specialised on. Returns how many were compiled; none raises ``ValueError``."""
    blocks = [m for m in model.modules() if type(m).__name__.endswith(("MLP", "RMSNorm"))]
    if not blocks:
        raise ValueError(
            f"trainer.compile: {type(model).__name__} has no *MLP or *RMSNorm module to compile"
        )
    # Inductor keeps fused intermediates in fp32 unless told to round where eager rounds:
    # with it, compiled bf16 steps give eager's numbers (the CPU test: the same loss).
    inductor_config.emulate_precision_casts = True
    for block in blocks:  # every block shares one cache (modules are guarded by type):
        # each class, grad mode, frozen or trained weights and input rank is an entry, and
        # past dynamo's default 8 the rest would run eager without a word
        block.compile(dynamic=True, recompile_limit=64)
    return len(blocks)
