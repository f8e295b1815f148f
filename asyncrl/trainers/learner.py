"""A model under training: its DP wrapper, AdamW, LR schedule, and HF-named weights.

``torch_trainer.TorchTrainer`` holds one ``Learner`` for the policy and one for the
critic (PPO). Weights leave and enter under Hugging Face names: ``state_dict`` names with
tied duplicates dropped (``lm_head.weight`` when the head shares the embedding), exactly
the tensors ``save_pretrained`` writes, so ``AutoModelForCausalLM.from_pretrained`` and
``TorchEngine.update_weights_from_tensors`` take them unchanged.

A learner's checkpoint directory holds ``config.json`` + ``model.safetensors`` (an HF
directory), ``optimizer.pt`` and ``scheduler.pt``; rank 0 writes it.

With LoRA (``lora.Adapters``) only the adapters are trained and in the optimizer; the
weights leave merged (an ordinary HF model), and checkpoints add the adapters, which a
resume loads (the HF folder of merged weights is for serving; loading it into the base
would add the adapters twice).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from asyncrl.errors import NonFiniteTraining
from asyncrl.trainers.base import NonFiniteStep
from asyncrl.trainers.config import LoraConfig
from asyncrl.trainers.direct_io import save_object, save_tensors
from asyncrl.trainers.lora import Adapters
from asyncrl.trainers.parallel import DataParallel

Schedule = Literal["constant", "cosine"]


@dataclass(frozen=True, slots=True)
class OptimSettings:
    """AdamW hyper-parameters and the LR schedule (see ``lr_factor``)."""

    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: Schedule = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0


def lr_factor(step: int, settings: OptimSettings) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based).

    With warmup ``W``: ``(step + 1) / W`` while ``step < W``. Then ``constant`` gives 1;
    ``cosine`` gives ``m + (1 - m) * (1 + cos(pi * p)) / 2`` with
    ``p = min(1, (step - W) / (total_steps - W))`` and ``m = min_lr_ratio``.
    """
    warmup = settings.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if settings.schedule == "constant" or settings.total_steps is None:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, settings.total_steps - warmup))
    m = settings.min_lr_ratio
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress))


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: kept}`` for parameters registered under several names (tied embeddings).

    The first name in registration order is kept (``model.embed_tokens.weight`` before
    ``lm_head.weight``), which is the name ``save_pretrained`` writes.
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def write_hf_dir(
    path: Path, config: Any, tensors: dict[str, torch.Tensor], generation: Any = None
) -> None:
    """``config.json`` (+ ``generation_config.json``) and one ``model.safetensors``
    (past the page cache: ``direct_io``), every file readable by others."""
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    if generation is not None:
        generation.save_pretrained(path)
    save_tensors(tensors, path / "model.safetensors", metadata={"format": "pt"})
    share_files(path)


def share_files(path: Path) -> None:
    """Make every file in ``path`` readable by group and others (a checkpoint is read by
    whoever serves or evaluates it, not only by the user who trained it)."""
    for f in path.iterdir():
        if f.is_file():
            with contextlib.suppress(OSError):  # a mount that refuses chmod keeps its modes
                f.chmod(f.stat().st_mode | 0o044)


