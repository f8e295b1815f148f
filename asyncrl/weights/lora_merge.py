"""Adapter-only weight versions, merged by the engine onto its base weights.

With ``trainer.lora.publish: adapters`` a version carries, for each adapted linear ``M``,
``M.lora_A.weight`` ``[r, in]``, ``M.lora_B.weight`` ``[out, r]``, and one scalar
``SCALING`` (``alpha / r``). The engine loads, in float32 as the trainer merges (peft's
``get_delta_weight``), then cast to its dtype::

    W_M = W0_M + (B_M @ A_M) * scaling

A version is absolute, base plus its own adapters: a skipped or failed one leaves nothing
behind that the next depends on. On disk it is a peft adapter folder (``peft_layout``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncrl.errors import EngineError

#: The tensor holding ``alpha / r`` in an adapter version (its presence marks one).
SCALING = "lora.scaling"
_A, _B = ".lora_A.weight", ".lora_B.weight"


def is_adapter_version(tensors: dict[str, torch.Tensor]) -> bool:
    return SCALING in tensors


#: peft's prefix of an adapter's tensor names, and its files (``PeftModel.save_pretrained``).
PEFT_PREFIX = "base_model.model."
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def peft_layout(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An adapter version as peft saves adapters: ``adapter_config.json``'s content (``r``
    from ``A``'s rows, ``lora_alpha = scaling * r``, the adapted module names) and the
    tensors under peft's names. peft, vLLM (``--lora-modules``) and SGLang
    (``/load_lora_adapter``) load such a folder onto the base model."""
    scaling = float(tensors[SCALING])
    weights = {PEFT_PREFIX + k: v for k, v in tensors.items() if k != SCALING}
    ranks = {int(v.shape[0]) for k, v in tensors.items() if k.endswith(_A)}
    if len(ranks) != 1:
        raise EngineError(f"an adapter version needs one rank, got {sorted(ranks)}")
    r = ranks.pop()
    modules = sorted({k.removesuffix(_A).rsplit(".", 1)[-1] for k in tensors if k.endswith(_A)})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": scaling * r,
        "target_modules": modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
    }
    return config, weights


def read_peft_dir(path: Path) -> dict[str, torch.Tensor]:
    """A peft adapter folder as an adapter version (``peft_layout``'s inverse); plain LoRA
    only: rsLoRA, DoRA and per-module ranks or alphas are refused by name."""
    import json

    from safetensors.torch import load_file

    config = json.loads((path / PEFT_CONFIG).read_text())
    odd = [k for k in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern") if config.get(k)]
    if odd:
        raise EngineError(f"{path}: adapters with {', '.join(odd)} are not merged here")
    weights = load_file(path / PEFT_WEIGHTS)
    out = {k.removeprefix(PEFT_PREFIX): v for k, v in weights.items()}
    out[SCALING] = torch.tensor(float(config["lora_alpha"]) / int(config["r"]), dtype=torch.float32)
    return out


class BaseWeights:
    """The base model's tensors by name, read on demand from its ``*.safetensors``
    (memory-mapped, so the page cache holds them, not the engine)."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        files = sorted(Path(path).glob("*.safetensors")) if path else []
        if not files:
            raise EngineError(
                f"adapter versions merge onto the base model's safetensors, and {path!r} "
                "has none: load the engine from the trainer's model_path"
            )
        self._handles: list[Any] = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def shape(self, name: str) -> tuple[int, ...] | None:
        handle = self._where.get(name)
        return None if handle is None else tuple(handle.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)


class AdapterVersion:
    """The merged weights of one adapter version (module docstring): every name and shape
    checked against the model and the base before anything is copied."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], params: dict[str, torch.Tensor], base: BaseWeights
    ) -> None:
        self.scaling = float(tensors[SCALING])
        self.modules = sorted(n.removesuffix(_A) for n in tensors if n.endswith(_A))
        self._tensors, self._base = tensors, base
        self._check(params)

    def _check(self, params: dict[str, torch.Tensor]) -> None:
        expected = {SCALING} | {m + s for m in self.modules for s in (_A, _B)}
        stray = sorted(set(self._tensors) - expected)
        missing = sorted(expected - set(self._tensors))
        if stray or missing:
            raise EngineError(
                f"adapter version: unexpected tensors {stray[:3]}, missing {missing[:3]}"
            )
        for module in self.modules:
            a, b = self._tensors[module + _A], self._tensors[module + _B]
            name = f"{module}.weight"
            target = params.get(name)
            if target is None:
                raise EngineError(f"adapter version: the model has no weight {name}")
            want = (b.shape[0], a.shape[1])
            if a.shape[0] != b.shape[1] or tuple(target.shape) != want:
                raise EngineError(
                    f"adapter version: {module} has A {tuple(a.shape)} and B "
                    f"{tuple(b.shape)}, for a weight of shape {tuple(target.shape)}"
                )
            if self._base.shape(name) != want:
                raise EngineError(
                    f"adapter version: the base model's {name} is "
                    f"{self._base.shape(name)}, not {want}: another base model?"
                )

    def __len__(self) -> int:
        return len(self.modules)

    def load_into(self, params: dict[str, torch.Tensor]) -> None:
        """Write ``W0 + scaling * (B @ A)`` into each adapted linear's weight in ``params``:
        ``W0`` copied in, then one ``addmm_`` (float32 weights; others are merged in
        float32 and cast)."""
        for module in self.modules:
            name = f"{module}.weight"
            a = self._tensors[module + _A].to(params[name].device, torch.float32)
            b = self._tensors[module + _B].to(params[name].device, torch.float32)
            target = params[name]
            # ``get`` may hand out the file's own (mapped) memory: it is read, never written.
            if target.dtype == torch.float32:
                target.copy_(self._base.get(name))
                target.addmm_(b, a, alpha=self.scaling)
            else:
                target.copy_(torch.addmm(self._base.get(name).float(), b, a, alpha=self.scaling))
