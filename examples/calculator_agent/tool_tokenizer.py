"""The calculator agent's tokenizer: the arithmetic demo's byte-level characters, plus the
tool-call tags and a ChatML template with a tool role.

``build_tool_tokenizer()`` takes ``build_char_tokenizer()`` from ``examples/arith`` (three
specials, then one token per byte) and adds four special tokens (ids 259-262): the tags
``<tool_call>`` and ``</tool_call>``, and the fixed JSON around a calculator call's
expression, ``{"name": "calculator", "arguments": {"expression": "`` and ``"}}``. The calls
are the Qwen/Hermes convention that ``HermesParser`` reads,
``<tool_call>{"name": "calculator", "arguments": {"expression": "347*86"}}</tool_call>``,
but cost 4 tokens plus the expression instead of 73: on a CPU every token is decode time,
and a 1M-parameter model learns to copy an expression across 10 positions far faster than
across 60 (a first warm-up with one token per character never learned to copy at all).

The template (``TOOL_TEMPLATE``) is ChatML. When ``tools`` are given it opens with a
system turn that names them, ``Tools: calculator`` (a tiny model has no use for the whole
JSON schema, and every prompt token costs decode time on a CPU); a ``tool`` message is a
ChatML turn of role ``tool``. It is prefix-stable, as the multi-turn workflow, the
OpenAI proxy and ``asyncrl sft`` require.
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "arith"))
from char_tokenizer import build_char_tokenizer

__all__ = ["TOOL_TAGS", "TOOL_TEMPLATE", "build_tool_tokenizer"]

#: The call's markup: tags and the calculator's fixed JSON, one token each.
TOOL_TAGS = [
    "<tool_call>",
    "</tool_call>",
    '{"name": "calculator", "arguments": {"expression": "',
    '"}}',
]

TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\nTools: ' }}"
    "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer with the tool-call tags and ``TOOL_TEMPLATE``."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *TOOL_TAGS]})
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer
