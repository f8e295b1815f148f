"""A character-level ChatML tokenizer for the arithmetic demo: one token per byte.

``build_char_tokenizer()`` returns a ``PreTrainedTokenizerFast`` whose vocabulary is three
special tokens (ids 0-2) and the 256 bytes (id ``3 + byte``), with no merges: every ASCII
character (digits, ``+``, ``=``, ``,``, ``#``, space, newline, letters) is one token, and
any other text still encodes losslessly, byte by byte. Ids are fixed, so every machine
builds the same tokenizer. ``save_pretrained(dir)`` writes ``tokenizer.json`` and
``tokenizer_config.json``, which ``AutoTokenizer.from_pretrained(dir)`` reloads offline.
``make_model.py`` calls it.

Why byte-level rather than a plain character vocabulary: for a ``qwen2`` model directory,
transformers 5 ignores the saved tokenizer class and rebuilds ``Qwen2Tokenizer`` from the
vocab, with Qwen2's own normalizer, pre-tokenizer (regex split, then ByteLevel) and
decoder. Built here with exactly that pipeline, the tokenizer encodes and decodes the same
way whichever class loads it; a plain character vocab would lose every space on reload.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["CHATML_TEMPLATE", "SPECIAL_TOKENS", "build_char_tokenizer", "byte_symbols"]

#: Padding, message start, message end (the end doubles as EOS). Ids 0, 1, 2.
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]

#: Qwen2Tokenizer's split pattern (transformers ``models/qwen2/tokenization_qwen2.py``).
#: With no merges it changes no token; it is here so both classes run the same pipeline.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: Plain ChatML, enough for ``apply_chat_template``; the demo itself uses raw prompts.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def byte_symbols() -> list[str]:
    """GPT-2's byte-to-symbol table: printable bytes stand for themselves, the others
    (space, newline, controls, high bytes) for code points from 256 up (space is ``Ġ``)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer, wrapped for transformers (EOS ``<|im_end|>``, left padding)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        unk_token=None,
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TEMPLATE,
        padding_side="left",
    )
