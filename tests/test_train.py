"""``asyncrl train`` end to end on the tiny model: buffer, a rollout actor with the embedded
engine, and the trainer as processes; the job finishes, metrics are written, versions
advance, staleness stays within eta, every prompt is accounted for, and a resumed run
continues from the checkpoints."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import uvloop
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from asyncrl import hardware
from asyncrl.buffer.dump import batch_files, read_batch
from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.job import JobResult, run_job
from asyncrl.preflight import check_agent, check_tool_use
from tests.test_trackers import wandb_history
from tests.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow


def write_prompts(path: Path, n: int = 16) -> Path:
    rows = [{"prompt": f"{i % 7}+{i % 5}=", "label": str(i % 7 + i % 5)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job_flags(tmp_path: Path, steps: int, eta: int = 1) -> list[str]:
    return [
        "--name", "t", "--output-dir", str(tmp_path / "run"),
        "--hf-checkpoint", str(tmp_path / "model"), "--lr", "1e-3",
        "--prompt-data", str(tmp_path / "prompts.jsonl"),
        "--rollout.num-actors", "1", "--rollout.max-groups", "4",
        "--rollout.sampling", '{"temperature": 1.0, "max_new_tokens": 6}',
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--buffer.max-staleness", str(eta), "--buffer.hard-staleness", str(eta),
        "--train.num-steps", str(steps),
        "--train.metrics-interval", "0.5", "--runtime.heartbeat-interval", "0.5",
    ]  # fmt: skip


def last_buffer_metrics(run_dir: Path) -> dict[str, float]:
    return json.loads((run_dir / "metrics" / "buffer.jsonl").read_text().splitlines()[-1])


def accounted(row: dict[str, float]) -> bool:
    """admitted = in flight + partial + buffered + consumed + failed + filtered."""
    live = sum(row[f"buffer.{k}"] for k in ("in_flight", "partial", "buffered", "consumed"))
    dropped = sum(v for k, v in row.items() if k.startswith(("buffer.failed.", "buffer.filtered.")))
    return row["buffer.admitted"] == live + dropped


async def pid_once_stepping(
    run_dir: Path, actor: str, job: asyncio.Task, within: float = 180
) -> int:
    """The pid (a process, or a Ray worker) of ``actor`` once it runs and the trainer has
    taken a step (a kill then lands early in the run, with work in flight)."""
    async with asyncio.timeout(within):
        while True:
            assert not job.done(), job.result()
            logs = lines(run_dir / "logs" / f"{actor}.jsonl")
            trainer = lines(run_dir / "logs" / "trainer.jsonl")
            if any('"step"' in x for x in trainer) and any("actor running" in x for x in logs):
                failed = [x for x in logs if '"actor failed"' in x]
                assert not failed, f"{actor} failed before the kill: {failed[0][:500]}"
                return int(json.loads(logs[0])["pid"])
            await asyncio.sleep(0.05)


#: A run long enough for a killed actor's successor to rejoin it: two groups per producer
#: (so each has work in flight), data for ten epochs, 32-token responses.
LONG_RUN = ["--rollout.max-groups", "2", "--num-epoch", "10",
            "--rollout.sampling", '{"temperature": 1.0, "max_new_tokens": 32}']  # fmt: skip


async def kill_mid_run(
    run_dir: Path, actor: str, flags: list[str], sig: int = signal.SIGKILL, within: float = 180
) -> tuple[int, JobResult]:
    """Run the job of ``flags``, send ``actor`` ``sig`` once the trainer has stepped (within
    ``within`` seconds); the victim's pid and how the job ended."""
    job = asyncio.create_task(run_job(load_config(overrides=flags)))
    victim = await pid_once_stepping(run_dir, actor, job, within)
    os.kill(victim, sig)
    return victim, await job


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def eval_flags(tmp_path: Path, interval: int) -> list[str]:
    sets = [
        {
            "name": "held",
            "path": str(tmp_path / "prompts.jsonl@[0:6]"),
            "n_samples": 3,
            "pass_k": [1, 3],
            "sampling": {"temperature": 1.0, "max_new_tokens": 4},
        }
    ]
    return ["--eval-interval", str(interval), "--eval.sets", json.dumps(sets)]  # fmt: skip


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, JobResult]:
    """One short async run, shared: 3 steps at eta 1, an eval actor, TensorBoard and W&B,
    its batches saved to ``dump``. (Its folder, how it ended.)"""
    root = tmp_path_factory.mktemp("short")
    build_tiny_model(root / "model")
    write_prompts(root / "prompts.jsonl")
    trackers = ["--use-tensorboard", "--use-wandb", "--wandb-mode", "offline"]
    flags = [*job_flags(root, steps=3), *eval_flags(root, 2), *trackers,
             "--save-debug-rollout-data", str(root / "dump"),
             "--runtime.lend-trainer-cores", "always"]  # fmt: skip  # the tiny model is narrow
    return root, uvloop.run(run_job(load_config(overrides=flags)))


