"""The reward model (``rollout/reward_model.py``) and the reward actor
(``actors/reward_model.py``): a real tiny HF sequence-classification model, scored in
batches in process, then served by the reward actor to the rollout actors of a real job.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
import uvloop
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Qwen2ForSequenceClassification,
)

from asyncrl.config import load_config
from asyncrl.job import run_job
from asyncrl.rollout.reward_config import RewardConfig, RewardModelConfig
from asyncrl.rollout.reward_model import RewardModel, RewardModelError
from asyncrl.rollout.rewards import RewardError, build_reward
from asyncrl.types import Sample
from tests.test_train import job_flags, write_prompts
from tests.tiny_model import tiny_config
from tests.tiny_tokenizer import build_chatml_tokenizer


def build_reward_model(directory: Path, num_labels: int = 1) -> Path:
    tokenizer = build_chatml_tokenizer(directory)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(tiny_config(tokenizer, num_labels=num_labels))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_reward_model(tmp_path_factory.mktemp("rm") / "model")


def one_by_one(path: Path, text: str, label: int = 0) -> float:
    """The score of ``text`` alone, unpadded, straight from transformers."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        return float(model(input_ids=ids).logits[0, label])


PAIRS = [("1+1=", "2"), ("What is 7 times 6?", "It is 42, since 7 x 6 = 42."), ("hi", ""),
         ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
          "4")]  # fmt: skip


async def test_batched_scores_equal_each_pair_scored_alone(rm_path):
    config = RewardModelConfig(path=str(rm_path), batch_size=8, batch_wait_ms=50)
    async with RewardModel(config) as rm:
        scores = await rm.score_many([p for p, _ in PAIRS], [r for _, r in PAIRS])
        texts = [rm.text(p, r) for p, r in PAIRS]
    # Right-padded rows of different lengths, one forward: each is its own text's score.
    for text, score in zip(texts, scores, strict=True):
        assert score == pytest.approx(one_by_one(rm_path, text), abs=1e-5)
    assert rm.stats["rm/batches"] == 1 and rm.stats["rm/pairs"] == len(PAIRS)
    assert len(set(scores)) == len(PAIRS)  # different texts, different scores
    # The chat template renders the conversation, the response as the assistant's turn.
    assert texts[0].startswith("<|im_start|>user\n1+1=") and "<|im_start|>assistant\n2" in texts[0]


async def test_concurrent_callers_share_batches_of_at_most_batch_size(rm_path):
    config = RewardModelConfig(path=str(rm_path), batch_size=3, batch_wait_ms=50)
    async with RewardModel(config) as rm:
        calls = [rm.score(f"{i}+{i}=", str(2 * i)) for i in range(7)]
        scores = await asyncio.gather(*calls)
    assert rm.stats["rm/pairs"] == 7 and rm.stats["rm/batches"] == 3  # 3 + 3 + 1
    assert scores[3] == pytest.approx(one_by_one(rm_path, rm.text("3+3=", "6")), abs=1e-5)


async def test_a_pair_over_max_length_fails_alone_with_its_length(rm_path):
    config = RewardModelConfig(path=str(rm_path), max_length=24, batch_wait_ms=50)
    async with RewardModel(config) as rm:
        short, long = await rm.score_many(["1+1="], ["2"]), await rm.score_many(["x"], ["y " * 50])
        together = await rm.score_many(["1+1=", "x"], ["2", "y " * 50])
    assert isinstance(short[0], float) and short[0] == together[0]
    assert isinstance(long[0], RewardModelError) and "over the reward model's max_length 24" in str(
        long[0]
    )
    assert isinstance(together[1], RewardModelError)


async def test_a_label_the_head_lacks_is_refused_at_load(tmp_path):
    path = build_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(RewardModelError, match="label_index 2 but the head has 2 label"):
        async with RewardModel(RewardModelConfig(path=str(path), label_index=2)):
            pass
    async with RewardModel(RewardModelConfig(path=str(path), label_index=1)) as rm:
        score = await rm.score("a", "b")
    assert score == pytest.approx(one_by_one(path, rm.text("a", "b"), label=1), abs=1e-5)


