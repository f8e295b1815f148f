"""``load_config``: a preset, a YAML file and ``--flag`` values into a validated tree.

Every problem becomes one line of a single ``ConfigError``, raised before any process
starts: unknown keys and flags get a did-you-mean, bad values name key, flag, expectation
and value, and values from the file name file and line.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

import pydantic
import yaml
from pydantic import BaseModel
from pydantic_core import ErrorDetails

from asyncrl.config.flags import (
    FlagSpec,
    as_flag,
    flag_table,
    non_null,
    normal_flag,
    section_model,
)
from asyncrl.config.run import PRESETS, RunConfig
from asyncrl.config.sections import ConfigError, KeyConflict

ModelT = TypeVar("ModelT", bound=BaseModel)
Overrides = Sequence[str] | Mapping[str, Any]
_MISSING = object()


def _bools_for_numbers(
    data: Any, model: type[BaseModel], loc: tuple[str, ...] = ()
) -> Iterator[ErrorDetails]:
    """A boolean where a number goes: pydantic takes ``true`` as 1, and YAML reads
    ``yes``/``no``/``on``/``off`` as booleans, so ``num_steps: true`` trained 1 step and
    ``lr: yes`` at 1.0."""
    if not isinstance(data, dict):
        return
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            continue
        members = set(non_null(field.annotation))
        if isinstance(value, bool) and members & {int, float} and bool not in members:
            message = (
                "expected a number, not a boolean (YAML reads true, false, yes, no, "
                "on and off as booleans)"
            )
            yield ErrorDetails(type="bool_for_number", loc=(*loc, key), msg=message, input=value)
        elif float in members and not isinstance(value, bool) and not _finite(value):
            message = "expected a finite number"
            yield ErrorDetails(type="not_finite", loc=(*loc, key), msg=message, input=value)
        elif (section := section_model(field.annotation)) is not None:
            yield from _bools_for_numbers(value, section, (*loc, key))


def _finite(value: Any) -> bool:
    """False for NaN and the infinities, as numbers or as text (``--lr inf``)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return True  # not a number at all: pydantic says what is wrong with it
    return math.isfinite(number)


@overload
def load_config(
    path: str | Path | None = None,
    overrides: Overrides = (),
    *,
    preset: str | None = None,
) -> RunConfig: ...
@overload
def load_config(
    path: str | Path | None = None,
    overrides: Overrides = (),
    *,
    preset: str | None = None,
    model: type[ModelT],
) -> ModelT: ...
def load_config(
    path: str | Path | None = None,
    overrides: Overrides = (),
    *,
    preset: str | None = None,
    model: type[BaseModel] = RunConfig,
) -> BaseModel:
    """Build and validate the config of a job; raises ``ConfigError`` listing every problem.

    ``preset`` names a base in ``PRESETS``; ``path`` is a YAML file (or None); ``overrides``
    is ``["--flag", "value", "--flag=value", ...]`` or ``{"--flag": value}`` (from
    ``overrides_from_namespace``). Precedence, lowest first: section defaults, the preset,
    the file, the flags (a later flag beats an earlier one). A flag's text is read as
    JSON, then YAML, except for string leaves, which keep it verbatim (``--name 007``).
    """
    table = flag_table(model)
    data = _preset_data(preset)
    origins: dict[tuple[str, ...], str] = {}
    if path is not None:
        file_data, origins = _read_yaml(Path(path))
        _merge(data, file_data)
    values, problems = _flag_values(overrides, table)
    for spec, raw in values:
        _set(data, spec.path, spec.parse(raw) if isinstance(raw, str) else raw)
        for depth in range(1, len(spec.path) + 1):
            origins.pop(spec.path[:depth], None)
    loose = list(_bools_for_numbers(data, model))  # values pydantic would take
    problems += [_explain(err, table, origins) for err in loose]
    try:
        cfg = model.model_validate(data)
    except pydantic.ValidationError as exc:
        said = {tuple(err["loc"]) for err in loose}
        errors = [err for err in exc.errors() if tuple(map(str, err["loc"])) not in said]
        problems += [_explain(err, table, origins) for err in errors]
    if problems:
        raise ConfigError("\n".join(problems))
    return cfg