def test_a_short_async_run_trains_and_accounts_for_every_prompt(short_run):
    root, result = short_run
    assert result.ok, result.error
    assert result.steps == 3
    run_dir = root / "run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Admission keeps staleness near eta; a group that finishes late can pass it, and the
    # backstop (hard_staleness, here = eta) drops it at hand-out: none is trained staler.
    assert all(r["staleness/max"] <= 1 for r in rows)
    last = last_buffer_metrics(run_dir)
    assert last["buffer.consumed"] == 3 * 2 and accounted(last)  # three steps of B = 2
    assert (run_dir / "checkpoints" / "trainer" / "step_000003" / "trainer.json").exists()
    # The eval actor followed the versions concurrently and evaluated the final one.
    evals = [json.loads(x) for x in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]
    versions = [r["version"] for r in evals]
    # On failure, say why: the eval and trainer actors' warnings and last lines (a rare
    # empty eval.jsonl under a loaded suite has not been explained yet).
    logs = {a: lines(run_dir / "logs" / f"{a}.jsonl") for a in ("eval", "trainer")}
    why = [x for a in logs.values() for x in a if '"warning"' in x or '"error"' in x]
    why += logs["eval"][-8:]
    assert versions == sorted(set(versions)) and versions[-1:] == [3], (versions, why)
    windows = [v // 2 for v in versions[:-1]]  # at most one version per interval, final aside
    assert len(windows) == len(set(windows)), versions
    assert all(r["set"] == "held" and r["prompts"] == 6 and r["samples"] == 18 for r in evals)
    assert all(0 <= r["pass@1"] <= r["pass@3"] <= 1 for r in evals)
    # Training has ended when the final version is evaluated: its eval takes every core.
    final_threads = [json.loads(x) for x in logs["eval"] if '"final eval threads"' in x]
    assert [r["threads"] for r in final_threads] == [os.cpu_count()], why
    # Each rollout actor wrote its counters and when its engine was busy.
    rollout = [
        json.loads(x) for x in (run_dir / "metrics" / "rollout-0.jsonl").read_text().splitlines()
    ]
    assert rollout[-1]["rollout/groups"] >= 3 * 2
    assert any("rollout/reward_mean" in r for r in rollout) and "version" in rollout[-1]
    spans = [b for r in rollout for b in r["busy"]]
    assert spans and all(a <= b for a, b in spans)
    # While the trainer waited, the engine stepped on the cores it lent (cores.py).
    if hardware.usable_cores() > 1:
        assert 0 < rollout[-1]["engine/lent_thread_steps"] <= rollout[-1]["engine/steps"]
        assert (run_dir / "trainer.busy").read_bytes() == b"\x00"  # cleared as it stopped
    # The controller forwarded the metrics files to TensorBoard and W&B, to the last row.
    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("train/loss")] == [1, 2, 3]
    assert [e.step for e in tb.Scalars("eval/held/pass@1")] == versions
    [wandb_run] = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    history = wandb_history(wandb_run, lambda rows: sum("train/loss" in r for r in rows) >= 3)
    assert [r["train/step"] for r in history if "train/loss" in r] == [1, 2, 3]
    # Two trained samples a step as text, in samples.jsonl and TensorBoard.
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in samples] == [1, 1, 2, 2, 3, 3]
    assert all(isinstance(r["response"], str) and r["prompt"] for r in samples)
    assert [e.step for e in tb.Tensors("samples/text_summary")] == [1, 2, 3]


