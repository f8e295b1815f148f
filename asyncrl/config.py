"""One typed config tree for a job, loaded from a preset, a YAML file and ``--flag`` values.

Precedence, lowest first: the section defaults, a preset (``debug_cpu``), the YAML file,
command-line flags. Every leaf has one flag: ``rollout.num_actors`` is
``--rollout-num-actors``; a field may take slime's name instead (``json_schema_extra=
{"flag": ...}``, DESIGN section 10). ``asyncrl train --help`` lists them all with their
defaults (``add_arguments``).

Everything is checked before any process starts: an unknown key or flag is a
``ConfigError`` with a did-you-mean, a bad value names its key, its flag, the value and
what was expected, and all problems are reported at once.

Called by the CLI; the validated tree travels to every actor as JSON in its spec.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

KiB, MiB = 1024, 1024 * 1024


class ConfigError(ValueError):
    """A config problem, with the key, the flag and a hint in the message."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RuntimeConfig(Section):
    """Where and how actors run."""

    type: Literal["local", "ray"] = Field(
        "local",
        description="runtime for the actors: local processes or a Ray cluster",
        json_schema_extra={"flag": "runtime"},
    )
    host: str = Field("127.0.0.1", description="address the job's channels bind to")
    heartbeat_interval: float = Field(1.0, gt=0, description="seconds between heartbeats")
    heartbeat_timeout: float = Field(
        10.0, gt=0, description="seconds without a heartbeat before an actor counts as hung"
    )
    stop_timeout: float = Field(
        10.0, gt=0, description="seconds an actor gets to drain and stop before SIGKILL"
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster address (ray runtime only)",
        json_schema_extra={"flag": "ray-address"},
    )

    @model_validator(mode="after")
    def _timeout_exceeds_interval(self) -> RuntimeConfig:
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must be greater than "
                f"heartbeat_interval ({self.heartbeat_interval})"
            )
        return self


class WireConfig(Section):
    """Channel limits (see ``asyncrl.wire``)."""

    max_frame_bytes: int = Field(256 * MiB, ge=MiB, description="largest frame accepted")
    hwm: int = Field(1000, ge=1, description="zmq high-water mark of every socket")
    batch_bytes: int = Field(256 * KiB, gt=0, description="reliable-channel batch size")
    window: int = Field(8192, ge=1, description="max unacknowledged reliable messages")
    redeliver_after: float = Field(2.0, gt=0, description="seconds before a resend")
    chunk_bytes: int = Field(4 * MiB, gt=0, description="chunk size of the blob pull")

    @model_validator(mode="after")
    def _fit_in_frames(self) -> WireConfig:
        for name in ("batch_bytes", "chunk_bytes"):
            if getattr(self, name) > self.max_frame_bytes:
                raise ValueError(
                    f"{name} ({getattr(self, name)}) must not exceed "
                    f"max_frame_bytes ({self.max_frame_bytes})"
                )
        return self


class LogConfig(Section):
    """Logging of the controller and every actor."""

    level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    format: Literal["console", "json"] = Field(
        "console", description="console output for people or JSON lines for machines"
    )


class RolloutConfig(Section):
    """Rollout actors."""

    num_actors: int = Field(2, ge=1, description="number of rollout actors")


class RunConfig(Section):
    """The root of a job's configuration."""

    name: str = Field("asyncrl", min_length=1, description="run name")
    output_dir: str = Field("runs/{name}", description="run directory; {name} is replaced")
    seed: int = Field(0, description="random seed of the job")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    wire: WireConfig = Field(default_factory=WireConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)

    def resolved_output_dir(self) -> Path:
        """``output_dir`` with ``{name}`` filled in."""
        return Path(self.output_dir.replace("{name}", self.name))


# -- presets (Python, not YAML) ---------------------------------------------------------
def debug_cpu() -> RunConfig:
    """A tiny CPU job: two rollout actors, fast heartbeats."""
    return RunConfig(
        name="debug-cpu", runtime=RuntimeConfig(heartbeat_interval=0.5, heartbeat_timeout=10.0)
    )


PRESETS: dict[str, Callable[[], RunConfig]] = {"debug_cpu": debug_cpu}


# -- the flag table ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """One leaf of the tree as a command-line option."""

    flag: str
    path: tuple[str, ...]
    annotation: str
    default: Any
    description: str
    choices: tuple[str, ...] | None = None