def _preset_data(name: str | None) -> dict[str, Any]:
    if name is None:
        return {}
    if name not in PRESETS:
        known = ", ".join(PRESETS)
        raise ConfigError(f"unknown preset {name!r}{_hint(name, PRESETS)} (known: {known})")
    return PRESETS[name]().model_dump()


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """The mapping in ``path`` and, for every key in it, ``"file:line"``."""
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    text = path.read_text()
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}{_yaml_problem(exc)}") from None
    if node is None:
        return {}, {}
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(
            f"{path}:{node.start_mark.line + 1}: the top level must be a mapping "
            f"(key: value lines), got a {type(data).__name__}"
        )
    _refuse_duplicates(node, path, ())
    return data, {key: f"{path}:{line}" for key, line in _key_lines(node, ())}


def _refuse_duplicates(node: yaml.MappingNode, path: Path, prefix: tuple[str, ...]) -> None:
    """YAML keeps the last of two equal keys and drops the first silently: refuse them."""
    first: dict[str, int] = {}
    for key, value in node.value:
        name, line = str(key.value), key.start_mark.line + 1
        if name in first:
            dotted = ".".join((*prefix, name))
            raise ConfigError(
                f"{path}:{line}: duplicate key '{dotted}' (first at line {first[name]}): "
                "YAML would keep only this one; write the key once"
            )
        first[name] = line
        if isinstance(value, yaml.MappingNode):
            _refuse_duplicates(value, path, (*prefix, name))


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or problem is None:
        return f": invalid YAML: {exc}"
    context, context_mark = (
        getattr(exc, "context", None),
        getattr(exc, "context_mark", None),
    )
    where = f" ({context} that starts at line {context_mark.line + 1})" if context_mark else ""
    return f":{mark.line + 1}:{mark.column + 1}: invalid YAML: {problem}{where}"


def _key_lines(
    node: yaml.MappingNode, prefix: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], int]]:
    for key, value in node.value:
        path = (*prefix, str(key.value))
        yield path, key.start_mark.line + 1
        if isinstance(value, yaml.MappingNode):
            yield from _key_lines(value, path)


def _flag_values(
    overrides: Overrides, table: dict[str, FlagSpec]
) -> tuple[list[tuple[FlagSpec, Any]], list[str]]:
    """Known ``(spec, raw value)`` pairs in order, and one problem line per bad option."""
    pairs = overrides.items() if isinstance(overrides, Mapping) else _split_options(overrides)
    values: list[tuple[FlagSpec, Any]] = []
    problems: list[str] = []
    for flag, raw in pairs:
        flag = normal_flag(flag)
        if not flag.startswith("--"):
            problems.append(f"expected an option like --flag VALUE, got {flag!r}")
        elif flag not in table:
            problems.append(f"unknown option {flag}{_hint(flag, table, quote=False)}")
        elif raw is _MISSING and table[flag].is_switch:
            values.append((table[flag], "true"))
        elif raw is _MISSING:
            problems.append(f"option {flag} needs a value: {flag} {table[flag].metavar}")
        else:
            values.append((table[flag], raw))
    return values, problems