def reward_by_length(sample) -> float:
    """A reward that varies inside a group (the tiny model never answers right)."""
    return float(len(sample.response_text))


LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", '["q_proj","v_proj"]',
        "--lora-publish", "adapters",
        "--rm-type", "custom", "--custom-rm-path", "tests.test_train:reward_by_length"]  # fmt: skip


@pytest.mark.parametrize("lora", [[], LORA], ids=["full", "lora"])
async def test_a_resumed_run_continues_from_its_checkpoints(tmp_path, lora):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    first = await run_job(load_config(overrides=[*job_flags(tmp_path, steps=2), *lora]))
    assert first.ok, first.error
    assert last_buffer_metrics(tmp_path / "run")["buffer.consumed"] == 2 * 2
    flags = [*job_flags(tmp_path, steps=4), *lora]
    second = await run_job(load_config(overrides=flags), resume=True)
    assert second.ok, second.error
    if lora:  # adapter versions reached the engine: 4 weights merged (q, v of 2 layers)
        logs = map(json.loads, lines(tmp_path / "run" / "logs" / "rollout-0.jsonl"))
        updates = [x for x in logs if x["event"] == "weights updated"]
        assert updates and all(x["tensors"] == 4 for x in updates)
        check_lora_checkpoint(tmp_path / "run", tmp_path / "model")
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3, 4]
    last = last_buffer_metrics(tmp_path / "run")
    # The ledger came back from the checkpoint: 8 distinct groups consumed, none twice.
    assert last["buffer.consumed"] == 4 * 2 and accounted(last)
    assert last["buffer.duplicates"] == 0


async def test_a_resumed_run_scores_no_version_twice(tmp_path):
    """The resumed job's eval actor starts past the versions ``eval.jsonl`` has: version 0
    is not scored again, and the new final version is. (Whether it sees the resumed
    trainer's first announcement, version 2, is timing: the schedule's unit tests in
    test_evaluation.py cover that one.)"""
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    flags = [*job_flags(tmp_path, 2), *eval_flags(tmp_path, 1)]
    first = await run_job(load_config(overrides=flags))
    assert first.ok, first.error
    path = tmp_path / "run" / "metrics" / "eval.jsonl"
    before = [json.loads(x)["version"] for x in lines(path)]
    assert before[0] == 0 and before[-1] == 2, before
    flags = [*job_flags(tmp_path, 4), *eval_flags(tmp_path, 1)]
    second = await run_job(load_config(overrides=flags), resume=True)
    assert second.ok, second.error
    after = [json.loads(x)["version"] for x in lines(path)][len(before) :]
    assert after and after[-1] == 4, after
    # One set, so each version is one row: strictly increasing means none scored twice.
    versions = before + after
    assert versions == sorted(set(versions)), versions


def check_lora_checkpoint(run_dir: Path, base: Path) -> None:
    """The last checkpoint holds peft's adapter files and merged weights in which only the
    adapted projections moved from the base model."""
    [*_, ckpt] = sorted(run_dir.glob("**/adapter/adapter_config.json"))
    merged = load_file(str(ckpt.parent.parent / "policy" / "model.safetensors"))
    original = load_file(str(base / "model.safetensors"))
    moved = {k for k in original if not torch.equal(original[k], merged[k])}
    assert moved and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in moved)


def test_train_refuses_missing_model_or_data_before_launch(tmp_path, capsys):
    assert main(["train", "--prompt-data", str(write_prompts(tmp_path / "p.jsonl"))]) == 2
    assert "--hf-checkpoint" in capsys.readouterr().err
    assert main(["train", "--rollout.sampling", '{"temperature": -1}']) == 2
    assert "sampling" in capsys.readouterr().err


def reward_that_fails_on_label_2(sample) -> float:
    """A user reward with a bug: it raises for one kind of prompt (rows 1 and 7)."""
    if sample.label == "2":
        raise ZeroDivisionError("division by zero in user reward")
    return float(sample.response_text.strip() == sample.label)


