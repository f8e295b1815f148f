"""Prompt data sources: read and validate prompt files, draw ``Prompt`` records, resumably.

``PromptSource.open`` validates every selected row, so bad data fails at start, not hours
into a run, with a ``DataError`` naming file, line and problem, e.g.
``data/train.jsonl:17: missing key 'prompt' (did you mean 'promt'?)``. Draws tokenise
lazily. The state is only epoch and cursor (consumed uids are the buffer's to track); a
state saved for other data is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from asyncrl.buffer.readers import DataError, read_bytes, read_raw_rows
from asyncrl.types import ChatMessage, Prompt, pack_int32

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["DataError", "Exhausted", "PromptSource", "check_chat", "read_objects", "split_path"]

_ROLES = ("assistant", "system", "tool", "user")
_SLICE = re.compile(r"@\[(?P<body>[^\]]*)\]$")
_STATE_VERSION = 1


#: The largest row ``PromptSource`` accepts by default (its JSON line's bytes).
MAX_ROW_BYTES = 8 * 2**20
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class Exhausted(Exception):
    """Raised by ``PromptSource.next`` once ``num_epochs`` or ``num_rollouts`` are used up."""


def split_path(spec: str) -> tuple[str, slice]:
    """Split ``"file@[a:b]"`` into the file and its row slice (every row when there is none).

    The slice is Python's (slime's syntax): either bound may be omitted or negative."""
    match = _SLICE.search(spec)
    if match is None:
        if "@[" in spec:
            raise ValueError(f"path {spec!r}: malformed row slice, expected 'file@[start:stop]'")
        return spec, slice(None)
    file, body = spec[: match.start()], match["body"]
    if not file:
        raise ValueError(f"path {spec!r}: no file before the row slice")
    bounds = body.split(":")
    if len(bounds) != 2:
        raise ValueError(f"path {spec!r}: row slice [{body}] must be [start:stop], no step")
    return file, slice(*(_slice_bound(spec, b) for b in bounds))


def _slice_bound(spec: str, text: str) -> int | None:
    text = text.strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"path {spec!r}: slice bound {text!r} is not an integer") from None


@dataclasses.dataclass(frozen=True, slots=True)
class SourceRow:
    """One validated row: where it came from and its fields."""

    index: int  # 0-based row number in the whole file (prompt_id)
    where: str  # "file:line" or "file row N", the prefix of every error about it
    prompt: str | list[ChatMessage]
    label: Any
    metadata: dict[str, Any]
    tools: list[dict[str, Any]] | None


class PromptSource:
    """Draws ``Prompt`` records from one prompt file, epoch by epoch; build it with ``open``.

    Each epoch visits every selected row exactly once, in an order fixed by ``(seed, epoch)``
    alone, so a run resumed from ``state_dict()`` continues with exactly the prompts an
    uninterrupted run would have drawn. Not thread-safe: one owner (the BufferActor) draws.
    """

    class Config(BaseModel):
        """Where the prompts are, which keys hold what, and how they are drawn."""

        model_config = ConfigDict(extra="forbid", validate_assignment=True)

        path: str = Field(
            description="jsonl/json/parquet file or a saved HF datasets folder; 'file@[a:b]' "
            "selects rows a:b"
        )
        input_key: str = Field("prompt", description="key of the prompt (string or chat)")
        label_key: str | None = Field("label", description="key of the label; null for none")
        metadata_key: str | None = Field("metadata", description="key of a metadata object")
        tools_key: str | None = Field(None, description="key of the tool schemas, if any")
        default_tools: list[dict[str, Any]] | None = Field(
            None, description="tool schemas rendered when a row has none (from rollout.tool_use)"
        )
        apply_chat_template: bool = Field(False, description="render with the chat template")
        system_prompt: str | None = Field(
            None, description="system message put before string prompts when templating"
        )
        chat_template_kwargs: dict[str, Any] = Field(
            default_factory=dict,
            description="extra arguments of the chat template (e.g. {enable_thinking: false})",
        )
        max_prompt_length: int | None = Field(
            None,
            ge=1,
            description="drop rows whose prompt is longer (tokens, as the engine gets it) at "
            "load, counted (buffer.data_too_long); null keeps all",
        )
        shuffle: bool = Field(True, description="visit rows in a new seeded order each epoch")
        seed: int = Field(0, description="seed of the per-epoch shuffle")
        num_epochs: int = Field(1, ge=1, description="passes over the data (see num_rollouts)")
        num_rollouts: int | None = Field(
            None, ge=1, description="stop after this many prompts; overrides num_epochs if set"
        )
        name: str | None = Field(None, description="prefix of prompt ids; the file stem if null")
        max_row_bytes: int = Field(
            MAX_ROW_BYTES,
            ge=1,
            description="largest row accepted (bytes of its JSON line); a larger one is an error",
        )

        @field_validator("path")
        @classmethod
        def _check_path(cls, value: str) -> str:
            split_path(value)
            return value

    def __init__(
        self,
        config: Config,
        rows: list[SourceRow],
        identity: dict[str, Any],
        tokenizer: PreTrainedTokenizerBase | None,
    ) -> None:
        """Wrap rows that ``open`` read and validated; use ``open`` rather than this."""
        self.config = config
        self._rows = rows
        self._identity = identity
        self._tokenizer = tokenizer
        self._epoch = 0
        self._cursor = 0  # position in this epoch's order
        self.too_long = 0  # rows dropped at load for max_prompt_length
        self._order_cache: tuple[int, np.ndarray] | None = None

    @classmethod
    def open(cls, config: Config, tokenizer: PreTrainedTokenizerBase | None = None) -> PromptSource:
        """Read and validate every selected row of ``config.path``; raises ``DataError``.

        With a tokenizer each draw carries ``text`` and ``packed_prompt`` token ids; without
        one they are ``None`` and empty (a rollout workflow tokenises itself).
        """
        file, data, start, stop, objs = _read_selected(config.path, config.max_row_bytes)
        rows = [_check_row(where, obj, config, start + i) for i, (where, obj) in enumerate(objs)]
        _check_optional_keys(file, [obj for _, obj in objs], config)
        identity = {
            "name": config.name or Path(file).stem,
            "path": config.path,
            "rows": [start, stop],
            "num_rows": len(rows),
            "sha256": hashlib.sha256(data).hexdigest(),
            "shuffle": config.shuffle,
            "seed": config.seed,
        }
        source = cls(config, rows, identity, tokenizer)
        if tokenizer is not None:
            source._check_tokenizer_fit()
        if config.max_prompt_length is not None:
            source._drop_too_long(config.max_prompt_length)
        return source

    def _drop_too_long(self, limit: int) -> None:
        """Keep the rows whose prompt is at most ``limit`` tokens; ``too_long`` counts the
        rest (the data's identity records the limit: a resume with another is refused)."""
        if self._tokenizer is None:
            raise DataError(
                f"{self.config.path}: max_prompt_length counts tokens, and this source has "
                "no tokenizer (a workflow that tokenises itself): drop max_prompt_length"
            )
        kept = [row for row in self._rows if len(self._tokenize(row)[1]) // 4 <= limit]
        self.too_long = len(self._rows) - len(kept)
        if not kept:
            raise DataError(
                f"{self.config.path}: every one of the {len(self._rows)} prompts is longer "
                f"than max_prompt_length {limit} tokens"
            )
        self._rows = kept
        self._identity |= {"max_prompt_length": limit, "num_rows": len(kept)}

    # -- drawing ----------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Source name, the prefix of every ``prompt_id``."""
        return self._identity["name"]

    @property
    def num_rows(self) -> int:
        """Rows selected from the file (after slicing); one epoch draws each once."""
        return len(self._rows)

    @property
    def epoch(self) -> int:
        """The epoch the next draw comes from (0-based)."""
        return self._epoch

    @property
    def drawn(self) -> int:
        """Prompts drawn so far, over all epochs."""
        return self._epoch * len(self._rows) + self._cursor

    @property
    def exhausted(self) -> bool:
        """True once ``num_rollouts`` prompts (or, if unset, ``num_epochs`` epochs) are drawn."""
        if self.config.num_rollouts is not None:
            return self.drawn >= self.config.num_rollouts
        return self._epoch >= self.config.num_epochs

    def next(self) -> Prompt:
        """Draw the next prompt; raises ``Exhausted`` at the end, ``DataError`` for a bad row."""
        if self.exhausted:
            raise Exhausted(f"{self.config.path}: all {self.drawn} prompts were drawn")
        row = self._rows[self._order()[self._cursor]]
        prompt = self._make_prompt(row)  # before moving the cursor: a failed row is not skipped
        self._cursor += 1
        if self._cursor == len(self._rows):
            self._epoch, self._cursor = self._epoch + 1, 0
        return prompt

    def take(self, n: int) -> list[Prompt]:
        """Draw up to ``n`` prompts; fewer (maybe none) once the source is exhausted."""
        if n < 0:
            raise ValueError(f"take(n) needs n >= 0, got {n}")
        prompts: list[Prompt] = []
        while len(prompts) < n and not self.exhausted:
            prompts.append(self.next())
        return prompts

    def _order(self) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != self._epoch:
            n = len(self._rows)
            order = np.arange(n)
            if self.config.shuffle:
                # Seeded by (seed, epoch) only, so resuming needs no RNG state.
                order = np.random.default_rng([self.config.seed, self._epoch]).permutation(n)
            self._order_cache = (self._epoch, order)
        return self._order_cache[1]

    def _make_prompt(self, row: SourceRow) -> Prompt:
        """``prompt_id`` is ``<name>:<row>`` (0-based in the whole file); ``uid`` adds
        ``@<epoch>``."""
        text, packed = self._tokenize(row)
        prompt_id = f"{self.name}:{row.index}"
        # Copies, so a consumer that edits a prompt (a multi-turn chat) cannot edit the row.
        return Prompt(
            uid=f"{prompt_id}@{self._epoch}",
            prompt_id=prompt_id,
            epoch=self._epoch,
            prompt=copy.deepcopy(row.prompt),
            text=text,
            packed_prompt=packed,
            label=copy.deepcopy(row.label),
            metadata=copy.deepcopy(row.metadata),
            tools=copy.deepcopy(row.tools),
        )

    def _tokenize(self, row: SourceRow) -> tuple[str | None, bytes]:
        tokenizer = self._tokenizer
        if tokenizer is None:
            return None, b""
        # A chat prompt without a template was refused by open, so the else is a string.
        text = self._render(row, tokenizer) if self.config.apply_chat_template else row.prompt
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return text, pack_int32(ids)

    def _render(self, row: SourceRow, tokenizer: PreTrainedTokenizerBase) -> str:
        messages = row.prompt
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
            if self.config.system_prompt is not None:
                messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=row.tools or self.config.default_tools or None,
                add_generation_prompt=True,
                tokenize=False,
                **self.config.chat_template_kwargs,
            )
        except Exception as exc:  # the template is user code (jinja) and may raise anything
            raise DataError(f"{row.where}: chat template failed: {exc}") from exc
        if not isinstance(text, str):
            raise DataError(f"{row.where}: chat template returned {type(text).__name__}")
        return text

    @property
    def rows(self) -> Sequence[SourceRow]:
        """The selected rows, validated, in file order (for checks before a job starts)."""
        return self._rows

    def prompt_lengths(self) -> Iterator[tuple[str, int]]:
        """``(where, tokens)`` of every row's prompt as the engine gets it (rendered with
        the chat template when configured); needs the tokenizer. ``DataError`` for a row
        the template fails on."""
        for row in self._rows:
            yield row.where, len(self._tokenize(row)[1]) // 4

    def _check_tokenizer_fit(self) -> None:
        if not self.config.apply_chat_template:
            for row in self._rows:
                if not isinstance(row.prompt, str):
                    raise DataError(
                        f"{row.where}: the prompt is a list of chat messages; "
                        "set apply_chat_template to render it with the tokenizer"
                    )
        self._tokenize(self._rows[0])  # a template that fails on every row fails now

    # -- checkpoint ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The cursor and the identity of the data, as plain JSON-able values."""
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "cursor": self._cursor,
            "drawn": self.drawn,
            "source": dict(self._identity),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next draw is the one that would have come next.

        Raises ``DataError`` if the state was saved for other data (file contents, slice,
        name, seed or shuffle differ), since its cursor would point at different prompts.
        ``num_epochs`` and ``num_rollouts`` may change between runs.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise DataError(f"{self.config.path}: not a version {_STATE_VERSION} source state")
        self._check_identity(state.get("source"))
        epoch, cursor = state.get("epoch"), state.get("cursor")
        n = len(self._rows)
        if not (_is_int(epoch) and _is_int(cursor) and epoch >= 0 and 0 <= cursor <= n):
            raise DataError(f"{self.config.path}: bad cursor epoch={epoch!r} cursor={cursor!r}")
        if state.get("drawn") != epoch * n + cursor:
            raise DataError(f"{self.config.path}: state drawn={state.get('drawn')!r} disagrees")
        self._epoch, self._cursor = divmod(epoch * n + cursor, n)

    def _check_identity(self, saved: Any) -> None:
        if not isinstance(saved, dict):
            raise DataError(f"{self.config.path}: source state has no 'source' identity")
        changed = [
            f"{key} {saved.get(key)!r} -> {value!r}"
            for key, value in self._identity.items()
            if key != "path" and saved.get(key) != value  # the same data may move
        ]
        if changed:
            raise DataError(
                f"{self.config.path}: the state was saved for other data ({saved.get('path')}); "
                f"changed: {', '.join(changed)}. Refusing to resume a cursor into different rows."
                + self._seed_hint(saved)
            )

    def _seed_hint(self, saved: dict[str, Any]) -> str:
        """Runs before the job's --seed seeded the shuffle kept data.seed 0 whatever it was."""
        old = saved.get("seed")
        if old is None or old == self.config.seed:
            return ""
        return f" To resume with the saved order, pass --rollout-seed {old}."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- reading ------------------------------------------------------------------------
def _select(spec: str, file: str, rows: slice, num_rows: int) -> tuple[int, int]:
    start, stop, _ = rows.indices(num_rows)
    if not num_rows:
        raise DataError(f"{file} has no rows")
    if start >= stop:
        body = spec[spec.rindex("@[") + 1 :]
        raise DataError(f"{file}: slice {body} selects no rows of {num_rows}")
    return start, stop


def read_objects(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row object)`` for every selected row of ``"file[@[a:b]]"``.

    ``where`` is ``file:line`` (jsonl) or ``file row n`` (parquet), for error messages.
    Raises ``DataError`` for a missing or empty file, a bad slice or a row that is not an
    object. Used by ``PromptSource`` and by the SFT data loader.
    """
    return _read_selected(spec, MAX_ROW_BYTES)[4]


def _read_selected(
    spec: str, max_row_bytes: int
) -> tuple[str, bytes, int, int, list[tuple[str, dict[str, Any]]]]:
    file, rows_slice = split_path(spec)
    data = read_bytes(file)
    raw_rows = read_raw_rows(file, data)
    start, stop = _select(spec, file, rows_slice, len(raw_rows))
    selected = raw_rows[start:stop]
    for where, raw in selected:
        if isinstance(raw, bytes) and len(raw) > max_row_bytes:
            raise DataError(
                f"{where}: the row is {len(raw) / 2**20:.1f} MiB, over the {max_row_bytes} "
                "bytes allowed (data.max_row_bytes): no prompt that long fits a context"
            )
    return file, data, start, stop, [(w, _as_object(w, raw)) for w, raw in selected]


# -- validating ---------------------------------------------------------------------
def _as_object(where: str, raw: Any) -> dict[str, Any]:
    obj = _decode(where, raw) if isinstance(raw, bytes) else raw
    if not isinstance(obj, dict):
        raise DataError(f"{where}: row is {_kind(obj)}, expected an object")
    return obj


def _check_row(
    where: str, obj: dict[str, Any], config: PromptSource.Config, index: int
) -> SourceRow:
    key = config.input_key
    if key not in obj:
        raise DataError(f"{where}: missing key {key!r}{_did_you_mean(key, obj)}")
    return SourceRow(
        index=index,
        where=where,
        prompt=_check_prompt(where, key, obj[key]),
        label=obj.get(config.label_key) if config.label_key else None,
        metadata=_check_metadata(where, config.metadata_key, obj),
        tools=_check_tools(where, config.tools_key, obj),
    )


def _decode(where: str, line: bytes) -> Any:
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        hint = " (.json files are read as JSON lines, one object per line)"
        hint = hint if where.rpartition(":")[0].endswith(".json") else ""
        raise DataError(f"{where}: invalid JSON: {exc}{hint}") from None
    if _SURROGATE_ESCAPE.search(line):  # only an escape can smuggle a lone surrogate in
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise DataError(
                f"{where}: a lone UTF-16 surrogate escape ({exc.object[exc.start]!r}) is not "
                "text: no tokenizer or message frame can encode it; fix or drop the row"
            ) from None
    return obj


def _check_prompt(where: str, key: str, value: Any) -> str | list[ChatMessage]:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: {key!r} is an empty prompt")
        return value
    if not isinstance(value, list):
        raise DataError(
            f"{where}: {key!r} is {_kind(value)}, expected a string or a list of chat messages"
        )
    if not value:
        raise DataError(f"{where}: {key!r} is an empty list of chat messages")
    for i, message in enumerate(value):
        _check_message(f"{where}: message {i} of {key!r}", message)
    return value


def check_chat(where: str, key: str, value: Any) -> list[ChatMessage]:
    """``value`` as a non-empty list of chat messages, else a ``DataError`` naming ``where``."""
    checked = _check_prompt(where, key, value)
    if isinstance(checked, str):
        raise DataError(f"{where}: {key!r} is a string, expected a list of chat messages")
    return checked


def _check_message(where: str, message: Any) -> None:
    if not isinstance(message, dict):
        raise DataError(f"{where} is {_kind(message)}, expected an object with role and content")
    role = message.get("role")
    if role not in _ROLES:
        raise DataError(f"{where} has role {role!r}, expected one of {', '.join(_ROLES)}")
    if not isinstance(message.get("content"), str):
        raise DataError(f"{where} has content {_kind(message.get('content'))}, expected a string")


def _check_metadata(where: str, key: str | None, obj: dict[str, Any]) -> dict[str, Any]:
    value = obj.get(key) if key else None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DataError(f"{where}: metadata {key!r} is {_kind(value)}, expected an object")
    return value


def _check_tools(where: str, key: str | None, obj: dict[str, Any]) -> list[dict[str, Any]] | None:
    value = obj.get(key) if key else None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: tools {key!r} is a string but not JSON: {exc}") from None
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"{where}: tools {key!r} must be a list of objects (tool schemas)")
    return value


def _check_optional_keys(
    file: str, objs: list[dict[str, Any]], config: PromptSource.Config
) -> None:
    """A label or tools key that no row has is a typo or the wrong dataset: fail loudly."""
    for field, key in (("label_key", config.label_key), ("tools_key", config.tools_key)):
        if key is not None and not any(key in obj for obj in objs):
            raise DataError(
                f"{file}: no row has {field} {key!r}{_did_you_mean(key, objs[0])}; "
                f"set {field} to null if the data has none"
            )


def _did_you_mean(key: str, obj: dict[str, Any]) -> str:
    keys = [k for k in obj if isinstance(k, str)]
    close = difflib.get_close_matches(key, keys, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (row has keys: {', '.join(map(repr, keys))})" if keys else " (row is empty)"


def _kind(value: Any) -> str:
    """JSON's name for the type of ``value``, with an article, for error messages."""
    kinds = {type(None): "null", bool: "a boolean", str: "a string", list: "an array"}
    kinds |= {dict: "an object", int: "a number", float: "a number"}
    return kinds.get(type(value), f"a {type(value).__name__}")