def _split_options(tokens: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """``--flag value`` and ``--flag=value`` as pairs; a value never starts with ``--``."""
    rest = [tokens] if isinstance(tokens, str) else list(tokens)
    while rest:
        token = rest.pop(0)
        flag, eq, value = token.partition("=")
        if token.startswith("--") and eq:
            yield flag, value
        elif token.startswith("--") and rest and not rest[0].startswith("--"):
            yield token, rest.pop(0)
        else:
            yield token, _MISSING


def _hint(word: str, options: Any, *, quote: bool = True) -> str:
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    if not match:
        return ""
    return f" (did you mean '{match[0]}'?)" if quote else f" (did you mean {match[0]}?)"


def _merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _set(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(data.get(key), dict):
            data[key] = {}
        data = data[key]
    data[path[-1]] = value


def _explain(err: ErrorDetails, table: dict[str, FlagSpec], origins: dict[tuple, str]) -> str:
    """One pydantic error as a line: where it came from, key (flag), expectation, value."""
    loc = tuple(str(part) for part in err["loc"])
    blamed = (err.get("ctx") or {}).get("error")
    if isinstance(blamed, KeyConflict):
        loc = blamed.path
    source = _longest_prefix(origins, loc)
    prefix = f"{source}: " if source else ""
    if err["type"] == "extra_forbidden":
        return f"{prefix}unknown key '{'.'.join(loc)}'{_key_hint(loc, table)}"
    spec = _longest_prefix({s.path: s for s in table.values()}, loc)
    head = ".".join(loc) or "config"  # the key, which is also the flag
    head += f" ({spec.aliases[0]})" if spec and spec.aliases else ""  # slime's name
    message = err["msg"].removeprefix("Value error, ")
    hide = err["type"] == "missing" or isinstance(blamed, KeyConflict)
    hide = hide or (spec is None and isinstance(err.get("input"), dict))
    got = "" if hide else f", got {json.dumps(err.get('input'), default=str)}"
    return f"{prefix}{head}: {message}{got}"


def _longest_prefix(mapping: Mapping[tuple, Any], loc: tuple[str, ...]) -> Any:
    return next((mapping[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in mapping), None)


def _key_hint(loc: tuple[str, ...], table: dict[str, FlagSpec]) -> str:
    """Did-you-mean for an unknown key, against every section and leaf path of the tree;
    a flag's name written as a key (slime's ``rollout_batch_size``) names its key."""
    flag = as_flag(loc[-1]) if loc else ""
    if flag in table and table[flag].path != loc:
        key = ".".join(table[flag].path)
        return f" ({flag} is a flag; its key is '{key}')"
    paths = {".".join(s.path[:n]) for s in table.values() for n in range(1, len(s.path) + 1)}
    return _hint(".".join(loc), sorted(paths))


#: Leaf names whose values are never written out in full: they may hold credentials.
_SECRET = re.compile(r"(^|_)(key|token|secret|password|server_args|headers)$", re.IGNORECASE)
_USERINFO = re.compile(r"(://)[^/@\s]+@")


def config_changes(before: Any, cfg: BaseModel) -> list[str]:
    """``key: old -> new`` for each resolved leaf of ``cfg`` that differs from ``before``
    (a run's earlier ``config.json``, parsed), keys dotted, in order. A key one side lacks
    reads ``(absent)``; a value that may hold a credential, ``(hidden)``."""
    after = json.loads(cfg.model_dump_json())

    def leaves(value: Any, key: str) -> Iterator[tuple[str, Any]]:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                yield from leaves(v, f"{key}.{k}" if key else k)
        else:
            yield key, value

    def shown(key: str, side: dict[str, Any]) -> str:
        if key not in side:
            return "(absent)"
        if side[key] is not None and _SECRET.search(key.rsplit(".", 1)[-1]):
            return "(hidden)"
        return _USERINFO.sub(r"\1***@", json.dumps(side[key]))

    old, new = dict(leaves(before, "")), dict(leaves(after, ""))
    missing = object()
    return [
        f"{k}: {shown(k, old)} -> {shown(k, new)}"
        for k in dict.fromkeys([*old, *new])
        if old.get(k, missing) != new.get(k, missing)
    ]


def dump_resolved(cfg: BaseModel, path: str | Path) -> None:
    """Write the full resolved config as JSON (nulls kept), atomically (a temp file, then
    a rename: a kill leaves the old or the new, never half); the CLI calls it per run."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(cfg.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)