def _leaves(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[FlagSpec]:
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _leaves(ann, path)
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        flag = str(extra.get("flag", "-".join(path).replace("_", "-")))
        default = field.get_default(call_default_factory=True)
        choices = getattr(ann, "__args__", None) if str(ann).startswith("typing.Literal") else None
        yield FlagSpec(
            f"--{flag}",
            path,
            _type_name(ann),
            default,
            field.description or "",
            tuple(map(str, choices)) if choices else None,
        )
        for alias in extra.get("aliases", ()):
            yield FlagSpec(f"--{alias}", path, _type_name(ann), default, f"alias of --{flag}", None)


def _type_name(ann: Any) -> str:
    return getattr(ann, "__name__", None) or str(ann).replace("typing.", "")


def flag_table(model: type[BaseModel] = RunConfig) -> dict[str, FlagSpec]:
    """``{"--flag": FlagSpec}`` for every leaf of ``model``; duplicate flags raise."""
    table: dict[str, FlagSpec] = {}
    for spec in _leaves(model):
        if spec.flag in table:
            raise ValueError(
                f"{spec.flag} names both {'.'.join(table[spec.flag].path)} "
                f"and {'.'.join(spec.path)}"
            )
        table[spec.flag] = spec
    return table


def add_arguments(parser: argparse.ArgumentParser, model: type[BaseModel] = RunConfig) -> None:
    """Add every config flag to ``parser`` (one group per section) for ``--help``."""
    groups: dict[str, Any] = {}
    for spec in flag_table(model).values():
        section = ".".join(spec.path[:-1]) or "run"
        group = groups.get(section) or groups.setdefault(
            section, parser.add_argument_group(f"{section} options")
        )
        metavar = "{" + ",".join(spec.choices) + "}" if spec.choices else spec.annotation.upper()
        group.add_argument(
            spec.flag,
            dest=f"cfg:{spec.flag}",
            default=argparse.SUPPRESS,
            metavar=metavar,
            help=f"{spec.description} (default: {spec.default})",
        )


def overrides_from_namespace(ns: argparse.Namespace) -> dict[str, str]:
    """The ``{"--flag": raw value}`` pairs given on the command line."""
    return {k.removeprefix("cfg:"): v for k, v in vars(ns).items() if k.startswith("cfg:")}


# -- loading ----------------------------------------------------------------------------
def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] | Mapping[str, str] = (),
    *,
    preset: str | None = None,
    model: type[BaseModel] = RunConfig,
) -> Any:
    """Build and validate the config; raises ``ConfigError`` listing every problem.

    ``overrides`` is either ``["--flag", "value", "--flag2=value"]`` or ``{"--flag": value}``;
    values are read as YAML (``3`` is an int, ``[1, 2]`` a list).
    """
    data = _preset(preset, model)
    if path is not None:
        _merge(data, _read_yaml(Path(path), model))
    table = flag_table(model)
    pairs = overrides.items() if isinstance(overrides, Mapping) else _pairs(overrides, table)
    for flag, raw in pairs:
        _set(data, table[_known(flag, table)].path, _parse_value(raw))
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(_format_errors(exc, table, path)) from None


def _preset(name: str | None, model: type[BaseModel]) -> dict[str, Any]:
    if name is None:
        return {}
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}{_did_you_mean(name, PRESETS)}")
    return PRESETS[name]().model_dump(exclude_unset=True)


def _read_yaml(path: Path, model: type[BaseModel]) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of keys, got {type(data).__name__}"
        )
    problems = list(_unknown_keys(data, model, ()))
    if problems:
        raise ConfigError("\n".join(f"{path}: {p}" for p in problems))
    return data


def _unknown_keys(
    data: dict[str, Any], model: type[BaseModel], prefix: tuple[str, ...]
) -> Iterator[str]:
    for key, value in data.items():
        field = model.model_fields.get(key)
        dotted = ".".join((*prefix, str(key)))
        if field is None:
            yield f"unknown key '{dotted}'{_did_you_mean(str(key), model.model_fields, prefix)}"
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            if isinstance(value, dict):
                yield from _unknown_keys(value, field.annotation, (*prefix, key))


def _did_you_mean(word: str, options: Any, prefix: tuple[str, ...] = ()) -> str:
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{'.'.join((*prefix, match[0]))}'?)" if match else ""


def _pairs(tokens: Sequence[str], table: dict[str, FlagSpec]) -> Iterator[tuple[str, str]]:
    it = iter(tokens)
    for token in it:
        if not token.startswith("--"):
            raise ConfigError(f"expected an option like --flag, got {token!r}")
        flag, sep, value = token.partition("=")
        if not sep:
            _known(flag, table)
            value = next(it, None)
            if value is None:
                raise ConfigError(f"option {flag} needs a value")
        yield flag, value


def _known(flag: str, table: dict[str, FlagSpec]) -> str:
    if flag not in table:
        match = difflib.get_close_matches(flag, list(table), n=1, cutoff=0.6)
        hint = f" (did you mean {match[0]}?)" if match else ""
        raise ConfigError(f"unknown option {flag}{hint}")
    return flag


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if isinstance(raw, str) else raw
    except yaml.YAMLError:
        return raw


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _set(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value


def _format_errors(
    exc: pydantic.ValidationError, table: dict[str, FlagSpec], path: str | Path | None
) -> str:
    by_path = {spec.path: spec.flag for spec in table.values()}
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        flag = by_path.get(loc)
        where = ".".join(loc) or "config"
        where += f" ({flag})" if flag else ""
        msg = err["msg"].removeprefix("Value error, ")
        got = f", got {json.dumps(err['input'], default=str)}" if loc and "input" in err else ""
        lines.append(f"{where}: {msg}{got}")
    return "\n".join(lines)


def dump_resolved(cfg: BaseModel, path: str | Path) -> None:
    """Write the full resolved config as JSON (nulls kept) next to the run's outputs."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(cfg.model_dump_json(indent=2))
