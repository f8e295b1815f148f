"""A tiny local ChatML tokenizer for tests: byte-level BPE, vocab 512, no model hub.

``build_chatml_tokenizer(directory)`` trains it on a fixed generated corpus (so the ids are
the same on every machine), saves it with ``save_pretrained`` (``AutoTokenizer`` reloads it
from ``directory``) and returns it. Byte-level BPE encodes any text losslessly, so
``decode(encode(text)) == text`` holds for Unicode too. It takes a few milliseconds; share it
through a module- or session-scoped fixture. Used by data-source, rollout and engine tests.
"""

from __future__ import annotations

import os

# Must be set before transformers is imported: tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer
from transformers import PreTrainedTokenizerFast

__all__ = ["CHATML_TEMPLATE", "SPECIAL_TOKENS", "build_chatml_tokenizer"]

#: End of text, message start and end (the end doubles as EOS), padding.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

#: ChatML; when ``tools`` are given a first system block lists them, one JSON object a line.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_chatml_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """Train, save to ``directory`` and return a 512-token byte-level BPE ChatML tokenizer."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=512,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        unk_token=None,
        pad_token="<|pad|>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        chat_template=CHATML_TEMPLATE,
        padding_side="left",
    )
    wrapped.save_pretrained(directory)
    return wrapped


def _corpus() -> list[str]:
    # Generated rather than read from the system, so every machine trains the same merges.
    words = (
        "the a of to and in is that for it as with was on be by this are or from each model "
        "answer question number total apples books students prompt reward token step train "
        "buffer group sample policy value think first then final result check sum product"
    ).split()
    lines = [
        f"Question {i}: what is {i * 7 % 97} plus {i * 13 % 89}? "
        f"Answer: {i * 7 % 97 + i * 13 % 89}. "
        + " ".join(words[(i * k) % len(words)] for k in range(1, 12))
        for i in range(200)
    ]
    lines.append("You are a helpful assistant. Think step by step, then give the final answer.")
    return lines