async def test_the_model_reward_and_a_model_term(rm_path):
    config = RewardModelConfig(path=str(rm_path), batch_wait_ms=1)
    sample = Sample(uid="g/0", group_id="g", prompt="1+1=", response_text="#### 2", label="2")
    async with RewardModel(config) as rm:
        single = build_reward(RewardConfig(model=config), rm)
        terms = build_reward(RewardConfig(terms=[
            {"name": "rm", "model": config.model_dump(), "weight": 0.5},
            {"name": "correct", "type": "exact"},
        ]), rm)  # fmt: skip
        alone = await single(sample)
        mixed = await terms(sample)
        assert alone == pytest.approx(one_by_one(rm_path, rm.text("1+1=", "#### 2")), abs=1e-5)
        assert mixed == pytest.approx({"rm": alone, "correct": 1.0, "score": 0.5 * alone + 1.0})
        long = Sample(uid="g/1", group_id="g", prompt="x", response_text="y " * 3000, label="")
        with pytest.raises(RewardError, match="max_length 4096"):
            await single(long)
    with pytest.raises(ValueError, match="needs its reward model"):
        build_reward(RewardConfig(model=config))


@pytest.mark.slow
def test_a_job_scores_its_rollouts_with_the_reward_actor(rm_path, tmp_path):
    """A real job: a reward actor process serves the model; rollout actors score through
    it; the trainer trains on its scores."""
    from tests.tiny_model import build_tiny_model

    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    flags = [*job_flags(tmp_path, steps=2), "--reward-model-path", str(rm_path),
             "--rollout.num-actors", "2"]  # fmt: skip
    cfg = load_config(overrides=flags)
    assert cfg.rollout.reward.type == "model"
    result = uvloop.run(run_job(cfg))
    assert result.ok, result.error
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # Rewards are the model's scores: real-valued, not the 0/1 of a comparison.
    assert any(r["reward/mean"] not in (0.0, 1.0) for r in rows)
    reward_log = (run / "logs" / "reward.jsonl").read_text()
    assert "reward model ready" in reward_log
    beats = [json.loads(x) for x in (run / "metrics" / "rollout-0.jsonl").read_text().splitlines()]
    assert beats[-1]["reward/errors"] == 0


@pytest.mark.slow
async def test_a_killed_reward_actor_comes_back_and_no_sample_fails(rm_path, tmp_path):
    """SIGKILL the reward actor once the trainer has stepped: the supervisor restarts it,
    the rollout actors send their lost calls again, and every step trains on scores."""
    from tests.test_train import kill_mid_run
    from tests.tiny_model import build_tiny_model

    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    flags = [*job_flags(tmp_path, steps=6), "--reward-model-path", str(rm_path),
             "--rollout.reward.timeout-s", "120"]  # fmt: skip
    victim, result = await kill_mid_run(tmp_path / "run", "reward", flags)
    assert result.ok, result.error
    assert result.steps == 6
    log = [json.loads(x) for x in (tmp_path / "run/logs/reward.jsonl").read_text().splitlines()]
    pids = {r["pid"] for r in log}
    assert victim in pids and len(pids) == 2  # the killed incarnation and its successor
    rollout = (tmp_path / "run/metrics/rollout-0.jsonl").read_text().splitlines()
    assert json.loads(rollout[-1])["reward/errors"] == 0


def test_a_bad_reward_model_folder_is_refused_before_launch(rm_path, tmp_path):
    from asyncrl.preflight import PreflightError, preflight
    from tests.tiny_model import build_tiny_model

    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    base = job_flags(tmp_path, steps=1)
    preflight(load_config(overrides=[*base, "--reward-model-path", str(rm_path)]))
    with pytest.raises(PreflightError, match="reward model /nowhere: not a Hugging Face"):
        preflight(load_config(overrides=[*base, "--reward-model-path", "/nowhere"]))
    second = ["--reward-model-path", str(rm_path), "--rollout.reward.model.label-index", "1"]
    with pytest.raises(PreflightError, match="label_index 1 but its head has 1 label"):
        preflight(load_config(overrides=[*base, *second]))


