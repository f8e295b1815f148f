"""The config tree: precedence, flags, and errors that name the key, flag and value."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from asyncrl.config import (
    ConfigError,
    RunConfig,
    Section,
    add_arguments,
    dump_resolved,
    flag_table,
    load_config,
    overrides_from_namespace,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_defaults_need_no_file_or_flags():
    cfg = load_config()
    assert cfg == RunConfig()
    assert cfg.resolved_output_dir() == Path("runs/asyncrl")


def test_flags_beat_the_file_which_beats_the_preset(tmp_path: Path):
    path = write(tmp_path, "name: from-file\nruntime:\n  heartbeat_interval: 2.0\n")
    cfg = load_config(path, ["--name", "from-flag", "--rollout-num-actors=4"], preset="debug_cpu")
    assert cfg.name == "from-flag"
    assert cfg.runtime.heartbeat_interval == 2.0  # file over preset's 0.5
    assert cfg.runtime.heartbeat_timeout == 10.0  # preset over default
    assert cfg.rollout.num_actors == 4


def test_values_from_flags_are_read_as_yaml_and_validated():
    cfg = load_config(overrides={"--seed": "7", "--runtime": "ray", "--ray-address": "auto"})
    assert (cfg.seed, cfg.runtime.type, cfg.runtime.ray_address) == (7, "ray", "auto")


def test_an_unknown_nested_key_names_its_path_and_suggests_the_right_one(tmp_path: Path):
    path = write(tmp_path, "rollout:\n  num_actor: 3\nseeed: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert "unknown key 'rollout.num_actor' (did you mean 'rollout.num_actors'?)" in msg
    assert "unknown key 'seeed' (did you mean 'seed'?)" in msg
    assert str(path) in msg


def test_an_unknown_flag_suggests_the_closest_one():
    with pytest.raises(
        ConfigError,
        match=r"unknown option --rollout-num-actor \(did you mean "
        r"--rollout-num-actors\?\)",
    ):
        load_config(overrides=["--rollout-num-actor", "3"])


def test_bad_values_name_key_flag_value_and_expectation_all_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(
            overrides=["--rollout-num-actors", "-1", "--log-level", "loud", "--wire-hwm", "many"]
        )
    lines = sorted(str(info.value).splitlines())
    assert len(lines) == 3
    assert lines[0].startswith("log.level (--log-level): Input should be") and '"loud"' in lines[0]
    assert lines[1] == (
        "rollout.num_actors (--rollout-num-actors): Input should be "
        "greater than or equal to 1, got -1"
    )
    assert lines[2].startswith("wire.hwm (--wire-hwm): Input should be a valid integer")


def test_cross_field_rules_are_explained_in_a_sentence():
    with pytest.raises(
        ConfigError,
        match=r"heartbeat_timeout \(1.0\) must be greater than "
        r"heartbeat_interval \(2.0\)",
    ):
        load_config(
            overrides=["--runtime-heartbeat-interval", "2", "--runtime-heartbeat-timeout", "1"]
        )


def test_a_flag_without_a_value_is_an_error():
    with pytest.raises(ConfigError, match="--seed needs a value"):
        load_config(overrides=["--seed"])


def test_broken_yaml_names_file_and_line(tmp_path: Path):
    path = write(tmp_path, "name: ok\nruntime:\n  host: [unclosed\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+: invalid YAML"):
        load_config(path)


def test_a_top_level_that_is_not_a_mapping_is_refused(tmp_path: Path):
    with pytest.raises(ConfigError, match="top level must be a mapping of keys, got list"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_a_missing_file_or_preset_is_refused():
    with pytest.raises(ConfigError, match=r"config file 'nope\.yaml' does not exist"):
        load_config("nope.yaml")
    with pytest.raises(ConfigError, match=r"unknown preset 'debug_gpu' .*'debug_cpu'"):
        load_config(preset="debug_gpu")


def test_every_leaf_has_a_unique_flag_and_a_description():
    table = flag_table()
    assert len({spec.path for spec in table.values()}) == len(table)
    assert all(spec.description for spec in table.values()), [
        f for f, s in table.items() if not s.description
    ]
    assert {"--runtime", "--ray-address", "--log-level", "--rollout-num-actors", "--seed"} <= set(
        table
    )


class Inner(Section):
    deep_value: int = Field(1, description="three levels down")


class Middle(Section):
    inner: Inner = Field(default_factory=Inner)


class Outer(Section):
    middle: Middle = Field(default_factory=Middle)


def test_flags_follow_the_rule_at_any_depth():
    assert set(flag_table(Outer)) == {"--middle-inner-deep-value"}
    cfg = load_config(overrides=["--middle-inner-deep-value", "5"], model=Outer)
    assert cfg.middle.inner.deep_value == 5


class Clash(BaseModel):
    a_b: int = Field(0, description="x")
    a: Inner = Field(default_factory=Inner, json_schema_extra={})
    c: int = Field(0, description="y", json_schema_extra={"flag": "a-b"})


def test_two_fields_with_one_flag_are_a_programming_error():
    with pytest.raises(ValueError, match="--a-b names both a_b and c"):
        flag_table(Clash)


def test_help_lists_every_flag_with_its_default():
    parser = argparse.ArgumentParser(prog="t")
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for flag in flag_table():
        assert flag in text
    assert "(default: 127.0.0.1)" in text and "{local,ray}" in text
    ns = parser.parse_args(["--seed", "3", "--log-level", "debug"])
    assert overrides_from_namespace(ns) == {"--seed": "3", "--log-level": "debug"}


def test_the_resolved_config_round_trips_as_json(tmp_path: Path):
    cfg = load_config(overrides=["--seed", "9"])
    dump_resolved(cfg, tmp_path / "out" / "config.json")
    data = json.loads((tmp_path / "out" / "config.json").read_text())
    assert data["runtime"]["ray_address"] is None  # nulls kept
    assert RunConfig.model_validate_json((tmp_path / "out" / "config.json").read_text()) == cfg
