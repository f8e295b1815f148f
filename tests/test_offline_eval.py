"""``asyncrl eval`` (``asyncrl/offline_eval.py``): a model folder scored on eval sets by the
eval actor's code, through the real command, its embedded engine and a real tiny model;
and its refusals of bad input before anything starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.offline_eval import engine_config, resolve_model
from asyncrl.role_configs import role_params
from asyncrl.rollout.config import EvalSetConfig
from asyncrl.rollout.evaluation import score_samples
from asyncrl.rollout.rewards import RewardError
from asyncrl.types import Sample
from tests.tiny_model import build_tiny_model


def broken_reward(sample: Sample) -> float:
    raise RewardError("the grader is down")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("offline_eval")
    build_tiny_model(root / "model")
    rows = [{"prompt": f"{i}+{i}=", "label": str(2 * i), "metadata": {"kind": i % 2}}
            for i in range(6)]  # fmt: skip
    (root / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def sets(root: Path, **extra: object) -> str:
    held = {"name": "held", "path": str(root / "held.jsonl"), "n_samples": 3, "pass_k": [1, 3],
            "group_by": "kind", "sampling": {"temperature": 1.0, "max_new_tokens": 4}}  # fmt: skip
    greedy = {"name": "greedy", "path": str(root / "held.jsonl@[0:4]"), "n_samples": 2,
              "pass_k": [1, 2], "sampling": {"temperature": 0.0, "max_new_tokens": 4}}  # fmt: skip
    return json.dumps([{**held, **extra}, {**greedy, **extra}])


def test_eval_scores_a_model_folder_with_the_eval_actors_rows(tiny, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert main(["eval", "--model", str(tiny / "model"), "--eval-sets", sets(tiny),
                 "--out", str(out)]) == 0  # fmt: skip
    held, greedy = (json.loads(x) for x in out.read_text().splitlines())
    assert held["set"] == "held" and held["model"] == str(tiny / "model")
    assert (held["prompts"], held["samples"]) == (6, 18)
    # The eval actor's metrics, key for key (its rows come from the same score_samples).
    actor_keys = set(score_samples([], _set_cfg(tiny), correct=1.0)) | {"seconds"}
    assert set(held) - {"model", "set"} >= actor_keys
    assert {"pass@1/0", "pass@1/1"} <= set(held)
    assert 0 <= held["pass@1"] <= held["pass@3"] <= 1
    # Greedy draws the same response twice: a prompt is right in both samples or in none.
    assert greedy["pass@1"] == greedy["pass@2"] and greedy["samples"] == 8
    printed = capsys.readouterr().out
    assert "held" in printed and "pass@3" in printed and "pass@1/0" in printed


def _set_cfg(root: Path) -> EvalSetConfig:
    return EvalSetConfig.model_validate(json.loads(sets(root))[0])


def test_a_checkpoint_folder_is_scored_through_its_policy(tiny, tmp_path):
    shutil.copytree(tiny / "model", tmp_path / "step_000004" / "policy")
    assert resolve_model(tmp_path / "step_000004") == tmp_path / "step_000004" / "policy"


def test_the_engine_samples_the_eval_actors_stream(tiny, tmp_path):
    """The same seed draws what the job's eval actor would (its engine config's seed)."""
    flags = ["--hf-checkpoint", str(tiny / "model"), "--prompt-data", str(tiny / "held.jsonl"),
             "--seed", "7", "--eval-interval", "2", "--eval-sets", sets(tiny)]  # fmt: skip
    cfg = load_config(overrides=flags)
    actor = role_params(cfg, tmp_path / "run", resume=False)["eval"]
    assert engine_config(cfg, tiny / "model").seed == actor.engine.seed == 7


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such folder"),
        (["--model", "{root}"], "not a model folder (no config.json"),
        (["--model", "{root}/model"], "no eval sets: give --eval-sets"),
        (["--model", "{root}/model", "--eval-sets",
          '[{"name": "x", "path": "{root}/missing.jsonl"}]'], "eval set 'x': "),
        (["--model", "{root}/model", "--eval-set", "[]"], "did you mean --eval-sets"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_anything_starts(tiny, capsys, args, message):
    code = main(["eval", *(a.replace("{root}", str(tiny)) for a in args)])
    assert code == 2
    assert message.replace("{root}", str(tiny)) in capsys.readouterr().err


def test_a_set_whose_samples_all_fail_exits_nonzero_with_the_reason(tiny, capsys):
    reward = {"type": "custom", "path": "tests.test_offline_eval:broken_reward"}
    code = main(["eval", "--model", str(tiny / "model"), "--eval-sets", sets(tiny, reward=reward)])
    assert code == 1
    err = capsys.readouterr().err
    assert "every sample failed in held:" in err and "the grader is down" in err