def test_asyncrl_eval_scores_a_set_with_a_reward_model_in_process(rm_path, tmp_path):
    from asyncrl.cli import main
    from tests.tiny_model import build_tiny_model

    build_tiny_model(tmp_path / "model")
    held = {"name": "held", "path": str(write_prompts(tmp_path / "p.jsonl", n=4)), "n_samples": 2,
            "sampling": {"temperature": 1.0, "max_new_tokens": 4},
            "reward": {"model": {"path": str(rm_path)}, "correct": 0.0}}  # fmt: skip
    out = tmp_path / "rows.jsonl"
    argv = ["eval", "--model", str(tmp_path / "model"), "--eval-sets", json.dumps([held]),
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    [row] = [json.loads(x) for x in out.read_text().splitlines()]
    assert row["failed"] == 0 and row["reward"] not in (0.0, 1.0)  # the model's mean score


async def test_a_pair_that_cannot_be_encoded_fails_alone(rm_path, monkeypatch):
    config = RewardModelConfig(path=str(rm_path), batch_wait_ms=50)
    async with RewardModel(config) as rm:
        render = rm.tokenizer.apply_chat_template

        def strict(chat, **kwargs):  # a template that refuses a role order, say
            if chat[0]["role"] == "assistant":
                raise ValueError("conversations start with the user")
            return render(chat, **kwargs)

        monkeypatch.setattr(rm.tokenizer, "apply_chat_template", strict)
        bad = [{"role": "assistant", "content": "hi"}]
        good, broken = await rm.score_many(["1+1=", bad], ["2", "x"])
    assert isinstance(good, float)
    assert isinstance(broken, RewardModelError) and "conversations start with the user" in str(
        broken
    )


async def test_without_a_chat_template_a_pair_is_the_tokenizers_text_pair(rm_path):
    async with RewardModel(RewardModelConfig(path=str(rm_path))) as rm:
        rm.tokenizer.chat_template = None
        ids = rm.encode("1+1=", "2")
        assert ids == rm.tokenizer("1+1=", "2")["input_ids"]
        score = await rm.score("1+1=", "2")
    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    with torch.inference_mode():
        want = float(model(input_ids=torch.tensor([ids])).logits[0, 0])
    assert score == pytest.approx(want, abs=1e-5)


def test_the_eval_sets_fall_back_to_the_rollouts_reward_model(rm_path, tmp_path):
    """A train-only job (batches from files) still serves the reward model its eval
    sets use through the rollout reward; a model term beside a custom term preflights."""
    from asyncrl.preflight import preflight
    from asyncrl.role_configs import job_reward_model
    from tests.tiny_model import build_tiny_model

    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    held = json.dumps([{"name": "held", "path": str(tmp_path / "prompts.jsonl")}])
    (tmp_path / "dump").mkdir()
    (tmp_path / "dump" / "batch_000001.msgpack").write_bytes(b"")  # only its name is read here
    flags = [*job_flags(tmp_path, steps=1), "--reward-model-path", str(rm_path),
             "--eval-interval", "1", "--eval-sets", held,
             "--load-debug-rollout-data", str(tmp_path / "dump")]  # fmt: skip
    model = job_reward_model(load_config(overrides=flags))
    assert model is not None and model.path == str(rm_path)
    terms = json.dumps([{"name": "rm", "model": {"path": str(rm_path)}},
                        {"name": "custom", "path": "tests.test_rewards:sync_reward"}])  # fmt: skip
    preflight(load_config(overrides=[*job_flags(tmp_path, 1), "--rollout.reward.terms", terms]))


async def test_closing_the_model_fails_its_waiting_callers_instead_of_hanging(rm_path):
    """A caller whose pair is on the model's thread, or still queued, when the model
    closes (the actor stops) gets an error at once, not a wait that never ends."""
    import time

    config = RewardModelConfig(path=str(rm_path), batch_size=1, batch_wait_ms=0)
    rm = RewardModel(config)
    await rm.__aenter__()
    forward = rm._forward
    rm._forward = lambda batch: (time.sleep(0.5), forward(batch))[1]  # a slow forward
    calls = [asyncio.create_task(rm.score("1+1=", str(i))) for i in range(3)]
    await asyncio.sleep(0.1)  # the first pair is on the thread, two are queued
    await rm.__aexit__(None, None, None)
    done = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
    assert all(isinstance(x, RewardModelError) and "closed" in str(x) for x in done), done
