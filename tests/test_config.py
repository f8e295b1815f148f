"""The config tree: precedence, flags, help, and errors that name the key, flag and value."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pydantic
import pytest
from pydantic import Field

from asyncrl.config import (
    EVERYDAY,
    PRESETS,
    ConfigError,
    RunConfig,
    Section,
    add_arguments,
    config_reference,
    debug_cpu,
    dump_resolved,
    flag_table,
    load_config,
    overrides_from_namespace,
)
from asyncrl.wire import security


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def problems(*args: Any, **kwargs: Any) -> list[str]:
    """The lines of the ConfigError that ``load_config(*args, **kwargs)`` raises."""
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value).splitlines()


# Leaves whose value is a mapping (one flag takes the whole mapping as YAML).
MAPPING_LEAVES = {
    ("rollout", "sampling"),
    ("runtime", "ray", "roles"),
    ("data", "chat_template_kwargs"),
}


def leaf_paths(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    paths: set[tuple[str, ...]] = set()
    for key, value in data.items():
        if isinstance(value, dict) and (*prefix, key) not in MAPPING_LEAVES:
            paths |= leaf_paths(value, (*prefix, key))
        else:
            paths.add((*prefix, key))
    return paths


def test_defaults_need_no_file_preset_or_flags():
    cfg = load_config()
    assert cfg == RunConfig()
    assert (cfg.runtime.type, cfg.runtime.ray.address, cfg.rollout.num_actors) == ("local", None, 2)
    assert (cfg.wire.max_frame_bytes, cfg.wire.batch_bytes) == (256 * 1024 * 1024, 256 * 1024)
    assert cfg.resolved_output_dir() == Path("runs/asyncrl")
    assert load_config(overrides=["--name", "x"]).resolved_output_dir() == Path("runs/x")


def test_flags_beat_the_file_which_beats_the_preset(tmp_path: Path):
    path = write(tmp_path, "name: from-file\nseed: 5\nruntime:\n  stop_timeout: 7\n")
    cfg = load_config(path, ["--name", "from-flag", "--seed", "6", "--seed=8"], preset="debug_cpu")
    assert cfg.name == "from-flag"
    assert cfg.seed == 8  # the later of two flags wins
    assert cfg.runtime.stop_timeout == 7.0  # the file over the preset's 5.0
    assert cfg.runtime.heartbeat_interval == 0.5  # the preset over the default 1.0
    assert load_config(path).runtime.heartbeat_interval == 1.0


def test_flag_values_are_read_as_yaml_in_both_forms_and_from_a_mapping():
    cfg = load_config(
        overrides=["--rollout.num-actors=4", "--wire.redeliver-after", "0.25", "--name=a=b"]
    )
    assert (cfg.rollout.num_actors, cfg.wire.redeliver_after, cfg.name) == (4, 0.25, "a=b")
    cfg = load_config(overrides={"--seed": "7", "--runtime": "ray", "--ray-address": "auto"})
    assert (cfg.seed, cfg.runtime.type, cfg.runtime.ray.address) == (7, "ray", "auto")


def test_string_leaves_keep_their_text_and_optional_ones_accept_null():
    cfg = load_config(overrides=["--name", "007", "--output-dir", "2024", "--ray-address", "x"])
    assert (cfg.name, cfg.output_dir) == ("007", "2024")
    assert (
        load_config(overrides=["--ray-address", "x", "--ray-address", "null"]).runtime.ray.address
        is None
    )


def test_an_unknown_nested_key_names_file_and_line_and_suggests_the_right_one(tmp_path: Path):
    path = write(tmp_path, "seed: 1\nrollout:\n  num_actor: 3\nheartbeat_interval: 2\n")
    assert problems(path) == [
        f"{path}:3: unknown key 'rollout.num_actor' (did you mean 'rollout.num_actors'?)",
        f"{path}:4: unknown key 'heartbeat_interval' (did you mean 'runtime.heartbeat_interval'?)",
    ]


def test_an_unknown_flag_suggests_the_closest_one():
    assert problems(overrides=["--rollout-num-actor", "3"]) == [
        "unknown option --rollout-num-actor (did you mean --rollout.num-actors?)"
    ]
    assert problems(overrides={"--sed": "1"}) == ["unknown option --sed (did you mean --seed?)"]


def test_bad_values_name_key_flag_expectation_and_value():
    assert problems(overrides=["--rollout.num-actors", "-1"]) == [
        "rollout.num_actors: Input should be greater than or equal to 1, got -1"
    ]
    [line] = problems(overrides=["--wire.hwm", "many"])
    assert line.startswith("wire.hwm: Input should be a valid integer")
    assert line.endswith('got "many"')
    assert problems(overrides=["--runtime", "k8s"]) == [
        "runtime.type (--runtime): Input should be 'local' or 'ray', got \"k8s\""
    ]


def test_a_bad_value_from_the_file_names_the_file_and_line_unless_a_flag_replaced_it(
    tmp_path: Path,
):
    path = write(tmp_path, "wire:\n  window: 8\n  hwm: 0\n")
    assert problems(path) == [
        f"{path}:3: wire.hwm: Input should be greater than or equal to 1, got 0"
    ]
    assert problems(path, ["--wire.hwm", "-5"]) == [
        "wire.hwm: Input should be greater than or equal to 1, got -5"
    ]
    assert load_config(path, ["--wire.hwm", "5"]).wire.hwm == 5


def test_a_boolean_or_a_non_finite_number_where_a_number_goes_is_refused(tmp_path: Path):
    """pydantic takes true as 1 and "inf" as infinity: num_steps: true trained one step,
    lr: yes trained at 1.0, and --lr inf reached the trainer."""
    path = write(tmp_path, "trainer:\n  model_path: m\n  lr: yes\ntrain:\n  num_steps: true\n")
    why = "expected a number, not a boolean (YAML reads true, false, yes, no, on and off as "
    assert problems(path) == [
        f"{path}:3: trainer.lr (--lr): {why}booleans), got true",
        f"{path}:5: train.num_steps: {why}booleans), got true",
    ]
    for text in ("inf", "-inf", "nan", "1e400"):
        [line] = problems(overrides=["--lr", text, "--hf-checkpoint", "m"])
        assert line.startswith("trainer.lr (--lr): expected a finite number, got"), line
    fine = ["--lr", "2e-5", "--train.num-steps", "3", "--hf-checkpoint", "m"]
    assert load_config(overrides=fine).train.num_steps == 3


def test_the_heartbeat_timeout_must_exceed_the_interval():
    assert problems(
        overrides=["--runtime.heartbeat-interval", "2", "--runtime.heartbeat-timeout", "2"]
    ) == [
        "runtime: heartbeat_timeout (2.0) must be greater than heartbeat_interval (2.0), "
        "or a healthy actor would count as hung between two heartbeats"
    ]
    cfg = load_config(overrides=["--runtime.heartbeat-interval", "2"])
    with pytest.raises(pydantic.ValidationError, match="must be greater than"):
        cfg.runtime.heartbeat_timeout = 1.0  # assignments are validated too


def test_the_startup_timeout_is_a_positive_number_of_seconds():
    assert (
        load_config(overrides=["--runtime.startup-timeout", "1800"]).runtime.startup_timeout == 1800
    )
    [line] = problems(overrides=["--runtime.startup-timeout", "0"])
    assert line == "runtime.startup_timeout: Input should be greater than 0, got 0", line


def test_frames_must_fit_the_batch_and_the_chunk():
    [line] = problems(overrides=["--wire.chunk-bytes", str(512 * 1024 * 1024)])
    assert line.startswith("wire: chunk_bytes (536870912) must not exceed max_frame_bytes")


def test_every_problem_is_reported_in_one_error(tmp_path: Path):
    path = write(tmp_path, "rollout:\n  num_actorz: 3\n")
    lines = problems(
        path, ["--sedd", "1", "--log-level", "loud", "--wire.window", "0", "stray", "--seed"]
    )
    assert len(lines) == 6, lines
    assert lines[:3] == [
        "unknown option --sedd (did you mean --seed?)",
        "expected an option like --flag VALUE, got 'stray'",
        "option --seed needs a value: --seed INT",
    ]
    assert lines[3].startswith("wire.window: Input should be greater than")
    assert lines[4].startswith("log.level (--log-level): Input should be 'debug', 'info'")
    assert lines[5].startswith(f"{path}:2: unknown key 'rollout.num_actorz'")


def test_a_flag_followed_by_another_flag_has_no_value():
    assert problems(overrides=["--seed", "--name", "x"]) == [
        "option --seed needs a value: --seed INT"
    ]


def test_broken_yaml_names_file_line_and_column(tmp_path: Path):
    path = write(tmp_path, "name: ok\nruntime:\n  host: [unclosed\n")
    [line] = problems(path)
    assert line.startswith(f"{path}:4:1: invalid YAML: expected ',' or ']'")
    assert "flow sequence that starts at line 3" in line


def test_a_top_level_that_is_not_a_mapping_names_file_and_line(tmp_path: Path):
    path = write(tmp_path, "# a list by mistake\n- seed: 1\n")
    assert problems(path) == [
        f"{path}:2: the top level must be a mapping (key: value lines), got a list"
    ]


def test_an_empty_file_means_all_defaults(tmp_path: Path):
    assert load_config(write(tmp_path, "# nothing set\n")) == RunConfig()


def test_a_missing_file_or_preset_is_refused(tmp_path: Path):
    assert problems(tmp_path / "x.yaml") == [f"config file '{tmp_path / 'x.yaml'}' does not exist"]
    assert problems(preset="debug_gpu") == [
        "unknown preset 'debug_gpu' (did you mean 'debug_cpu'?) (known: debug_cpu)"
    ]


def test_every_preset_builds_a_valid_config():
    for name, build in PRESETS.items():
        assert load_config(preset=name) == build(), name
    cfg = debug_cpu()
    assert (cfg.rollout.num_actors, cfg.runtime.heartbeat_interval) == (2, 0.5)


def test_every_leaf_has_exactly_one_flag_and_a_description():
    table = flag_table()
    common = {"data": {"path": "prompts.jsonl", "apply_chat_template": True},
              "trainer": {"model_path": "m"}, "eval": {"engine": {"model_path": "m"}}}  # fmt: skip
    # The optional sections too; tool use and an agent exclude each other.
    tools = {"engine": {"model_path": "m"}, "tool_use": {"tools": [{"type": "calculator"}]},
             "reward": {"model": {"path": "rm"}}}  # fmt: skip
    agent = {"engine": {"model_path": "m"}, "agent": {"path": "m:f"},
             "reward": {"judge": {"url": "http://j/v1", "model": "j"}}}  # fmt: skip
    both = leaf_paths(RunConfig(**common, rollout=tools).model_dump()) | leaf_paths(
        RunConfig(**common, rollout=agent).model_dump()
    )
    # A section left null in one config is a "leaf" there; its fields are the leaves.
    leaves = {p for p in both if not any(q[: len(p)] == p and q != p for q in both)}
    assert {spec.path for spec in table.values()} == leaves
    assert len({spec.flag for spec in table.values()}) == len(leaves)  # one key flag each
    assert [flag for flag, spec in table.items() if not spec.description] == []
    assert table["--runtime"].path == ("runtime", "type")
    assert table["--ray-address"].path == ("runtime", "ray", "address")
    assert table["--log-level"].path == ("log", "level")
    assert table["--rollout.num-actors"].path == ("rollout", "num_actors")
    # slime's names for the buffer and data leaves, as aliases
    assert table["--rollout-batch-size"].path == ("buffer", "groups_per_step")
    assert table["--n-samples-per-prompt"].path == ("buffer", "num_samples_per_prompt")
    assert table["--prompt-data"].path == ("data", "path")
    assert table["--num-rollout"].path == ("data", "num_rollouts")


def test_the_optional_data_section_is_created_by_its_flags_and_checked():
    cfg = load_config(None, ["--prompt-data", "d.jsonl@[0:5]", "--apply-chat-template", "true"])
    assert cfg.data is not None and cfg.data.path == "d.jsonl@[0:5]"
    assert cfg.data.apply_chat_template and load_config(None, []).data is None
    with pytest.raises(ConfigError, match=r"data\.path \(--prompt-data\): Field required"):
        load_config(None, ["--input-key", "question"])


def test_buffer_settings_are_checked_together_before_anything_starts():
    with pytest.raises(ConfigError, match="hard_staleness \\(1\\) must be >= max_staleness"):
        load_config(None, ["--buffer.max-staleness", "2", "--buffer.hard-staleness", "1"])
    with pytest.raises(ConfigError, match="--rollout-batch-size"):
        load_config(None, ["--rollout-batch-size", "0"])


class Inner(Section):
    deep_value: int = Field(1, description="three levels down")
    sizes: list[int] = Field(default_factory=lambda: [1], description="a list leaf")
    label: str = Field("x", description="aliased", json_schema_extra={"aliases": ["tag"]})


class Middle(Section):
    inner: Inner = Field(default_factory=Inner, description="the inner section")


class Outer(Section):
    middle: Middle = Field(default_factory=Middle, description="the middle section")


def test_flags_follow_the_rule_at_any_depth_and_aliases_work():
    table = flag_table(Outer)
    assert set(table) == {
        "--middle.inner.deep-value",
        "--middle.inner.sizes",
        "--middle.inner.label",
        "--tag",
    }
    assert table["--tag"] is table["--middle.inner.label"]
    cfg = load_config(
        overrides=["--middle.inner.deep_value", "5", "--middle.inner.sizes", "[2, 3]", "--tag=y"],
        model=Outer,
    )
    assert (cfg.middle.inner.deep_value, cfg.middle.inner.sizes, cfg.middle.inner.label) == (
        5,
        [2, 3],
        "y",
    )


class Clash(Section):
    a_b: int = Field(0, description="x")
    c: int = Field(0, description="y", json_schema_extra={"flag": "a-b"})


class AliasClash(Section):
    a: int = Field(0, description="x")
    b: int = Field(0, description="y", json_schema_extra={"aliases": ["a"]})


def test_two_fields_with_one_flag_are_a_programming_error():
    with pytest.raises(ValueError, match="--a-b names both a_b and c"):
        flag_table(Clash)
    with pytest.raises(ValueError, match="--a names both a and b"):
        flag_table(AliasClash)


def test_help_lists_every_flag_with_its_type_and_default():
    parser = argparse.ArgumentParser(prog="t")
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert set(flag_table()) <= set(re.findall(r"--[a-z][a-z0-9.-]*", text))
    actors = r"--rollout.num-actors INT number of rollout actors; .*? \(default: 2\) --rollout\."
    assert re.search(actors, text)
    assert "--runtime {local,ray}" in text and "--runtime.host STR" in text
    assert "(default: 127.0.0.1)" in text and "(default: null)" in text
    assert "(default: 268435456)" in text


def test_the_parsed_namespace_feeds_load_config():
    parser = argparse.ArgumentParser(prog="t")
    parser.add_argument("--dry-run", action="store_true")
    add_arguments(parser)
    ns = parser.parse_args(["--seed", "3", "--dry-run", "--log-level", "debug", "--seed", "4"])
    assert overrides_from_namespace(ns) == {"--seed": "4", "--log.level": "debug"}
    cfg = load_config(overrides=overrides_from_namespace(ns))
    assert (cfg.seed, cfg.log.level) == (4, "debug")


def test_a_bool_flag_alone_means_true_as_in_slime():
    assert load_config(overrides=["--use-kl-loss", "--kl-loss-coef", "0.1"]).algo.use_kl_loss
    off = load_config(overrides=["--debug-rollout-only", "false"])
    assert off.train.debug_rollout_only is False
    parser = argparse.ArgumentParser(prog="t")
    add_arguments(parser)
    ns = parser.parse_args(["--debug-rollout-only", "--seed", "2"])
    assert load_config(overrides=overrides_from_namespace(ns)).train.debug_rollout_only
    assert problems(overrides=["--seed", "--debug-rollout-only"])[0].startswith(
        "option --seed needs a value"
    )  # only a bool flag stands alone


def test_an_alias_reaches_the_same_field_through_argparse():
    parser = argparse.ArgumentParser(prog="t")
    add_arguments(parser, Outer)
    ns = parser.parse_args(["--middle.inner.label", "a", "--tag", "b"])
    assert (
        load_config(overrides=overrides_from_namespace(ns), model=Outer).middle.inner.label == "b"
    )


def test_the_resolved_config_round_trips_as_json(tmp_path: Path):
    cfg = load_config(overrides=["--seed", "9", "--runtime", "ray"], preset="debug_cpu")
    out = tmp_path / "run" / "config.json"
    dump_resolved(cfg, out)
    assert json.loads(out.read_text())["runtime"]["ray"]["address"] is None  # nulls kept
    assert RunConfig.model_validate_json(out.read_text()) == cfg


def test_a_host_beyond_loopback_is_refused_unless_channels_are_encrypted(tmp_path):
    with pytest.raises(ConfigError, match=r"'10\.0\.0\.1' is not loopback.*asyncrl keys"):
        load_config(overrides=["--runtime.host", "10.0.0.1"])
    assert load_config(overrides=["--runtime.host", "localhost"]).runtime.host == "localhost"
    security.generate(tmp_path / "keys")
    keys = ["--wire.curve-keys", str(tmp_path / "keys")]
    cfg = load_config(overrides=["--runtime.host", "10.0.0.1", *keys])
    assert cfg.runtime.host == "10.0.0.1" and cfg.wire.curve_keys == str(tmp_path / "keys")
    # The dist group's store and gloo take no key, whatever the channels do: the user says
    # the network is trusted, or the job does not start.
    dist = ["--runtime.host", "10.0.0.1", *keys, "--update-weight-transport", "dist"]
    with pytest.raises(ConfigError, match=r"listen on 10\.0\.0\.1 .* --train\.dist-trusted"):
        load_config(overrides=dist)
    assert load_config(overrides=[*dist, "--train.dist-trusted-network", "true"]).train.publish
    with pytest.raises(ConfigError, match="asyncrl keys"):  # no certificate there
        load_config(overrides=["--wire.curve-keys", str(tmp_path)])
    (tmp_path / "keys" / "job.key_secret").chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        load_config(overrides=keys)


def test_a_torch_engine_section_serves_the_trained_model_unless_told_otherwise():
    # One engine flag makes an engine section; its model is still --hf-checkpoint's.
    cfg = load_config(overrides=["--hf-checkpoint", "m", "--rollout.engine.in-process", "false"])
    assert cfg.rollout.engine is not None and cfg.rollout.engine.model_path == "m"
    assert cfg.rollout.engine.in_process is False
    own = ["--hf-checkpoint", "m", "--rollout.engine.model-path", "other"]
    assert load_config(overrides=own).rollout.engine.model_path == "other"
    evals = ["--hf-checkpoint", "m", "--eval.engine.max-running", "4"]
    assert load_config(overrides=evals).eval.engine.model_path == "m"
    launched = ["--hf-checkpoint", "m", "--rollout.engine.type", "sglang",
                "--rollout.engine.serve", "actor", "--update-weight-transport", "disk"]  # fmt: skip
    assert load_config(overrides=launched).rollout.engine.model_path == "m"
    sim = ["--hf-checkpoint", "m", "--rollout.engine.type", "sim"]
    assert load_config(overrides=sim).rollout.engine.model_path is None  # sim: vocab only
    with pytest.raises(ConfigError, match="needs model_path"):
        load_config(overrides=["--rollout.engine.in-process", "false"])


def test_flag_values_that_are_json_are_read_as_json_before_yaml():
    # YAML 1.1 reads 1e-300 (no dot) as a string, inside a mapping as well.
    model = ["--hf-checkpoint", "m"]
    cfg = load_config(
        overrides=[*model, "--rollout.sampling", '{"temperature": 1e-300, "top_p": 1}']
    )
    assert cfg.rollout.sampling == {"temperature": 1e-300, "top_p": 1}
    cfg = load_config(
        overrides=[*model, "--lr", "3e-6", "--buffer.filters", "[zero_reward_variance]"]
    )
    assert cfg.trainer.lr == 3e-6 and cfg.buffer.filters == ["zero_reward_variance"]


def test_every_key_is_its_own_flag_and_slimes_names_are_aliases():
    """One vocabulary: the YAML key ``a.b_c`` is the flag ``--a.b-c`` (``--a.b_c`` too)."""
    for flag, spec in flag_table().items():
        assert spec.flag == "--" + ".".join(part.replace("_", "-") for part in spec.path)
        assert flag == spec.flag or flag in spec.aliases
    cfg = load_config(overrides=["--buffer.groups_per_step", "3", "--rollout.num-actors=4"])
    assert (cfg.buffer.groups_per_step, cfg.rollout.num_actors) == (3, 4)
    assert load_config(overrides=["--rollout-batch-size", "5"]).buffer.groups_per_step == 5


def test_a_flag_name_written_as_a_yaml_key_names_the_key(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout_batch_size: 4\n")
    assert problems(path) == [
        f"{path}:1: unknown key 'rollout_batch_size' (--rollout-batch-size is a flag; its key "
        "is 'buffer.groups_per_step')"
    ]


def test_the_everyday_keys_exist_and_the_reference_page_is_current():
    paths = {spec.path for spec in flag_table().values()}
    assert set(EVERYDAY) <= paths, set(EVERYDAY) - paths
    page = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    assert page.read_text() == config_reference(), "docs/config.md is stale: make config-doc"


def test_every_engine_samples_from_the_jobs_seed_mixed_with_its_actor_name(tmp_path: Path):
    from asyncrl.role_configs import role_params
    from asyncrl.rollout.engines import engine_seed

    flags = ["--seed", "3", "--trainer.model-path", "m", "--data.path", "d.jsonl"]
    eval_on = ["--eval.interval", "1", "--eval.sets", '[{"name": "t", "path": "t.jsonl"}]']
    params = role_params(load_config(overrides=flags + eval_on), tmp_path, resume=False)
    assert params["rollout"].engine.seed == params["eval"].engine.seed == 3  # type: ignore[attr-defined]
    assert params["eval"].baseline_from_engine  # type: ignore[attr-defined]
    other = [*eval_on, "--eval.engine.model-path", "other"]
    params = role_params(load_config(overrides=flags + other), tmp_path, resume=False)
    assert not params["eval"].baseline_from_engine  # type: ignore[attr-defined]
    own = load_config(overrides=[*flags, "--rollout.engine.seed", "9"])
    assert role_params(own, tmp_path, resume=False)["rollout"].engine.seed == 9  # type: ignore[attr-defined]
    assert engine_seed(3, "rollout-0", False) != engine_seed(3, "rollout-1", False)
    assert engine_seed(3, "rollout-0", True) is None  # a restart does not replay its draws


def test_a_resumed_job_samples_from_a_stream_of_its_own(tmp_path: Path):
    """--resume mixes the step it continues from into the engines' seed: the first run's
    draws are not replayed on the prompts after it; the same resume point replays."""
    from asyncrl.role_configs import role_params

    flags = ["--seed", "3", "--trainer.model-path", "m", "--data.path", "d.jsonl"]

    def seeds(resume: bool, step: int | None) -> tuple[int, int]:
        if step is not None:
            (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": step}) + "\n")
        params = role_params(load_config(overrides=flags), tmp_path, resume=resume)
        return params["rollout"].engine.seed, params["engine"].engine.seed  # type: ignore[attr-defined]

    fresh = seeds(False, None)
    assert fresh == (3, 3)
    after_5 = seeds(True, 5)
    assert after_5[0] == after_5[1] and after_5[0] not in (3, seeds(True, 6)[0])
    assert seeds(True, 5) == after_5
    assert seeds(False, 5) == fresh  # a fresh job in a used directory: --overwrite
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "lo')  # a kill mid-write: the last whole row counts
    params = role_params(load_config(overrides=flags), tmp_path, resume=True)
    assert params["rollout"].engine.seed == after_5[0]  # type: ignore[attr-defined]


def test_the_job_seed_seeds_the_prompt_order_and_the_trainer_unless_they_name_their_own(
    tmp_path: Path,
):
    base = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--seed", "3"]
    cfg = load_config(overrides=base)
    assert (cfg.seed, cfg.data.seed, cfg.trainer.seed) == (3, 3, 3)
    own = load_config(overrides=[*base, "--rollout-seed", "7", "--trainer.seed", "5"])
    assert (own.seed, own.data.seed, own.trainer.seed) == (3, 7, 5)
    # A file's own data.seed holds against the job's seed.
    path = tmp_path / "c.yaml"
    path.write_text("seed: 4\ndata: {path: p.jsonl, seed: 1}\ntrainer: {model_path: m}\n")
    cfg = load_config(path)
    assert (cfg.data.seed, cfg.trainer.seed) == (1, 4)


def test_a_resumed_run_says_which_resolved_settings_changed(tmp_path):
    import structlog

    from asyncrl.api import _say_what_changed
    from asyncrl.config import config_changes, dump_resolved

    path = tmp_path / "config.json"
    before = load_config(overrides=["--name", "a"])
    dump_resolved(before, path)
    same = json.loads(path.read_text())
    assert config_changes(same, before) == []
    after = load_config(overrides=["--name", "a", "--rollout.num-actors", "3", "--seed", "7"])
    changes = config_changes(same, after)
    assert changes == ["seed: 0 -> 7", "rollout.num_actors: 2 -> 3"]
    with structlog.testing.capture_logs() as logs:
        _say_what_changed(after, path)
        _say_what_changed(before, path)  # unchanged: nothing said
        _say_what_changed(after, tmp_path / "missing.json")  # a new run: nothing to compare
        (tmp_path / "torn.json").write_text('{"name": ')
        _say_what_changed(after, tmp_path / "torn.json")
    assert [e["event"] for e in logs] == [
        "resumed with a changed config",
        "the run's earlier config is unreadable: not compared",
    ]
    assert logs[0]["changes"] == changes


def test_a_resume_that_changes_settings_keeps_the_last_starts_config(tmp_path):
    from asyncrl.api import record_config

    first = load_config(overrides=["--name", "a"])
    record_config(first, tmp_path, resume=False)
    record_config(first, tmp_path, resume=True)  # unchanged: nothing kept aside
    assert not (tmp_path / "config.previous.json").exists()
    second = load_config(overrides=["--name", "a", "--seed", "7"])
    record_config(second, tmp_path, resume=True)
    assert json.loads((tmp_path / "config.previous.json").read_text())["seed"] == 0
    assert json.loads((tmp_path / "config.json").read_text())["seed"] == 7
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_changes_hide_credentials_and_say_which_side_lacks_a_key():
    from asyncrl.config import config_changes

    cfg = load_config(overrides=["--name", "a"])
    before = json.loads(cfg.model_dump_json())
    before["name"] = "b"
    before["rollout"]["max_tokens_per_microbatch_old"] = 3  # a key from an older version
    before["runtime"]["api_token"] = "s3cret"
    before["wire"]["endpoint"] = "http://user:pw@host:1"
    changes = config_changes(before, cfg)
    assert 'name: "b" -> "a"' in changes
    assert "rollout.max_tokens_per_microbatch_old: 3 -> (absent)" in changes
    assert "runtime.api_token: (hidden) -> (absent)" in changes
    assert 'wire.endpoint: "http://***@host:1" -> (absent)' in changes
    assert not any("s3cret" in c or "pw" in c for c in changes)


def test_checkpoints_are_written_in_the_background_by_default_only_beside_a_gpu(tmp_path: Path):
    # On a CPU the writer thread takes the cores the trainer computes on (measured: 1.00x
    # samples/s on 2 cores, each step's compute slower by what the write took).
    from asyncrl.role_configs import role_params

    flags = ["--trainer.model-path", "m", "--data.path", "d.jsonl"]

    def background(*more: str) -> bool:
        params = role_params(load_config(overrides=[*flags, *more]), tmp_path, resume=False)
        return params["trainer"].async_save  # type: ignore[attr-defined]

    assert not background() and background("--trainer.device", "cuda")
    assert background("--async-save", "true")
    assert not background("--trainer.device", "cuda", "--async-save", "false")
