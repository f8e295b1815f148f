"""LoRA adapters on the policy (``trainer.lora``), with peft: only the adapters train.

An adapted linear computes

    y = x W0^T + (alpha / r) * dropout(x) A^T B^T        A: [r, in], B: [out, r]

with ``B = 0`` at the start (peft's initialisation), so version 0 is the base model. A
weight version carries the merged weights or the adapters alone (``trainer.lora.publish``;
``docs/design.md``, "LoRA"); either way the engine samples from what the trainer computes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from asyncrl.trainers.config import LoraConfig
from asyncrl.weights.lora_merge import SCALING

#: The file peft writes an adapter's weights to (``PeftModel.save_pretrained``).
ADAPTER_FILE = "adapter_model.safetensors"


@dataclass(slots=True)
class Adapters:
    """The peft wrapper around a policy whose target linears carry LoRA layers."""

    peft_model: Any  # peft.PeftModel; its ``base_model.model`` is the HF model, adapted
    config: LoraConfig

    @classmethod
    def attach(cls, model: nn.Module, config: LoraConfig) -> Adapters:
        """Adapt ``model`` in place (see the module docstring); only adapters train."""
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        peft_config = PeftLoraConfig(
            r=config.rank,
            lora_alpha=config.alpha,
            lora_dropout=config.dropout,
            target_modules=config.target_modules,
            task_type="CAUSAL_LM",
        )
        try:
            peft_model = get_peft_model(model, peft_config)
        except ValueError as exc:  # peft names the target it could not find
            raise ValueError(f"trainer.lora.target_modules: {exc}") from exc
        return cls(peft_model, config)

    @property
    def model(self) -> nn.Module:
        """The HF model itself, with its target linears adapted."""
        return self.peft_model.base_model.model

    def layers(self) -> dict[str, nn.Module]:
        """``{module name: LoRA layer}`` of the adapted linears."""
        from peft.tuners.lora import LoraLayer

        return {n: m for n, m in self.model.named_modules() if isinstance(m, LoraLayer)}

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    @torch.no_grad()
    def merged_weights(self) -> dict[str, torch.Tensor]:
        """Every weight under its HF name, adapters merged: ``W0 + (alpha / r) B A``.

        Unadapted tensors are the model's own (detached, not copied); merged ones are new.
        """
        out: dict[str, torch.Tensor] = {}
        for key, value in self.model.state_dict().items():
            if ".lora_" not in key:
                out[key.replace(".base_layer.", ".")] = value.detach()
        for name, layer in self.layers().items():
            base = layer.get_base_layer().weight
            delta = layer.get_delta_weight("default")
            # In float32, rounded once to the weights' dtype: as the engine merges.
            out[f"{name}.weight"] = (base.float() + delta.float()).to(base.dtype).detach()
        return out

    def version_tensors(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """What a weight version carries (``config.publish``): merged weights or adapters;
        CPU copies unless ``copy=False``."""
        tensors = self.adapter_tensors() if self.config.publish == "adapters" else None
        tensors = self.merged_weights() if tensors is None else tensors
        if copy:
            tensors = {k: v.to("cpu", copy=True) for k, v in tensors.items()}
        return {k: v.contiguous() for k, v in tensors.items()}

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """``{module}.lora_A.weight``, ``{module}.lora_B.weight`` under HF module names,
        and ``SCALING`` (``alpha / r``): an adapter version (``weights/lora_merge.py``)."""
        prefix = "base_model.model."
        out = {k.removeprefix(prefix): v.detach() for k, v in self.state_dict().items()}
        out[SCALING] = torch.tensor(self.config.alpha / self.config.rank, dtype=torch.float32)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The adapters' tensors under peft's names (what ``ADAPTER_FILE`` holds)."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.peft_model)

    def save(self, path: Path) -> None:
        """``adapter_config.json`` and ``ADAPTER_FILE`` into ``path`` (peft's layout, which
        peft, vLLM and SGLang load onto the base model)."""
        self.peft_model.save_pretrained(str(path))

    def _check_saved_config(self, path: Path) -> None:
        """Refuse adapters saved with another rank or alpha (another scale)."""
        saved = json.loads((path / "adapter_config.json").read_text())
        ours = {"r": self.config.rank, "lora_alpha": self.config.alpha}
        differ = {k: (saved.get(k), v) for k, v in ours.items() if saved.get(k) != v}
        if differ:
            raise ValueError(
                f"{path}: adapters saved with "
                + ", ".join(f"{k} {a} (this run: {b})" for k, (a, b) in differ.items())
                + ": resume with the same trainer.lora settings"
            )

    def load(self, path: Path) -> None:
        """Load ``save``'s adapters onto this model; every adapter tensor must be there."""
        from peft import set_peft_model_state_dict

        self._check_saved_config(Path(path))
        tensors = load_file(str(Path(path) / ADAPTER_FILE))
        result = set_peft_model_state_dict(self.peft_model, tensors)
        missing = [k for k in result.missing_keys if ".lora_" in k]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"{path}: adapters do not match this model's (missing {missing[:3]}, "
                f"unexpected {list(result.unexpected_keys)[:3]}): was it trained with "
                "other trainer.lora settings?"
            )