async def test_a_raising_reward_fails_its_samples_and_the_run_goes_on(tmp_path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    flags = [*job_flags(tmp_path, steps=2), "--rm-type", "custom"]
    flags += ["--custom-rm-path", "tests.test_train:reward_that_fails_on_label_2"]
    flags += ["--rollout-shuffle", "false"]  # row 1 is among the first groups admitted
    result = await run_job(load_config(overrides=flags))
    assert result.ok and result.steps == 2, result.error
    last = last_buffer_metrics(tmp_path / "run")
    failed = {k: v for k, v in last.items() if k.startswith("buffer.failed.")}
    assert failed and all("ZeroDivisionError" in k for k in failed), failed
    assert accounted(last)


def reward_out_of_range(sample) -> float:
    """A reward so large that its group's mean overflows: every step's loss is NaN."""
    return 1e308


async def test_steps_with_a_non_finite_loss_are_skipped_then_end_the_job(tmp_path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    flags = [*job_flags(tmp_path, steps=20), "--rm-type", "custom", "--save-interval", "1"]
    flags += ["--custom-rm-path", "tests.test_train:reward_out_of_range"]
    flags += ["--train.max-nonfinite-steps", "2"]
    result = await run_job(load_config(overrides=flags))
    assert not result.ok and result.steps == 0
    assert "2 steps in a row had a NaN or infinite loss or gradient" in result.error
    assert "not restarted" in result.error, result.error  # it would only repeat
    trainer_log = lines(tmp_path / "run" / "logs" / "trainer.jsonl")
    assert sum('"non-finite step skipped"' in x for x in trainer_log) == 1
    assert not list((tmp_path / "run" / "checkpoints" / "trainer").glob("step_*"))


async def test_a_job_whose_data_runs_out_first_says_so_and_does_not_wait_for_an_eval(
    tmp_path,
):
    """4 prompts, one epoch, 2 a step: 2 of the 50 steps asked for. It ends ok, with a
    warning, and the trainer does not wait for the eval actor's pull of a final version
    that never comes (it waited 120 s)."""
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=4)
    flags = [*job_flags(tmp_path, steps=50), "--num-epoch", "1", *eval_flags(tmp_path, 100)]
    result = await run_job(load_config(overrides=flags))
    assert result.ok and result.steps == 2, result.error
    assert result.warnings == [
        "trained 2 of the 50 steps asked for: the data ran out (data.num_epochs), or the "
        "trainer was told to stop (its log says which)"
    ]
    trainer_log = lines(tmp_path / "run" / "logs" / "trainer.jsonl")
    assert not any("exiting before the final weights were pulled" in x for x in trainer_log)


SYNC = ["--buffer.max-staleness", "0", "--buffer.hard-staleness", "0"]


@pytest.mark.parametrize(
    ("mode", "eta"),
    [
        (SYNC, 0),
        (["--buffer.over-provision", "0.5", "--rollout.engine.on-update", "abort"], 1),  # APRIL
        # Synchronous APRIL: the extras are aborted and resume a version later.
        (["--buffer.max-staleness", "0", "--buffer.over-provision", "1.0"], 1),
    ],
    ids=["sync", "april-abort-on-update", "sync-april"],
)
async def test_each_mode_of_the_same_code_finishes_with_the_accounting_whole(tmp_path, mode, eta):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    engine = ["--rollout.engine.model-path", str(tmp_path / "model")]
    result = await run_job(load_config(overrides=[*job_flags(tmp_path, 3), *engine, *mode]))
    assert result.ok and result.steps == 3, result.error
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["staleness/max"] <= eta for r in rows)
    assert accounted(last_buffer_metrics(tmp_path / "run"))


async def test_mini_batches_and_epochs_make_one_version_of_several_updates(tmp_path):
    """2 groups of 2 a step, one group per update, 2 epochs: 4 updates a version, and
    staleness (in versions) stays within eta as with one update."""
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    flags = [*job_flags(tmp_path, 3), "--global-batch-size", "2", "--ppo-epochs", "2"]
    result = await run_job(load_config(overrides=flags))
    assert result.ok and result.steps == 3, result.error
    rows = metrics_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["optim_steps"] == 4 and r["staleness/max"] <= 1 for r in rows)
    assert accounted(last_buffer_metrics(tmp_path / "run"))


