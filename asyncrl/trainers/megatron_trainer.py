"""MegatronTrainer: RL and SFT steps on megatron-core with TP, PP and DP (``backend: megatron``).

The same ``Trainer`` protocol as ``torch_trainer.TorchTrainer``, so ``TrainerActor`` and
``asyncrl sft`` run either. The policy is a megatron ``GPTModel`` built from the Hugging
Face config at ``model_path`` (Qwen2 / Llama, ``megatron_bridge``), its weights converted
from the HF checkpoint, wrapped in megatron's ``DistributedDataParallel`` and trained by
``get_megatron_optimizer`` (Adam with decoupled weight decay, optionally the distributed
optimizer). Layout: ``trainer.num_ranks`` processes (``ranks.py`` starts them and joins
them in one process group) hold ``TP * PP * DP`` ranks; with one rank and no group the
trainer makes a one-rank group. Each rank builds its pipeline stage and TP shard.

One ``train_step``'s schedule, the loss scaling that makes its gradient the torch
trainer's, packing, limits and the checkpoint layout: ``docs/megatron.md`` ("Inside the
backend"). Model conversion is ``megatron_bridge.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial, wraps
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from asyncrl.errors import CheckpointUnreadable
from asyncrl.policies import LossScale, PolicyConfig, sft_loss
from asyncrl.trainers import megatron_bridge as bridge
from asyncrl.trainers import vocab_parallel as vp
from asyncrl.trainers.base import StepResult
from asyncrl.trainers.config import TrainerConfig
from asyncrl.trainers.learner import OptimSettings, copy_tokenizer, lr_factor, write_hf_dir
from asyncrl.trainers.megatron_writer import own_results_queue
from asyncrl.trainers.packing import MicroBatch, to_rows
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

P = ParamSpec("P")
R = TypeVar("R")
LossOf = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
#: The model's dtype per trainer dtype (megatron keeps fp32 main params in its optimizer).
_HALF = {"bf16-mixed": torch.bfloat16}


def _on_device(method: Callable[P, R]) -> Callable[P, R]:
    """Run on the trainer's GPU: the actor calls from worker threads, and the current
    CUDA device is per thread."""

    @wraps(method)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        device = args[0].device  # type: ignore[attr-defined]
        ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with ctx:
            return method(*args, **kwargs)

    return run


class MegatronTrainer:
    """The megatron-core training backend (``Trainer`` protocol); see the module docstring."""

    Config = TrainerConfig
    #: True: score the old log-probs in a no-grad forward before the step, as with a
    #: reference model, even without one (equal to the default up to round-off; tests).
    score_old_logprobs = False

    def __init__(self, config: Config, algo: PolicyConfig | None = None) -> None:
        from transformers import AutoConfig

        self.config = config
        self.algo = algo if algo is not None else PolicyConfig()
        if self.algo.needs_critic:
            raise ValueError(
                f"advantage_estimator={self.algo.advantage_estimator} needs a critic, which "
                "the megatron backend does not train (use the torch backend)"
            )
        self.device = _device(config.device)
        seed_everything(config.seed)
        self.version = 0
        self.updates = 0  # optimizer updates: the LR schedule's and Adam's step count
        self.hf = AutoConfig.from_pretrained(config.model_path)
        self.te = _use_te(config.megatron.transformer_impl)
        self.layout = _join_model_parallel(config, self.hf)
        self.shard = vp.VocabShard.megatron(self.hf.vocab_size)
        self.gpt, self.model = self._build(config.model_path, trainable=True)
        self.optimizer = self._optimizer()
        self.ref = (
            self._build(self._ref_path(), trainable=False)[1] if self.algo.needs_ref else None
        )

    # -- models ---------------------------------------------------------------------------
    def _ref_path(self) -> str:
        return self.config.ref_model_path or self.config.model_path

    def _transformer_config(self) -> Any:
        c, m = self.config, self.config.megatron
        dtype = _HALF.get(c.dtype, torch.float32)
        overrides: dict[str, Any] = {
            "tensor_model_parallel_size": m.tensor_parallel,
            "pipeline_model_parallel_size": m.pipeline_parallel,
            "params_dtype": dtype,
            "pipeline_dtype": dtype,
            "bf16": c.dtype == "bf16-mixed",
            # Micro-batches differ in shape: stages exchange shapes first. (The check that
            # refuses this names MoE's dispatcher even for dense models.)
            "variable_seq_lengths": m.pipeline_parallel > 1,
            "moe_token_dispatcher_type": "alltoall",
            "use_cpu_initialization": self.device.type == "cpu",
        }
        if c.gradient_checkpointing:
            overrides |= {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            }
        return bridge.transformer_config(self.hf, **overrides)

    def _build(self, path: str, *, trainable: bool) -> tuple[nn.Module, nn.Module]:
        """This rank's ``GPTModel`` with the HF weights at ``path``, and the module the
        schedule runs: DDP-wrapped when ``trainable``, frozen otherwise."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.module import Float16Module

        cfg = self._transformer_config()
        gpt = bridge.gpt_model(
            self.hf,
            cfg,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            te=self.te,
        )
        state = _hf_state(path, self.hf, _HALF.get(self.config.dtype, torch.float32))
        bridge.load_hf_state(gpt, self.hf, state, te=self.te)
        module: nn.Module = gpt.to(self.device)
        if self.config.dtype in _HALF:
            module = Float16Module(cfg, module)
        if not trainable:
            return gpt, module.eval().requires_grad_(False)
        return gpt, self._wrap(cfg, module)

    def _wrap(self, cfg: Any, module: nn.Module) -> nn.Module:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        m = self.config.megatron
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=m.overlap_grad_reduce,
            use_distributed_optimizer=m.distributed_optimizer,
        )
        ddp = DistributedDataParallel(cfg, ddp_config, module=module)
        # The wiring Megatron-LM's training loop does: without it DP grads are never
        # reduced; with overlap, micro-batches before the last must not reduce.
        cfg.finalize_model_grads_func = finalize_model_grads
        if m.overlap_grad_reduce:
            cfg.no_sync_func = ddp.no_sync
        return ddp

    def _optimizer(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        c = self.config
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=c.lr,
                weight_decay=c.weight_decay,
                adam_beta1=c.betas[0],
                adam_beta2=c.betas[1],
                adam_eps=c.adam_eps,
                clip_grad=c.grad_clip or 0.0,
                bf16=c.dtype == "bf16-mixed",
                params_dtype=_HALF.get(c.dtype, torch.float32),
                use_distributed_optimizer=c.megatron.distributed_optimizer,
            ),
            [self.model],
        )
        self.model.config.grad_scale_func = optimizer.scale_loss  # fp16 loss scaling
        return optimizer

    def _settings(self) -> OptimSettings:
        c = self.config
        return OptimSettings(
            lr=c.lr,
            schedule=c.lr_schedule,
            warmup_steps=c.warmup_steps,
            total_steps=c.total_steps,
            min_lr_ratio=c.min_lr_ratio,
        )

    # -- micro-batches and the schedule ---------------------------------------------------
    def _microbatches(
        self, rows: RolloutTensors, part: list[int] | None = None
    ) -> list[MicroBatch]:
        """This DP rank's micro-batches of the rows (of ``part``); at least one."""
        from megatron.core import parallel_state as ps

        return rank_microbatches(
            rows,
            part,
            max_tokens=self.config.microbatch_tokens,
            world=ps.get_data_parallel_world_size(),
            rank=ps.get_data_parallel_rank(),
            equal_counts=False,
            device=self.device,
            layout="packed" if self.config.packing and not self.te else "padded",
        )

    def _schedule(
        self,
        model: nn.Module,
        mbs: list[MicroBatch],
        loss_of: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]],
        *,
        forward_only: bool,
    ) -> None:
        """Run ``mbs`` through megatron's schedule; ``loss_of(mb, logits)`` runs on the last
        stage with ``logits`` ``[N, V/T]`` at the micro-batch's response positions."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data: Iterator[MicroBatch], module: nn.Module) -> tuple[torch.Tensor, Any]:
            mb = next(data)
            # packed: megatron's mask is True where attention is blocked; padded: causal
            # alone keeps real tokens off the right padding.
            mask = (
                None if mb.attention_mask is None or mb.layout == "padded" else ~mb.attention_mask
            )
            output = module(mb.input_ids, mb.position_ids, attention_mask=mask)
            return output, partial(_selected_loss, loss_of, mb)

        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(mbs),
            model=[model],
            num_microbatches=len(mbs),
            seq_length=max(int(mb.input_ids.shape[1]) for mb in mbs),
            micro_batch_size=max(int(mb.input_ids.shape[0]) for mb in mbs),
            forward_only=forward_only,
        )

    def _holds_loss(self) -> bool:
        """The ranks whose losses count: the last pipeline stage, TP rank 0 (the other TP
        ranks compute the same values)."""
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0

    def _all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(x)
        return x.cpu() if x.dtype == torch.float64 else x

    @torch.no_grad()
    def _score(self, which: Scored, mbs: list[MicroBatch], shape: tuple[int, int]) -> torch.Tensor:
        """``[B + 1, T]`` log-probs of the policy or the reference model, on every rank."""
        out = torch.zeros(shape, device=self.device)

        def keep(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            logp = token_logprobs(logits, mb.targets, mb.inv_temperature, self.shard)
            out[mb.rows] = to_rows(logp, mb)
            return logits.new_zeros(()), {}

        model = self.model if which == "policy" else self.ref
        assert model is not None
        self._schedule(model, mbs, keep, forward_only=True)
        out[-1] = 0.0
        if not self._holds_loss():
            out.zero_()
        return self._all_reduce_sum(out)

    def _train(
        self, mbs: list[MicroBatch], mask: torch.Tensor, loss_of: LossOf
    ) -> dict[str, float]:
        """One optimizer update over ``mbs``; returns its metrics (every rank)."""
        from megatron.core import parallel_state as ps

        scale = len(mbs) * ps.get_data_parallel_world_size()  # see "Losses" above
        tally = Tally()

        def loss(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            value, metrics = loss_of(mb, logits)
            tally.add(metrics, float(mask[mb.rows].sum()))
            return value * scale, {}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._schedule(self.model, mbs, loss, forward_only=False)
        lr = self.config.lr * lr_factor(self.updates, self._settings())
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        _, grad_norm, _ = self.optimizer.step()
        if grad_norm is None:  # no clipping: measured alone
            grad_norm = self.optimizer.get_grad_norm()
        self.updates += 1
        keys = self._metric_keys(sorted(tally.sums))
        metrics = (tally if self._holds_loss() else Tally()).reduce(keys, self._all_reduce_sum)
        return metrics | {"grad_norm": float(grad_norm), "lr": lr}

    def _metric_keys(self, keys: list[str]) -> list[str]:
        """The last stage's metric names on every rank of its pipeline (others ran no
        loss and have none)."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            return keys
        group, src = (
            ps.get_pipeline_model_parallel_group(),
            ps.get_pipeline_model_parallel_last_rank(),
        )
        data = torch.tensor(list(json.dumps(keys).encode()), dtype=torch.uint8, device=self.device)
        size = torch.tensor([data.numel()], device=self.device)
        dist.broadcast(size, src=src, group=group)
        if not ps.is_pipeline_last_stage():
            data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, src=src, group=group)
        return json.loads(bytes(data.cpu().tolist()).decode())

    # -- the RL step ----------------------------------------------------------------------
    @_on_device
    def train_step(self, batch: TrainBatch) -> StepResult:
        """One RL step on ``batch``: one weight version, made of one optimizer update per
        mini-batch per epoch (``update_plan``, as the torch trainer's); see the module
        docstring."""
        start, c = time.perf_counter(), self.config
        rows = rollout_tensors(batch, c.reward_key)
        mbs = self._microbatches(rows)
        shape = (rows.num_rows + 1, rows.width)
        plan = update_plan(rows, c.global_batch_size, c.ppo_epochs, shuffle_seed(c, self.version))
        cols = step_columns(
            self.algo,
            rows,
            self.device,
            lambda which: self._score(which, mbs, shape),
            ref=self.ref is not None,
            critic=False,
            score_old=self.score_old_logprobs or len(plan) > 1,
        )
        extra = batch_metrics(rows, cols, self.version)
        updates = []
        for part in plan:
            scale = LossScale.of(rows.mask[part], self.algo.max_response_len)
            part_mbs = mbs if len(plan) == 1 else self._microbatches(rows, part)
            updates.append(self._train(part_mbs, cols["mask"], partial(self._rl_loss, cols, scale)))
        metrics = mean_of_updates(updates)
        self.version += 1
        return step_result(self.version, rows, metrics | extra | {"optim_steps": len(plan)}, start)

    def _rl_loss(
        self, cols: Columns, scale: LossScale, mb: MicroBatch, logits: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp_N, entropy_N = token_stats(logits, mb.targets, mb.inv_temperature, self.shard)
        return policy_loss(self.algo, cols, mb, logp_N, entropy_N, scale)

    # -- the SFT step ---------------------------------------------------------------------
    @_on_device
    def sft_step(
        self,
        tokens: Sequence[np.ndarray],
        loss_masks: Sequence[np.ndarray],
        label_smoothing: float = 0.0,
    ) -> StepResult:
        """One supervised step: token-mean smoothed cross-entropy (``Trainer.sft_step``)."""
        start = time.perf_counter()
        rows = sft_tensors(tokens, loss_masks)
        mbs = self._microbatches(rows)
        mask = pad_row(rows.mask.to(self.device))
        scale = LossScale.of(rows.mask)

        def loss_of(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            logprobs = vp.smoothed_logprobs(logits, mb.targets, label_smoothing, self.shard)
            loss = sft_loss(to_rows(logprobs, mb), mask[mb.rows], scale=scale)
            return loss, {"loss": loss.detach()}

        metrics = self._train(mbs, mask, loss_of)
        self.version += 1
        return step_result(self.version, rows, metrics, start)

    # -- weights and checkpoints ----------------------------------------------------------
    @_on_device
    def export_weights(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """HF-named CPU copies of the whole policy (a collective: TP shards are
        all-gathered, pipeline stages broadcast). Only rank 0 publishes, so only rank 0
        copies; the other ranks, and ``copy=False``, get the gathered tensors where they
        are (on the GPU for CUDA IPC)."""
        weights = bridge.gather_hf_weights(self.gpt, self.hf, te=self.te)
        if dist.get_rank() != 0 or not copy:
            return weights
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()}

    def save_hf(self, path: Path) -> None:
        """An HF model directory (config, ``model.safetensors``, tokenizer if the source
        has one) that ``AutoModelForCausalLM.from_pretrained`` and ``TorchEngine`` load."""
        path = Path(path)
        weights = self.export_weights()
        if dist.get_rank() == 0:
            hf = self.hf
            hf.architectures = hf.architectures or [f"{type(hf).__name__[:-6]}ForCausalLM"]
            write_hf_dir(path, hf, weights, _generation_config(self.config.model_path))
            copy_tokenizer(self.config.model_path, path)
        dist.barrier()

    def snapshot_checkpoint(self) -> Callable[[Path], None] | None:
        """None: saved in the step's time (the ranks save together, ``dist_checkpointing``)."""
        return None

    @_on_device
    def save_checkpoint(self, path: Path) -> None:
        """``policy/`` (the complete HF folder a user loads, ``save_hf``), ``megatron/``
        (model and optimizer, ``dist_checkpointing``: what a resume reads),
        ``rng/rank{r}.pt``, ``trainer.json``. Every rank calls it; ``path`` is shared."""
        from megatron.core import dist_checkpointing
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        path = Path(path)
        self.save_hf(path / "policy")
        if dist.get_rank() == 0:
            (path / "megatron").mkdir(parents=True, exist_ok=True)
            (path / "rng").mkdir(exist_ok=True)
        dist.barrier()
        own_results_queue()
        dist_checkpointing.save(self._sharded_state(loading=False), str(path / "megatron"))
        rng = {"global": rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
        torch.save(rng, path / "rng" / f"rank{dist.get_rank()}.pt")
        if dist.get_rank() == 0:
            state = {
                "version": self.version,
                "updates": self.updates,
                "layout": self.layout,
                "config": self.config.model_dump(mode="json"),
                "algo": self.algo.model_dump(mode="json"),
            }
            (path / "trainer.json").write_text(json.dumps(state, indent=2))
        dist.barrier()

    @_on_device
    def load_checkpoint(self, path: Path) -> None:
        """Restore a ``save_checkpoint`` directory; the next steps repeat bit-exactly."""
        from megatron.core import dist_checkpointing
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        from torch.distributed.checkpoint.api import CheckpointException

        path = Path(path)
        try:
            saved = json.loads((path / "trainer.json").read_text())
            version = int(saved["version"])
            updates = int(saved.get("updates", version))  # one a version before mini-batches
            _same_model_split(saved.get("layout", {}), self.layout, path)
            state = dist_checkpointing.load(
                self._sharded_state(loading=True, version=version), str(path / "megatron")
            )
        except LayoutMismatch:
            raise
        except (Exception, CheckpointException) as exc:  # all mean the same here
            raise CheckpointUnreadable(
                f"trainer checkpoint {path} is unreadable (truncated or incomplete?): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self.gpt.load_state_dict(state["model"])
        if "optimizer" in state:
            settings = _adam_settings(self.optimizer)
            with torch.no_grad():  # it copies into views of the parameters
                self.optimizer.load_state_dict(state["optimizer"])
            _set_adam_steps(self.optimizer, updates)
            _apply_adam_settings(self.optimizer, settings)
        elif self.version > 0:  # back to before the first step: a fresh Adam
            self.optimizer = self._optimizer()
        rng = path / "rng" / f"rank{dist.get_rank()}.pt"
        if rng.is_file():
            saved = load_rng(rng)
            set_rng_state(saved["global"])
            get_cuda_rng_tracker().set_states(saved["tracker"])
        self.version, self.updates = version, updates

    def _sharded_state(self, *, loading: bool, version: int | None = None) -> dict[str, Any]:
        """The model's (and, after a step, the optimizer's) sharded state; Adam has no
        state before its first step, and a version-0 checkpoint holds none."""
        model = self.gpt.sharded_state_dict()  # the wrappers' would prefix "module."
        if (self.version if version is None else version) == 0:
            return {"model": model}
        # dp_reshardable: each rank's own buffers, reloadable under another DP size. In
        # 0.16.1 the default (fully_sharded_model_space) refuses its own flattened shards,
        # and fully_reshardable drops torch Adam's step count on load.
        optimizer = self.optimizer.sharded_state_dict(
            model, is_loading=loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        )
        return {"model": model, "optimizer": optimizer}


_ADAM_SETTINGS = ("betas", "eps", "weight_decay")


def _adam_settings(optimizer: Any) -> list[dict[str, Any]]:
    return [{k: g[k] for k in _ADAM_SETTINGS if k in g} for g in optimizer.param_groups]


def _apply_adam_settings(optimizer: Any, settings: list[dict[str, Any]]) -> None:
    """This run's betas, eps and weight decay over a loaded state, which carries the
    checkpoint's: a resume trains with the command's settings and the saved moments (the
    LR is set from the config at every step already)."""
    for group, kept in zip(optimizer.param_groups, settings, strict=True):
        group.update(kept)


def _set_adam_steps(optimizer: Any, steps: int) -> None:
    """Give each parameter of torch's Adam its own step count (its bias correction),
    ``steps``. The distributed optimizer's checkpoint keeps Adam's moments but not this
    count (fused Adams keep it elsewhere); on load megatron gives every parameter one
    shared count tensor, which torch's Adam then increments once per parameter per step.
    Every update of this trainer steps (fp16, whose loss scaling skips overflowing steps,
    is refused), so the count is the trainer's ``updates``."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in chained.optimizer.state.values():
            if "step" in state:
                old = state["step"]
                fresh = torch.full_like(old, float(steps)) if torch.is_tensor(old) else steps
                state["step"] = fresh


class LayoutMismatch(ValueError):
    """A checkpoint saved under another TP/PP split than this trainer's."""


def _same_model_split(saved: dict[str, int], current: dict[str, int], path: Path) -> None:
    split = ("tp", "pp")
    if any(saved.get(k, current[k]) != current[k] for k in split):
        raise LayoutMismatch(
            f"trainer checkpoint {path} was saved with TP {saved.get('tp')} x PP "
            f"{saved.get('pp')}, this trainer is TP {current['tp']} x PP {current['pp']}: "
            "resume with the same TP and PP (DP may differ)"
        )


def _selected_loss(
    loss_of: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]],
    mb: MicroBatch,
    output: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``loss_of`` on the logits ``[b, L, V/T]`` at the micro-batch's kept positions."""
    return loss_of(mb, output.flatten(0, 1)[mb.keep])


def _device(kind: str) -> torch.device:
    """This rank's device. megatron-core 0.16.1 hard-codes CUDA calls (its RNG tracker,
    RoPE, optimizers), so the CPU works only where they are redirected (the tests' shim)."""
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but torch sees no GPU")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    try:
        redirected = torch.cuda.current_device() == "cpu"
    except (AssertionError, RuntimeError):  # CPU-only torch: "not compiled with CUDA"
        redirected = False
    if kind != "cpu" or not redirected:
        raise ValueError(
            f"trainer.backend=megatron with device={kind}: megatron-core calls CUDA "
            "throughout, so it trains on GPUs (set trainer.device=cuda); CPU runs exist "
            "only under the test suite's shim (tests/megatron_shim.py)"
        )
    return torch.device("cpu")


def _use_te(impl: str) -> bool:
    if impl == "local":
        return False
    installed = bridge.has_transformer_engine()
    if impl == "transformer_engine" and not installed:
        raise ValueError("trainer.megatron.transformer_impl=transformer_engine: not installed")
    return installed


def _join_model_parallel(config: TrainerConfig, hf: Any) -> dict[str, int]:
    """megatron's TP/PP groups over the launcher's process group (a one-rank group of
    our own when there is none); checks the sizes fit the world and the model."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    tp, pp = config.megatron.tensor_parallel, config.megatron.pipeline_parallel
    if not dist.is_initialized():
        backend = "nccl" if config.device == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of TP {tp} x PP {pp}")
    bridge.check_tp(hf, tp)
    bridge.pp_layers(hf.num_hidden_layers, 0, pp)
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
        )
        if have != (tp, pp):
            raise ValueError(
                f"megatron is already initialised with TP, PP = {have}, not {(tp, pp)}"
            )
    else:
        ps.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(config.seed)
    return {"tp": tp, "pp": pp, "dp": world // (tp * pp)}


def _hf_state(path: str, hf: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The HF checkpoint's tensors under HF names (a tied head is the embedding itself),
    in the training dtype (what the parameters hold anyway)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    state = model.state_dict()
    if hf.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _generation_config(path: str) -> Any:
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return None
