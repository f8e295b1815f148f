"""A tiny local Qwen2 causal LM with the ChatML test tokenizer, saved like a hub checkpoint.

``build_tiny_model(directory)`` writes ``config.json``, ``model.safetensors`` and the
tokenizer files into ``directory`` (``AutoModelForCausalLM.from_pretrained`` and
``TorchEngine.from_pretrained`` load it) and returns ``(model, tokenizer)``. Random
weights from a fixed seed: every machine builds the same model. 2 layers, hidden 64,
vocab 512 (~110k parameters), fp32. Used by engine, server and client tests.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from tests.tiny_tokenizer import build_chatml_tokenizer

__all__ = ["build_tiny_model", "tiny_config"]


def tiny_config(tokenizer: PreTrainedTokenizerFast, **overrides: object) -> Qwen2Config:
    """The tiny Qwen2 shape, with the tokenizer's EOS (``<|im_end|>``) and pad ids."""
    values = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        # Wider than HF's 0.02 so that random weights give peaked, varied next tokens.
        "initializer_range": 0.2,
    }
    values.update(overrides)
    return Qwen2Config(**values)


def build_tiny_model(
    directory: Path, *, seed: int = 0, **overrides: object
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """Build, save to ``directory`` and return the tiny model and its tokenizer."""
    tokenizer = build_chatml_tokenizer(directory)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(tokenizer, **overrides)).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    return model, tokenizer
