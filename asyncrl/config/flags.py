"""Every leaf of the config tree as a command-line flag: one vocabulary with the YAML keys.

A leaf's flag is its dotted key with ``--`` in front (``rollout.num_actors`` is
``--rollout.num-actors``); slime's names are aliases (``SLIME_FLAGS``, or a field's
``json_schema_extra``). ``add_arguments`` registers them with argparse,
``overrides_from_namespace`` returns what the user typed, and ``config_reference`` writes
``docs/config.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
from collections.abc import Callable, Iterator
from pathlib import PurePath
from typing import Any, Literal, Union, get_args, get_origin

import pydantic
import yaml
from pydantic import BaseModel

from asyncrl.config.run import RunConfig

_DEST = "config:"


#: slime's names (aliases of the key flags) for leaves of sections that components own
#: (``docs/design.md`` section 8); a field's own ``json_schema_extra`` adds more.
SLIME_FLAGS: dict[tuple[str, ...], str] = {
    ("buffer", "groups_per_step"): "rollout-batch-size",
    ("buffer", "num_samples_per_prompt"): "n-samples-per-prompt",
    ("buffer", "mask_resumed_tokens"): "mask-offpolicy-in-partial-rollout",
    ("data", "path"): "prompt-data",
    ("eval", "interval"): "eval-interval",
    ("eval", "sets"): "eval-sets",
    ("data", "input_key"): "input-key",
    ("data", "label_key"): "label-key",
    ("data", "metadata_key"): "metadata-key",
    ("data", "tools_key"): "tool-key",
    ("data", "apply_chat_template"): "apply-chat-template",
    ("data", "shuffle"): "rollout-shuffle",
    ("data", "seed"): "rollout-seed",
    ("data", "num_epochs"): "num-epoch",
    ("data", "num_rollouts"): "num-rollout",
    ("algo", "advantage_estimator"): "advantage-estimator",
    ("algo", "eps_clip"): "eps-clip",
    ("algo", "eps_clip_high"): "eps-clip-high",
    ("algo", "eps_clip_c"): "eps-clip-c",
    ("algo", "loss_aggregation"): "loss-aggregation",
    ("algo", "normalize_advantages"): "normalize-advantages",
    ("algo", "kl_coef"): "kl-coef",
    ("algo", "use_kl_loss"): "use-kl-loss",
    ("algo", "kl_loss_coef"): "kl-loss-coef",
    ("algo", "kl_loss_type"): "kl-loss-type",
    ("algo", "entropy_coef"): "entropy-coef",
    ("algo", "gamma"): "gamma",
    ("algo", "lambd"): "lambd",
    ("algo", "value_clip"): "value-clip",
    ("algo", "use_rollout_logprobs"): "use-rollout-logprobs",
    ("algo", "off_policy_correction"): "off-policy-correction",
    ("algo", "is_low"): "tis-clip-low",
    ("algo", "is_high"): "tis-clip",
    ("trainer", "model_path"): "hf-checkpoint",
    ("trainer", "lr"): "lr",
    ("trainer", "weight_decay"): "weight-decay",
    ("trainer", "adam_eps"): "adam-eps",
    ("trainer", "grad_clip"): "clip-grad",
    ("trainer", "warmup_steps"): "lr-warmup-iters",
    ("trainer", "max_tokens_per_microbatch"): "max-tokens-per-gpu",
    ("trainer", "ref_model_path"): "ref-load",
}


#: What ``asyncrl train --help`` shows; ``--help-all`` shows every key.
EVERYDAY: tuple[tuple[str, ...], ...] = (
    ("name",), ("output_dir",), ("seed",),
    ("data", "path"), ("data", "input_key"), ("data", "label_key"),
    ("data", "apply_chat_template"), ("data", "num_epochs"),
    ("trainer", "model_path"), ("trainer", "backend"), ("trainer", "lr"),
    ("trainer", "dtype"), ("trainer", "max_tokens_per_microbatch"),
    ("buffer", "groups_per_step"), ("buffer", "num_samples_per_prompt"),
    ("buffer", "max_staleness"), ("buffer", "over_provision"), ("buffer", "filters"),
    ("rollout", "num_actors"), ("rollout", "sampling"), ("rollout", "workflow"),
    ("rollout", "engine", "type"), ("rollout", "engine", "urls"),
    ("rollout", "reward", "type"),
    ("algo", "advantage_estimator"), ("algo", "off_policy_correction"),
    ("algo", "kl_loss_coef"),
    ("train", "num_steps"), ("train", "checkpoint_interval"), ("train", "publish"),
    ("eval", "interval"), ("eval", "sets"),
    ("runtime", "type"), ("log", "level"), ("log", "use_tensorboard"), ("log", "use_wandb"),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """One leaf of the tree as a command-line option (a row of ``flag_table``)."""

    flag: str
    path: tuple[str, ...]
    annotation: str
    default: Any
    description: str
    metavar: str
    aliases: tuple[str, ...]
    required: bool
    parse: Callable[[str], Any] = dataclasses.field(repr=False, compare=False)

    @property
    def is_switch(self) -> bool:
        """A bool flag: given alone (``--use-kl-loss``) it means true, as in slime."""
        return self.metavar == _BOOL_METAVAR


def flag_table(model: type[BaseModel] = RunConfig) -> dict[str, FlagSpec]:
    """``{"--flag": FlagSpec}`` for every leaf of ``model``, aliases included (the dotted
    key flag first, then slime's names).

    Used by ``load_config``, ``add_arguments`` and the CLI's unknown-option check. Two
    leaves claiming one flag is a programming error and raises ``ValueError``.
    """
    table: dict[str, FlagSpec] = {}
    for spec in _leaves(model):
        for flag in (spec.flag, *spec.aliases):
            if flag in table:
                raise ValueError(
                    f"{flag} names both {'.'.join(table[flag].path)} and {'.'.join(spec.path)}"
                )
            table[flag] = spec
    return table


def _leaves(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[FlagSpec]:
    for name, field in model.model_fields.items():
        section = section_model(field.annotation)
        if section is not None:
            yield from _leaves(section, (*prefix, name))
        else:
            yield _leaf_spec((*prefix, name), field)


def _section_meanings(
    model: type[BaseModel], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[str, str]]:
    """``(dotted section, its field's description)`` for every section of ``model``."""
    for name, field in model.model_fields.items():
        if (section := section_model(field.annotation)) is not None:
            yield ".".join((*prefix, name)), field.description or ""
            yield from _section_meanings(section, (*prefix, name))


def _leaf_spec(path: tuple[str, ...], field: pydantic.fields.FieldInfo) -> FlagSpec:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    required = field.is_required()
    named = [extra.get("flag"), SLIME_FLAGS.get(path), *(extra.get("aliases") or ())]
    flag = key_flag(path)
    aliases = dict.fromkeys(as_flag(str(a)) for a in named if a and as_flag(str(a)) != flag)
    return FlagSpec(
        flag=flag,
        path=path,
        annotation=_type_text(field.annotation),
        default=None if required else field.get_default(call_default_factory=True),
        description=field.description or "",
        metavar=metavar(field.annotation),
        aliases=tuple(aliases),
        required=required,
        parse=_value_parser(field.annotation),
    )


def key_flag(path: tuple[str, ...]) -> str:
    """The flag of the key at ``path``: ``("rollout", "num_actors")`` is
    ``--rollout.num-actors``."""
    return "--" + ".".join(part.replace("_", "-") for part in path)


def normal_flag(token: str) -> str:
    """``token`` (``--flag`` or ``--flag=value``) as the table spells the flag: ``_`` and
    ``-`` are one in a key flag, so ``--rollout.num_actors`` is ``--rollout.num-actors``.
    Other tokens (values, slime's names, an SGLang server's flags) are left as they are."""
    name, eq, value = token.partition("=")
    if not (name.startswith("--") and "." in name):
        return token
    return name.replace("_", "-") + eq + value


def section_model(ann: Any) -> type[BaseModel] | None:
    """The model of a section field (``Model`` or ``Model | None``), else None."""
    members = non_null(ann)
    ann = members[0] if len(members) == 1 else None
    is_model = get_origin(ann) is None and isinstance(ann, type) and issubclass(ann, BaseModel)
    return ann if is_model else None


def as_flag(name: str) -> str:
    return "--" + name.lstrip("-").replace("_", "-")


def _type_text(ann: Any) -> str:
    if get_origin(ann) is None and isinstance(ann, type):
        return ann.__name__
    return str(ann).replace("typing.", "")


def non_null(ann: Any) -> list[Any]:
    """The members of a union other than None; ``[ann]`` for anything else."""
    if get_origin(ann) in (Union, types.UnionType):
        return [a for a in get_args(ann) if a is not type(None)]
    return [ann]


_BOOL_METAVAR = "{true,false}"


def metavar(ann: Any) -> str:
    """How a flag of type ``ann`` shows its value: ``{a,b}``, ``{true,false}``, ``MAP``..."""
    members = non_null(ann)
    ann = members[0] if len(members) == 1 else Any
    origin = get_origin(ann) or ann
    if origin is Literal:
        return "{" + ",".join(_show(a) for a in get_args(ann)) + "}"
    named = {bool: _BOOL_METAVAR, list: "LIST", tuple: "LIST", set: "LIST", dict: "MAP"}
    return named.get(origin) or (ann.__name__.upper() if isinstance(ann, type) else "VALUE")


def _is_text(ann: Any) -> bool:
    if get_origin(ann) is Literal:
        return all(isinstance(a, str) for a in get_args(ann))
    return isinstance(ann, type) and issubclass(ann, str | PurePath)


def _value_parser(ann: Any) -> Callable[[str], Any]:
    """How a flag's raw text becomes a value: verbatim for strings, YAML for the rest."""
    if not all(_is_text(a) for a in non_null(ann)):
        return _parse_yaml
    if type(None) in get_args(ann):
        return lambda raw: None if raw in ("null", "~") else raw
    return str


def _parse_yaml(raw: str) -> Any:
    """JSON first (YAML 1.1 reads ``1e-300``, inside ``{...}`` too, as a string), then YAML."""
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _show(value: Any) -> str:
    """A value as the user would type it: strings bare, the rest as JSON (null, true)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def add_arguments(
    parser: argparse.ArgumentParser,
    model: type[BaseModel] = RunConfig,
    *,
    show: Callable[[FlagSpec], bool] = lambda spec: True,
) -> None:
    """Add every flag of ``model`` to ``parser``, one argument group per section.

    Called by the CLI so ``asyncrl train --help`` lists options with their meaning and
    default: those ``show`` picks (the rest are accepted, and listed by ``--help-all``).
    Values stay raw text; read them back with ``overrides_from_namespace``.
    """
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in {spec.path: spec for spec in flag_table(model).values()}.values():
        section = ".".join(spec.path[:-1]) or "general"
        if section not in groups:
            groups[section] = parser.add_argument_group(section)
        groups[section].add_argument(
            spec.flag,
            *spec.aliases,
            dest=_DEST + spec.flag,
            default=argparse.SUPPRESS,
            metavar=spec.metavar,
            help=_help_text(spec) if show(spec) else argparse.SUPPRESS,
            **({"nargs": "?", "const": "true"} if spec.is_switch else {}),
        )


def everyday(spec: FlagSpec) -> bool:
    """An option ``asyncrl train --help`` shows (``EVERYDAY``)."""
    return spec.path in EVERYDAY


def _help_text(spec: FlagSpec) -> str:
    default = "required" if spec.required else f"default: {_show(spec.default)}"
    return f"{spec.description} ({default})".replace("%", "%%")


def overrides_from_namespace(ns: argparse.Namespace) -> dict[str, str]:
    """``{"--flag": raw text}`` for the config flags the user gave, for ``load_config``."""
    return {key.removeprefix(_DEST): v for key, v in vars(ns).items() if key.startswith(_DEST)}


def config_reference(model: type[BaseModel] = RunConfig) -> str:
    """``docs/config.md``: every key of ``model`` with its flag, slime's names, type,
    default and meaning, one table per section (``make config-doc`` writes it; a test
    keeps it current)."""
    specs = list({spec.path: spec for spec in flag_table(model).values()}.values())
    sections: dict[str, list[FlagSpec]] = {}
    for spec in specs:
        sections.setdefault(".".join(spec.path[:-1]) or "(top level)", []).append(spec)
    out = [
        "# Configuration reference",
        "",
        (
            "Generated from the config schema (`asyncrl/config/`) by `make config-doc`; do "
            "not edit by hand. Every key is a YAML key and, dotted, a flag of `asyncrl train`: "
            "`rollout.num_actors` is `--rollout.num-actors`. Other names are slime's, accepted "
            "as aliases. `asyncrl train --help` shows the everyday keys (marked *), "
            "`--help-all` all of them."
        ),
    ]
    meanings = dict(_section_meanings(model))
    for section, rows in sections.items():
        out += ["", f"## {section}", ""]
        if meanings.get(section):
            out += [meanings[section][0].upper() + meanings[section][1:] + ".", ""]
        out += ["| key | flag | type | default | meaning |"]
        out += ["|---|---|---|---|---|"]
        for spec in rows:
            names = ", ".join(f"`{a}`" for a in (spec.flag, *spec.aliases))
            key = "`" + ".".join(spec.path) + "`" + (" *" if spec.path in EVERYDAY else "")
            default = "required" if spec.required else f"`{_show(spec.default)}`"
            cells = [key, names, f"`{spec.metavar}`", default, spec.description]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"
