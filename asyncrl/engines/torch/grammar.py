"""Grammar-constrained decoding with xgrammar (SGLang's and vLLM's default backend).

A request's ``json_schema``, ``regex`` or ``ebnf`` is compiled once per spec (xgrammar's
compiler caches by spec) into a per-request matcher. Before sampling, each constrained
row's disallowed tokens get logit ``-inf``; other rows are untouched. The reported
log-prob is therefore SGLang's: ``log_softmax(z_masked / T)``, renormalised over the
tokens the grammar allows (``docs/numerics.md``).
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import torch

from asyncrl.engines.base import ANY_JSON
from asyncrl.errors import EngineError

#: The compiled grammars kept (xgrammar's cache, least recently used out).
CACHE_BYTES = 256 << 20


class Grammars:
    """Compiles constraints for one tokenizer; xgrammar is imported on first use."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_ids: list[int], *, any_whitespace: bool
    ) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self.any_whitespace = any_whitespace
        self._compiler: Any = None
        self._lock = threading.Lock()

    def matcher(self, kind: str, spec: str) -> Any:
        """A fresh ``GrammarMatcher`` for the constraint; ``EngineError`` (a 400) for a
        spec xgrammar cannot compile or a kind this engine does not serve."""
        compiler = self._compiler or self._start()
        try:
            if kind == "json_schema":
                compiled = (
                    compiler.compile_builtin_json_grammar()
                    if spec == ANY_JSON
                    else compiler.compile_json_schema(
                        _schema_text(spec), any_whitespace=self.any_whitespace
                    )
                )
            elif kind == "regex":
                compiled = compiler.compile_regex(spec)
            elif kind == "ebnf":
                compiled = compiler.compile_grammar(spec)
            else:
                raise EngineError(f"{kind} is not supported by this engine")
        except (RuntimeError, ValueError) as exc:
            if isinstance(exc, EngineError):
                raise
            raise EngineError(f"invalid {kind}: {_cpp_message(exc)}") from None
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def _start(self) -> Any:
        if self.tokenizer is None:
            raise EngineError("constrained decoding needs the model's tokenizer")
        try:
            import xgrammar as xgr
        except ImportError:
            raise EngineError(
                "constrained decoding needs xgrammar (make installs it: pip install "
                "--no-deps xgrammar apache-tvm-ffi)"
            ) from None
        with self._lock:  # two first requests at once build one compiler
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids or None
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=CACHE_BYTES
                )
        return self._compiler


def _cpp_message(exc: Exception) -> str:
    """xgrammar's error without its ``[time] file.cc:line:`` prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc)).strip()


def _schema_text(spec: str) -> str:
    """The schema as JSON text; ``EngineError`` when it is not a JSON object."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise EngineError(f"invalid json_schema: not JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise EngineError("invalid json_schema: a schema is a JSON object")
    return spec


def mask_rows(logits: torch.Tensor, matchers: list[Any]) -> None:
    """Set to ``-inf``, in place, the logits of tokens each row's matcher disallows
    (``matchers[i]`` None: row ``i`` is free)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(logits), logits.shape[-1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    # torch_native on CUDA: xgrammar's CUDA default needs triton, which is not a dependency.
    backend = "cpu" if logits.device.type == "cpu" else "torch_native"
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device), indices=rows, backend=backend
    )