def write_model_dir(path: Path, model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """``write_hf_dir`` with the config and generation config of the HF ``model``."""
    write_hf_dir(path, model.config, tensors, getattr(model, "generation_config", None))


@functools.lru_cache(maxsize=4)
def _tokenizer(source: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):  # no tokenizer next to the weights: weights only
        return None


def copy_tokenizer(source: str, path: Path) -> None:
    """Save the tokenizer of ``source`` (with its chat template) into ``path``, when
    ``source`` has one; loaded once per process, however many checkpoints follow."""
    tokenizer = _tokenizer(source)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
        share_files(path)


@dataclass(slots=True)
class Learner:
    """One trained model: ``model`` (the HF module, sharded in place under FSDP),
    ``wrapped`` (what training forwards run through), its AdamW and LR schedule."""

    model: nn.Module
    wrapped: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    aliases: dict[str, str]
    dp: DataParallel
    adapters: Adapters | None = None

    @classmethod
    def build(
        cls,
        model: nn.Module,
        dp: DataParallel,
        device: torch.device,
        settings: OptimSettings,
        lora: LoraConfig | None = None,
    ) -> Learner:
        """Move ``model`` to ``device`` (with LoRA adapters when ``lora`` is enabled), wrap
        it for ``dp`` and give its trained parameters AdamW."""
        model.config.architectures = [type(model).__name__]
        aliases = tied_aliases(model)
        adapters = Adapters.attach(model, lora) if lora is not None and lora.enabled else None
        model = model.to(device).train()
        wrapped = dp.wrap(model, device)
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=settings.lr,
            betas=settings.betas,
            eps=settings.eps,
            weight_decay=settings.weight_decay,
            # One kernel over all parameters instead of a loop over them: the same update,
            # 0.32 -> 0.066 s a step for 135M parameters on 2 CPU threads.
            fused=not dp.sharded,
        )
        scheduler = LambdaLR(optimizer, partial(lr_factor, settings=settings))
        return cls(model, wrapped, optimizer, scheduler, aliases, dp, adapters)

    def sync(self, enabled: bool) -> AbstractContextManager[None]:
        """Gradient all-reduce on (last micro-batch) or off (the others)."""
        return self.dp.gradient_sync(self.wrapped, enabled)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The trained parameters (the adapters alone with LoRA)."""
        return (p for p in self.model.parameters() if p.requires_grad)

    def step(self, grad_clip: float | None) -> tuple[float, float]:
        """Clip, AdamW step, schedule step; returns ``(pre-clip grad norm, LR used)``.

        ``grad_clip`` None or 0 only measures the norm. ``NonFiniteStep``: see
        ``step_together``.
        """
        return step_together([self], grad_clip)[0]

    def clip(self, grad_clip: float | None) -> float:
        """Clip the gradients to ``grad_clip`` (None or 0: measure only); their pre-clip
        global norm, the same on every rank."""
        norm = nn.utils.clip_grad_norm_(list(self.parameters()), grad_clip or math.inf)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
            norm = norm.full_tensor()
        return float(norm)

    def apply(self) -> float:
        """AdamW step, schedule step, gradients cleared; returns the LR the step used."""
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr

    # -- weights and state ----------------------------------------------------------------
    def hf_weights(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """CPU copies under HF names, tied duplicates dropped (collective under FSDP).
        ``copy=False``: the weights themselves where they live (a GPU's), detached, valid
        until the next step, for a caller that copies them at once (the ``ipc``
        transport); sharded weights are still gathered to CPU copies. With LoRA: the
        merged weights (``Adapters.merged_weights``), CPU copies unless ``copy=False``."""
        if self.adapters is not None:
            merged = self.adapters.merged_weights()
            if copy:
                merged = {k: v.to("cpu", copy=True) for k, v in merged.items()}
            return {k: v.contiguous() for k, v in merged.items() if k not in self.aliases}
        if not copy and not self.dp.sharded:
            live = self.model.state_dict()
            return {k: v.detach() for k, v in live.items() if k not in self.aliases}
        full = self.dp.full_state_dict(self.model)
        return {k: v.contiguous() for k, v in full.items() if k not in self.aliases}

    def version_weights(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """What a weight version carries: ``hf_weights``, or with LoRA what
        ``trainer.lora.publish`` says (merged weights, or the adapters alone)."""
        if self.adapters is not None:
            tensors = self.adapters.version_tensors(copy)
            return {k: v for k, v in tensors.items() if k not in self.aliases}
        return self.hf_weights(copy)

    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in; every parameter must be given (aliases excepted)."""
        full = dict(tensors)
        for alias, kept in self.aliases.items():
            if kept in full:
                full.setdefault(alias, full[kept])
        self.dp.load_full_state_dict(self.model, full)

    def save(
        self, path: Path, state: Path, tokenizer: str | None = None, adapter: Path | None = None
    ) -> None:
        """The HF folder of the weights (with ``tokenizer``'s tokenizer) into ``path``, the
        optimizer and schedule into ``state``, and with LoRA the adapters into ``adapter``
        (default ``state/adapter``; rank 0 writes; all ranks call)."""
        saved = self.saved_state()
        if saved is not None:
            saved.write(path, state, tokenizer, adapter)

    def saved_state(self, copy: bool = False) -> SavedState | None:
        """What ``save`` writes, taken now (collective under FSDP; None on other ranks than
        0). ``copy``: CPU copies of the optimizer state too, so the state can be written
        while training goes on; not with LoRA, whose adapters peft writes from the live
        model (``ValueError``)."""
        if copy and self.adapters is not None:
            raise ValueError("LoRA adapters are written from the live model: no copy")
        weights = self.hf_weights()  # CPU copies
        optimizer = self.dp.optimizer_state(self.model, self.optimizer)
        if self.dp.rank != 0:
            return None
        if (name := first_non_finite(weights)) is not None:
            raise NonFiniteTraining(
                f"not writing a checkpoint: weight {name} holds NaN or infinite values"
            )
        if copy:
            optimizer = cpu_copies(optimizer)
        schedule = cpu_copies(self.scheduler.state_dict())
        return SavedState(self.model, weights, optimizer, schedule, self.adapters)

    def state_bytes(self) -> int:
        """Bytes a copy of ``saved_state`` holds: every parameter, and two AdamW moments of
        each trained one, in its dtype."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return params + 2 * sum(p.numel() * p.element_size() for p in self.parameters())

    def load(self, path: Path, state: Path, adapter: Path | None = None) -> None:
        """Restore ``save``'s folders (every rank reads them). Checkpoints written before
        the optimizer moved out of the HF folder keep it in ``path``: read there. With
        LoRA the adapters come from ``adapter`` (default ``state/adapter``) onto the base
        weights."""
        if self.adapters is not None:
            self.adapters.load(adapter or state / "adapter")
        else:
            tensors = load_file(str(path / "model.safetensors"))
            if (name := first_non_finite(tensors)) is not None:
                raise ValueError(f"weight {name} holds NaN or infinite values")
            self.load_hf_weights(tensors)
        state = state if (state / "optimizer.pt").is_file() else path
        # weights_only: tensors and plain containers, never arbitrary pickled objects.
        optimizer = torch.load(state / "optimizer.pt", weights_only=True)
        settings = self._settings()
        self.dp.load_optimizer_state(self.model, self.optimizer, optimizer)
        self.scheduler.load_state_dict(torch.load(state / "scheduler.pt", weights_only=True))
        self._apply(settings)

    _HYPER = ("initial_lr", "betas", "eps", "weight_decay")

    def _settings(self) -> list[dict[str, Any]]:
        return [{k: g[k] for k in self._HYPER} for g in self.optimizer.param_groups]

    def _apply(self, settings: list[dict[str, Any]]) -> None:
        """This run's AdamW settings and base LR over a loaded state (which carries the
        checkpoint's): a resume with ``--lr`` trains at it, the moments and the schedule's
        position kept. The LR is then ``base x lr_factor(step)``."""
        step = self.scheduler.last_epoch
        for group, lam, kept in zip(
            self.optimizer.param_groups, self.scheduler.lr_lambdas, settings, strict=True
        ):
            group.update(kept)
            group["lr"] = kept["initial_lr"] * lam(step)
        self.scheduler.base_lrs = [s["initial_lr"] for s in settings]
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]


@dataclass(frozen=True, slots=True)
class SavedState:
    """A learner's checkpoint held apart from it (``Learner.saved_state``): HF-named
    weights, optimizer and schedule state; ``model`` gives only its configs."""

    model: nn.Module
    weights: dict[str, torch.Tensor]
    optimizer: Any
    schedule: dict[str, Any]
    adapters: Adapters | None = None

    def write(
        self, path: Path, state: Path, tokenizer: str | None = None, adapter: Path | None = None
    ) -> None:
        """``Learner.save``'s layout (see there)."""
        write_model_dir(path, self.model, self.weights)
        if tokenizer is not None:
            copy_tokenizer(tokenizer, path)
        state.mkdir(parents=True, exist_ok=True)
        if self.adapters is not None:
            self.adapters.save(adapter or state / "adapter")
        save_object(self.optimizer, state / "optimizer.pt")
        torch.save(self.schedule, state / "scheduler.pt")


def cpu_copies(tree: Any) -> Any:
    """``tree`` (dicts, lists, tuples) with every tensor replaced by a CPU copy."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: cpu_copies(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(cpu_copies(v) for v in tree)
    return tree


def step_together(learners: list[Learner], grad_clip: float | None) -> list[tuple[float, float]]:
    """Clip every learner's gradients, then step them all or none: a NaN or infinite norm in
    any clears every learner's gradients and raises ``NonFiniteStep`` with the weights and
    optimizers untouched. ``(pre-clip grad norm, LR used)`` per learner."""
    norms = [learner.clip(grad_clip) for learner in learners]
    if not all(math.isfinite(n) for n in norms):
        for learner in learners:
            learner.optimizer.zero_grad(set_to_none=True)
        bad = next(n for n in norms if not math.isfinite(n))
        raise NonFiniteStep(f"the gradient norm is {bad}: step skipped")
    return [(norm, learner.apply()) for norm, learner in zip(norms, learners, strict=True)]


def first_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None
