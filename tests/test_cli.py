"""The ``asyncrl`` command end to end: help, config errors before start, a full dry run."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.cli.jobs import job_result


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
    )


def help_text(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_shows_the_everyday_options_and_help_all_every_one(capsys):
    everyday = help_text(capsys, "train", "--help")
    assert "--rollout.num-actors INT number of rollout actors; unset: 2, or 1" in everyday
    assert "--dry-run" in everyday and "--runtime {local,ray}" in everyday
    assert "--rollout.engine.sim.decode-base-s" not in everyday  # the simulator's
    every = help_text(capsys, "train", "--help-all")
    assert "--rollout.engine.sim.decode-base-s" in every and "--wire.hwm INT" in every
    assert "--wire.hwm" in help_text(capsys, "chaos", "--help-all")
    # Hidden from --help, a key is still a flag.
    assert main(["train", "--wire.hwm", "0", "--dry-run"]) == 2


def test_a_bad_config_is_refused_before_any_process_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    code = main(
        [
            "train",
            "--output-dir",
            str(tmp_path / "run"),
            "--rollout.num-actors",
            "0",
            "--runtime-hwm",
            "3",
            "--dry-run",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "unknown option --runtime-hwm (did you mean" in err
    assert not (tmp_path / "run").exists()


def test_the_dry_run_starts_every_actor_moves_traffic_and_stops_cleanly(tmp_path: Path):
    config = tmp_path / "job.yaml"
    config.write_text(
        f"name: t\noutput_dir: {tmp_path / 'run'}\nrollout:\n  num_actors: 2\n"
        "runtime:\n  heartbeat_interval: 0.3\n"
    )
    result = run_cli("train", str(config), "--dry-run", cwd=Path.cwd())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dry run ok" in result.stdout
    rows = [line for line in result.stdout.splitlines() if "stopped" in line]
    assert len(rows) == 4  # buffer, rollout-0, rollout-1, trainer: all said goodbye
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text())["rollout"]["num_actors"] == 2
    for actor in ("buffer", "rollout-0", "rollout-1", "trainer"):
        lines = [json.loads(x) for x in (run / "logs" / f"{actor}.jsonl").read_text().splitlines()]
        assert lines[-1]["event"] == "actor exiting" and lines[-1]["ok"] is True
        assert all(line["actor"] == actor for line in lines)
    # A second dry run, with other settings, leaves the folder's config as the first wrote
    # it: a run's resume compares against its own start.
    again = run_cli("train", str(config), "--dry-run", "--rollout.num-actors", "1", cwd=Path.cwd())
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((run / "config.json").read_text())["rollout"]["num_actors"] == 2


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]):
    from asyncrl import __version__

    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == __version__


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["chaos", "--every", "-1"], "argument --every: expected a number of seconds > 0"),
        (["chaos", "--duration", "0"], "argument --duration: expected a number of seconds > 0"),
        (["serve", "--port", "99999"], "argument --port: a TCP port is 0 to 65535, got 99999"),
        (["serve", "--mem-fraction-static", "0"], "static/--mem-fraction: Input should be greater"),
        (["serve", "--max-total-tokens", "0"], "argument --max-total-tokens: Input should be"),
        (["serve", "--dtype", "float8"], "argument --dtype: Input should be 'auto', 'float32'"),
    ],
)
def test_out_of_range_numbers_are_refused_at_their_flag(argv, words, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and words in capsys.readouterr().err


def test_serve_flags_are_the_engine_configs_fields_under_sglangs_names():
    """``asyncrl serve`` builds its engine from an ``EngineConfig``: each engine flag is a
    field, with its default, and parses to what ``rollout.engine`` would hold."""
    from asyncrl.cli import _parser
    from asyncrl.cli.serve import SERVE_ENGINE_FLAGS
    from asyncrl.engines.config import EngineConfig

    parser = _parser([])
    argv = ["serve", "--model", "m", "--mem-fraction-static", "0.5", "--packed-weights",
            "false", "--max-running-requests", "8", "--random-seed", "null",
            "--no-lean-forward", "--constrained-json-disable-any-whitespace",
            "--disable-cuda-graph", "--disable-radix-cache"]  # fmt: skip
    args = parser.parse_args(argv)
    fields = {name: getattr(args, name) for name in SERVE_ENGINE_FLAGS}
    assert fields == {"device": "cpu", "dtype": "auto", "max_running": 8,
                      "max_total_tokens": None, "mem_fraction": 0.5, "packed_weights": False,
                      "lean_forward": False, "json_any_whitespace": False,
                      "cuda_graph": False, "prompt_cache_tokens": 0,
                      "seed": None}  # fmt: skip
    cfg = EngineConfig(type="torch", model_path="m", **fields)
    defaults = parser.parse_args(["serve", "--model", "m"])
    for name in SERVE_ENGINE_FLAGS:
        assert getattr(defaults, name) == EngineConfig.model_fields[name].default, name
    assert cfg.max_running == 8 and not cfg.packed_weights


@pytest.mark.parametrize("nested", [False, True])
def test_a_refused_write_is_rc_1_with_the_reason_and_any_other_error_is_raised(
    nested: bool, capsys: pytest.CaptureFixture[str]
):
    """The controller's TaskGroup wraps what an actor task raised in an ExceptionGroup,
    nested once per TaskGroup: a full disk is said in one line whatever the nesting; a
    group that also holds another error is a bug and keeps its traceback."""

    def wrapped(*errors: Exception) -> BaseException:
        group = ExceptionGroup("actor tasks", list(errors))
        return ExceptionGroup("job", [group]) if nested else group

    async def raising(exc: BaseException) -> None:
        raise exc

    full = OSError(errno.ENOSPC, "No space left on device")
    assert job_result(raising(wrapped(full))) == 1
    assert (
        capsys.readouterr().err
        == "asyncrl: the disk refused a write: [Errno 28] No space left on device\n"
    )
    with pytest.raises(ExceptionGroup) as raised:
        job_result(raising(wrapped(full, KeyError("x"))))
    assert raised.value.split(KeyError)[0] is not None
    with pytest.raises(PermissionError):  # not the disk's refusal: a traceback, as a bug
        job_result(raising(PermissionError(errno.EACCES, "denied")))
