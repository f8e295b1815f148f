"""Everything checkable is checked before launch (asyncrl/preflight.py): each class of
input error is refused by ``asyncrl train`` (and by ``--dry-run``, and by the controller's
``run_job``) with the file, line or key at fault, before any actor or run folder exists."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from asyncrl import preflight as preflight_module
from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.job import run_job
from asyncrl.preflight import preflight

ROWS = [{"prompt": f"{a}+{a}=", "label": str(2 * a)} for a in range(6)]


def write_rows(path: Path, rows: list[dict], extra: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)
    return path


@pytest.fixture
def job(tmp_path: Path, tiny_dir: Path):
    """``(flags, run_dir)`` of a job that passes preflight; tests break one thing each."""
    data = write_rows(tmp_path / "train.jsonl", ROWS)
    run = tmp_path / "run"
    flags = ["--hf-checkpoint", str(tiny_dir), "--prompt-data", str(data),
             "--output-dir", str(run), "--rollout-batch-size", "2",
             "--n-samples-per-prompt", "2", "--train.num-steps", "1"]  # fmt: skip
    return flags, run


def refused(capsys, flags: list[str], run: Path, *expected: str, dry_run: bool = False) -> None:
    code = main(["train", *flags, *(["--dry-run"] if dry_run else [])])
    err = capsys.readouterr().err
    assert code == 2, err
    for text in expected:
        assert text in err, err
    assert not run.exists()  # nothing started: not even the run folder


def log_here() -> None:
    """Send this process's log lines to this test's captured stderr: the handler holds the
    stream it was configured with, which an earlier test in the session may have left."""
    from asyncrl.observe.logs import configure_logging

    configure_logging()


def test_a_job_that_is_fine_passes(job):
    flags, _ = job
    preflight(load_config(None, overrides=flags))


def test_a_missing_or_malformed_data_file_is_named_with_its_line(job, tmp_path, capsys):
    flags, run = job
    refused(capsys, [*flags, "--prompt-data", str(tmp_path / "nope.jsonl")], run,
            "data:", "nope.jsonl: no such file")  # fmt: skip
    bad = write_rows(tmp_path / "bad.jsonl", ROWS[:2], extra='{"prompt": "1+1=", "label": \n')
    refused(capsys, [*flags, "--prompt-data", str(bad)], run, "bad.jsonl:3: invalid JSON")


def test_an_eval_set_is_checked_like_the_data(job, tmp_path, capsys):
    flags, run = job
    bad = write_rows(tmp_path / "test.jsonl", [{"question": "1+1="}])
    sets = json.dumps([{"name": "test", "path": str(bad)}])
    refused(capsys, [*flags, "--eval-interval", "1", "--eval.sets", sets], run,
            "eval set 'test':", "test.jsonl:1: missing key 'prompt'")  # fmt: skip


def test_a_model_folder_without_a_config_is_refused(job, tmp_path, capsys):
    flags, run = job
    empty = tmp_path / "empty_model"
    empty.mkdir()
    refused(capsys, [*flags, "--hf-checkpoint", str(empty)], run,
            "trainer.model_path (--hf-checkpoint):", "is not a Hugging Face model")  # fmt: skip


def test_compiling_without_a_toolchain_is_refused(job, capsys, monkeypatch):
    flags, run = job
    compiled = [*flags, "--trainer.compile", "true"]
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr(preflight_module.shutil, "which", lambda name: f"/usr/bin/{name}")
    preflight(load_config(None, overrides=compiled))
    monkeypatch.setattr(preflight_module.shutil, "which", lambda name: None)
    refused(capsys, compiled, run, "trainer.compile (--trainer.compile) on the CPU needs a C++")
    preflight(load_config(None, overrides=flags))  # not compiling: nothing to build


@pytest.mark.parametrize("agent", [
    ["--rollout.tool-use.tools", '[{"type": "calculator"}]', "--apply-chat-template", "true"],
    ["--rollout.agent.path", "tests.test_train:two_call_agent"],
])  # fmt: skip
def test_a_missing_model_folder_of_an_agent_job_is_named_not_looked_up_online(
    job, tmp_path, capsys, agent
):
    # The tool and agent checks load the tokenizer: a path that is not a folder must not
    # reach transformers, which takes it for a hub id (a minute of retries offline).
    flags, run = job
    missing = str(tmp_path / "models" / "nope")
    code = main(["train", *flags, *agent, "--hf-checkpoint", missing])
    err = capsys.readouterr().err
    assert code == 2 and f"{missing} is not a Hugging Face model folder" in err, err
    problems = err.strip().splitlines()[1:]  # under "asyncrl train: config error:"
    assert all("is not a Hugging Face model folder" in line for line in problems), err
    assert not run.exists()


def test_a_model_whose_tokenizer_does_not_load_is_refused(job, tmp_path, tiny_dir, capsys):
    flags, run = job
    model = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_dir, model, ignore=shutil.ignore_patterns("tokenizer*", "*.jinja"))
    refused(capsys, [*flags, "--hf-checkpoint", str(model)], run, "no tokenizer files")


def test_a_chat_template_asked_for_but_missing_is_refused(job, tmp_path, tiny_dir, capsys):
    flags, run = job
    model = tmp_path / "no_template"
    shutil.copytree(tiny_dir, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    refused(capsys, [*flags, "--hf-checkpoint", str(model), "--apply-chat-template"], run,
            "data: apply_chat_template is set but", "has no chat template")  # fmt: skip


def test_eval_sets_inherit_the_datas_chat_template_unless_they_say(job, tmp_path):
    flags, _ = job
    sets = [{"name": "a", "path": "x.jsonl"},
            {"name": "b", "path": "x.jsonl", "apply_chat_template": False}]  # fmt: skip
    extra = ["--eval-interval", "1", "--eval.sets", json.dumps(sets)]
    cfg = load_config(None, overrides=[*flags, *extra, "--apply-chat-template"])
    assert [s.apply_chat_template for s in cfg.eval.sets] == [True, False]
    cfg = load_config(None, overrides=[*flags, *extra])
    assert [s.apply_chat_template for s in cfg.eval.sets] == [False, False]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--custom-rm-path", "no_such_module:fn"],
         "reward path 'no_such_module:fn': cannot import 'no_such_module'"),
        (["--custom-generate-function-path", "json:nothing_here"],
         "workflow path 'json:nothing_here': 'json' has no 'nothing_here'"),
        (["--buffer.filters", '["no_such_module.my_filter"]'],
         "filter path 'no_such_module.my_filter': cannot import"),
    ],
)  # fmt: skip
def test_user_code_named_by_path_must_load(job, capsys, extra, expected):
    flags, run = job
    refused(capsys, [*flags, *extra], run, expected)


def test_a_custom_reward_path_selects_the_custom_reward_or_contradicts_a_type(job, capsys):
    flags, run = job
    cfg = load_config(None, overrides=[*flags, "--custom-rm-path", "json:dumps"])
    assert cfg.rollout.reward.type == "custom"
    refused(capsys, [*flags, "--custom-rm-path", "json:dumps", "--rm-type", "math"], run,
            "--custom-rm-path json:dumps) is set but the reward type is 'math'")  # fmt: skip


def test_a_prompt_that_fills_the_context_is_refused(job, tmp_path, capsys):
    flags, run = job
    long = write_rows(tmp_path / "long.jsonl", [*ROWS, {"prompt": "1+" * 300, "label": "x"}])
    refused(capsys, [*flags, "--prompt-data", str(long)], run,
            "data: 1 prompt(s) fill the model's context of 512 tokens",
            "long.jsonl:7 has")  # fmt: skip


def test_a_prompt_leaving_less_than_max_new_tokens_is_only_warned_about(job, tmp_path, capsys):
    from asyncrl.preflight import preflight

    flags, _ = job
    log_here()
    rows = [*ROWS, {"prompt": "1+" * 220, "label": "x"}]
    sampling = json.dumps({"temperature": 1.0, "max_new_tokens": 200})
    data = write_rows(tmp_path / "near.jsonl", rows)
    preflight(load_config(None, overrides=[*flags, "--prompt-data", str(data),
                                           "--rollout.sampling", sampling]))  # fmt: skip
    out = capsys.readouterr()
    assert "leave less than max_new_tokens 200" in out.out + out.err


def test_the_dry_run_and_the_controller_check_too(job, tmp_path, capsys):
    flags, run = job
    missing = [*flags, "--prompt-data", str(tmp_path / "nope.jsonl")]
    refused(capsys, missing, run, "nope.jsonl: no such file", dry_run=True)
    result = asyncio_run(run_job(load_config(None, overrides=missing)))
    assert not result.ok and "nope.jsonl: no such file" in result.error
    assert result.codes == {} and not run.exists()


def test_training_sampling_the_trainer_cannot_reproduce_is_refused(job, capsys):
    flags, run = job
    sampling = json.dumps({"temperature": 0.8, "repetition_penalty": 1.1})
    refused(capsys, [*flags, "--rollout.sampling", sampling], run,
            "rollout.sampling sets repetition_penalty", "cannot reproduce penalties")  # fmt: skip


def test_data_too_short_for_the_steps_is_warned_about(job, capsys):
    from asyncrl.preflight import preflight

    flags, _ = job
    log_here()
    preflight(load_config(None, overrides=[*flags, "--rollout-batch-size", str(10**12)]))
    out = capsys.readouterr()
    assert f"need {10**12} prompts, but the data holds {len(ROWS)}" in out.out + out.err


def test_grpo_with_one_sample_per_prompt_is_refused(job, capsys):
    flags, run = job
    refused(capsys, [*flags, "--n-samples-per-prompt", "1"], run,
            "grpo's advantages compare the samples", "--n-samples-per-prompt 2")  # fmt: skip


def asyncio_run(coro):
    import asyncio

    return asyncio.run(coro)


def test_rows_the_reward_can_never_score_are_refused(job, tmp_path, capsys):
    """Half the rows without a label, an unknown per-row rm_type, an empty prompt: each
    used to be found sample by sample at runtime, while the job trained on the rest."""
    flags, run = job
    rows = [r if i % 2 else {"prompt": r["prompt"]} for i, r in enumerate(ROWS)]
    rows[1] = {**rows[1], "metadata": {"rm_type": "maths"}}
    data = write_rows(tmp_path / "half.jsonl", rows)
    refused(capsys, [*flags, "--prompt-data", str(data)], run,
            "data: 3 of 6 rows cannot be scored: no label, which the",
            f"(first: {data}:1, {data}:3)",
            "data: 1 of 6 rows cannot be scored: rm_type 'maths' is not a built-in")  # fmt: skip
    custom = ["--custom-rm-path", "tests.test_train:reward_out_of_range"]
    # A custom reward needs no label, and a row's rm_type picks among built-ins only.
    preflight(load_config(None, overrides=[*flags, "--prompt-data", str(data), *custom]))
    empty = write_rows(tmp_path / "empty.jsonl", [*ROWS[:2], {"prompt": "  ", "label": "0"}])
    refused(capsys, [*flags, "--prompt-data", str(empty)], run,
            "empty.jsonl:3: 'prompt' is an empty prompt")  # fmt: skip


def test_an_engine_model_of_another_shape_than_the_trainers_is_refused(
    job, tmp_path, tiny_dir, capsys
):
    flags, run = job
    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (other / "config.json").write_text(json.dumps(config))
    refused(capsys, [*flags, "--rollout.engine.model-path", str(other)], run,
            f"rollout.engine.model_path: {other} is not the trainer's model",
            "num_hidden_layers")  # fmt: skip
    same = tmp_path / "same"
    shutil.copytree(tiny_dir, same)  # another folder of the same shape: fine
    preflight(load_config(None, overrides=[*flags, "--rollout.engine.model-path", str(same)]))