async def test_reward_terms_train_on_their_weighted_sum_and_are_logged_each(tmp_path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    long = {"name": "long", "path": "tests.test_train:reward_by_length", "weight": 0.5}
    terms = [{"name": "right", "type": "exact"}, long]
    flags = [*job_flags(tmp_path, 2), "--rollout.reward.terms", json.dumps(terms)]
    result = await run_job(load_config(overrides=flags))
    assert result.ok and result.steps == 2, result.error
    for r in metrics_rows(tmp_path / "run"):  # the tiny model never answers right
        assert r["reward/right"] == 0.0
        assert r["reward/mean"] == pytest.approx(0.5 * r["reward/long"]) and r["reward/long"] > 0


async def test_ipc_versions_reach_the_engine_from_the_trainers_shared_memory(tmp_path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    flags = [*job_flags(tmp_path, 3), "--rollout.engine.model-path", str(tmp_path / "model"),
             "--update-weight-transport", "ipc"]  # fmt: skip
    result = await run_job(load_config(overrides=flags))
    assert result.ok and result.steps == 3, result.error
    rows = (tmp_path / "run" / "metrics" / "rollout-0.jsonl").read_text().splitlines()
    last = json.loads(rows[-1])
    # Every version the engine loaded came from the trainer's memory: none was pulled.
    assert last["rollout/weights_shared"] >= 1 and last["rollout/weights_pulled"] == 0, last
    assert accounted(last_buffer_metrics(tmp_path / "run"))


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


async def test_rollout_only_dumps_batches_at_version_0_with_the_accounting_whole(tmp_path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    flags = [*job_flags(tmp_path, steps=3), "--debug-rollout-only"]
    result = await run_job(load_config(overrides=flags))
    assert result.ok and result.steps == 3, result.error
    run_dir = tmp_path / "run"
    files = batch_files(run_dir / "rollout_data")
    assert [f.name for f in files] == [f"batch_00000{i}.msgpack" for i in (1, 2, 3)]
    samples = [s for f in files for s in read_batch(f).samples]
    assert len(samples) == 3 * 2 * 2  # 3 batches of B = 2 groups of 2 samples
    assert all(set(s.token_versions.tolist()) <= {0} for s in samples)  # no weight update
    assert [r["samples"] for r in metrics_rows(run_dir)] == [4, 4, 4]
    last = last_buffer_metrics(run_dir)
    assert last["buffer.consumed"] == 3 * 2 and accounted(last)
    assert not (run_dir / "checkpoints" / "trainer").exists()  # nothing was trained


async def test_train_only_replays_a_saved_run_step_for_step(short_run, tmp_path):
    """A run that saved its batches, replayed from the same initial weights with no buffer
    or engine, takes the same steps with the same losses."""
    root, first = short_run
    dump = root / "dump"
    assert first.ok, first.error
    assert len(batch_files(dump)) == 3
    replay = [*job_flags(root, steps=0), "--output-dir", str(tmp_path / "replay")]
    replay += ["--load-debug-rollout-data", str(dump)]  # 0 steps: until the dump runs out
    second = await run_job(load_config(overrides=replay))
    assert second.ok and second.steps == 3, second.error
    assert set(second.codes) == {"trainer"}
    assert not (tmp_path / "replay" / "metrics" / "buffer.jsonl").exists()
    original, replayed = metrics_rows(root / "run"), metrics_rows(tmp_path / "replay")
    for a, b in zip(original, replayed, strict=True):
        assert b["step"] == a["step"] and b["num_tokens"] == a["num_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["staleness/mean"] == a["staleness/mean"]


async def test_colocated_engines_sleep_through_every_train_step(tmp_path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    # Generation over HTTP here (the default is in process): a job test for each path.
    flags = [*job_flags(tmp_path, steps=3, eta=0), "--colocate", "--rollout.num-actors", "2",
             "--rollout.engine.in-process", "false"]  # fmt: skip
    result = await run_job(load_config(overrides=flags))
    assert result.ok and result.steps == 3, result.error
    run_dir = tmp_path / "run"
    steps = metrics_rows(run_dir)
    assert all(r["staleness/max"] == 0 for r in steps)
    assert accounted(last_buffer_metrics(run_dir))
    # When each step ran: it ended before the version was published and the row written.
    spans = [
        (r["time"] - r["time/publish"] - r["time/step"], r["time"] - r["time/publish"])
        for r in steps
    ]
    sleeps = []
    for i in (0, 1):
        rows = [
            json.loads(x)
            for x in (run_dir / "metrics" / f"rollout-{i}.jsonl").read_text().splitlines()
        ]
        sleeps.append(rows[-1]["rollout/sleeps"])
        busy = [b for r in rows for b in r["busy"]]
        overlaps = [(a, b) for a, b in busy for s, e in spans if a < e and s < b]
        assert not overlaps, (overlaps, spans)
    # Every actor slept before the first step; each step's groups were generated by some
    # actor that slept again before the step (one still asleep from before may sleep on).
    assert min(sleeps) >= 1 and sum(sleeps) >= 3, sleeps


class AlwaysCallsCalculator:
    """A tool-call parser for the random tiny model, which never writes a real call: every
    turn asks the calculator for 6*7, so each episode runs to the max-turn cut."""

    def parse(self, text: str) -> list:
        from asyncrl.rollout.multi_turn import ToolCall

        return [ToolCall("calculator", {"expression": "6*7"})]


async def test_multi_turn_tool_use_trains_on_sampled_tokens_with_observations_masked(tmp_path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=8)
    dump = tmp_path / "dump"
    flags = [*job_flags(tmp_path, steps=2), "--apply-chat-template", "true"]
    flags += ["--rollout.sampling", '{"temperature": 1.0, "max_new_tokens": 48}']
    flags += ["--rollout.tool-use.tools", '[{"type": "calculator"}]']
    flags += ["--rollout.tool-use.max-turns", "2", "--rollout.tool-use.max-tokens-per-turn", "4"]
    flags += ["--rollout.tool-use.parser", "tests.test_train:AlwaysCallsCalculator"]
    flags += ["--save-debug-rollout-data", str(dump)]
    held = {"name": "held", "path": str(tmp_path / "prompts.jsonl@[0:3]"), "n_samples": 2}
    held |= {"apply_chat_template": True, "sampling": {"temperature": 1.0, "max_new_tokens": 48}}
    flags += ["--eval-interval", "2", "--eval.sets", json.dumps([held])]
    cfg = load_config(overrides=flags)
    check_tool_use(cfg)  # what asyncrl train checks before launch: the template fits
    result = await run_job(cfg)
    assert result.ok, result.error
    assert accounted(last_buffer_metrics(tmp_path / "run"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    samples = [s for path in batch_files(dump) for g in read_batch(path).groups for s in g.samples]
    assert len(samples) == 2 * 2 * 2  # 2 steps x 2 groups x 2 samples
    prompt = tokenizer.decode(samples[0].prompt_tokens.tolist())
    assert '"name": "calculator"' in prompt  # the tools' schemas reached the prompt
    for s in samples:
        assert [t.role for t in s.spans] == ["assistant", "tool", "assistant"]
        assert (s.status, s.finish_reason) == ("truncated", "max_turns")
        first, tool, last = s.spans
        mask = s.loss_mask
        assert mask[first.start : first.end].all() and mask[last.start : last.end].all()
        assert not mask[tool.start : tool.end].any()
        assert "42" in tokenizer.decode(s.response_tokens[tool.start : tool.end].tolist())
        (call,) = s.metadata["tool_calls"]
        assert (call["name"], call["error"], call["timed_out"]) == ("calculator", None, False)
    # the eval actor ran the same episodes with the same tools
    evals = [json.loads(x) for x in (tmp_path / "run/metrics/eval.jsonl").read_text().splitlines()]
    assert evals and all(r["tool_calls"] == 1.0 and r["samples"] == 6 for r in evals)


async def two_call_agent(session, task) -> str:
    """An openai-client agent for the random tiny model: ask, say "again", ask again."""
    import openai

    messages: list = [{"role": "user", "content": str(task.prompt)}]
    async with openai.AsyncOpenAI(
        base_url=session.base_url, api_key=session.api_key, max_retries=0
    ) as client:
        first = await client.chat.completions.create(
            model=session.model, messages=messages, max_tokens=6
        )
        messages += [first.choices[0].message, {"role": "user", "content": "again"}]
        second = await client.chat.completions.create(
            model=session.model, messages=messages, max_tokens=6
        )
    return second.choices[0].message.content or ""


async def test_an_openai_client_agent_trains_through_the_proxy(tmp_path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=8)
    dump = tmp_path / "dump"
    flags = [
        *job_flags(tmp_path, steps=2),
        "--rollout.agent.path",
        "tests.test_train:two_call_agent",
    ]
    flags += ["--rollout.sampling", '{"temperature": 1.0, "max_new_tokens": 48}']
    flags += ["--save-debug-rollout-data", str(dump)]
    held = {"name": "held", "path": str(tmp_path / "prompts.jsonl@[0:3]"), "n_samples": 2}
    flags += ["--eval-interval", "2", "--eval.sets", json.dumps([held])]
    cfg = load_config(overrides=flags)
    check_agent(cfg)  # what asyncrl train checks before launch
    result = await run_job(cfg)
    assert result.ok, result.error
    assert accounted(last_buffer_metrics(tmp_path / "run"))
    samples = [s for path in batch_files(dump) for g in read_batch(path).groups for s in g.samples]
    assert len(samples) == 2 * 2 * 2
    for s in samples:
        assert s.status in ("completed", "truncated") and s.metadata["agent_calls"] == 2
        first, user, last = s.spans
        assert (first.role, user.role, last.role) == ("assistant", "user", "assistant")
        assert s.loss_mask[first.start : first.end].all() and s.loss_mask[last.start :].all()
        assert not s.loss_mask[user.start : user.end].any()
        assert first.end - first.start <= 6 and last.end - last.start <= 6  # max_tokens held
    evals = [json.loads(x) for x in (tmp_path / "run/metrics/eval.jsonl").read_text().splitlines()]
    eval_log = lines(tmp_path / "run/logs/eval.jsonl")[-20:]
    assert evals and all(r["samples"] == 6 for r in evals), (result.restarts, eval_log)


def test_train_refuses_an_agent_that_does_not_load_before_launch(tmp_path, capsys):
    build_tiny_model(tmp_path / "model")
    flags = [*job_flags(tmp_path, steps=1), "--rollout.agent.path", "tests.test_train:nope"]
    assert main(["train", *flags]) == 2
    assert "agent path 'tests.test_train:nope'" in capsys.readouterr().err
    flags[-1] = "tests.test_train:two_call_agent"
    flags += [
        "--rollout.tool-use.tools",
        '[{"type": "calculator"}]',
        "--apply-chat-template",
        "true",
    ]
    assert main(["train", *flags]) == 2
    assert "rollout.agent is the workflow" in capsys.readouterr().err


@pytest.mark.parametrize("restarts", [1, 0], ids=["restarted", "no-restarts-left"])
async def test_a_killed_rollout_actor_is_restarted_with_its_work_requeued(tmp_path, restarts):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", n=64)
    run_dir = tmp_path / "run"
    # The victim is the only producer: the run can only finish through its successor, so
    # a few steps after the kill (at step 1 or 2) prove that it rejoined; beside a second
    # producer they did not, however many steps the run took.
    steps = 12
    flags = [*job_flags(tmp_path, steps=steps), *LONG_RUN, "--rollout.num-actors", "1",
             "--runtime.max-restarts", str(restarts)]  # fmt: skip
    victim, result = await kill_mid_run(run_dir, "rollout-0", flags)
    if not restarts:  # the policy's budget is spent: the death ends the job, with evidence
        assert not result.ok
        assert "actor rollout-0 exited with code -9 (killed by SIGKILL)" in result.error
        assert accounted(last_buffer_metrics(run_dir))
        return
    assert result.ok, result.error
    assert result.steps == steps and result.restarts == ["rollout-0: killed by SIGKILL"]
    last = last_buffer_metrics(run_dir)
    assert last["buffer.consumed"] == steps * 2 and accounted(last)
    # Its successor produced the groups of the steps after the kill.
    successor = [json.loads(x) for x in lines(run_dir / "logs" / "rollout-0.jsonl")]
    assert any(r["pid"] != victim and r["event"] == "actor running" for r in successor)
    requeues = [json.loads(x) for x in lines(run_dir / "logs" / "buffer.jsonl") if "requeued" in x]
    assert [r["actor"] for r in requeues] == ["rollout-0"]
    logs = [json.loads(line) for line in lines(run_dir / "logs" / "rollout-0.jsonl")]
    assert any(r["pid"] != victim and r["event"] == "weights loaded" for r in logs)
