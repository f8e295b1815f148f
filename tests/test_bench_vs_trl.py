"""bench/vs_trl.py: both frameworks really train on a tiny model, and the report compares them."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


vs_trl = _load("bench_vs_trl", ROOT / "bench" / "vs_trl.py")


def point(step: int, time_s: float, accuracy: float) -> dict[str, float]:
    return {"step": step, "time_s": time_s, "accuracy": accuracy}


def test_time_to_accuracy_is_at_the_lower_best_and_ratios_are_asyncrl_over_trl() -> None:
    runs = {
        "asyncrl": {"samples/s": 30.0, "tokens/s": 300.0,
                    "curve": [point(0, 0, 0.1), point(4, 20, 0.3), point(8, 40, 0.5)]},
        "trl": {"samples/s": 10.0, "tokens/s": 120.0,
                "curve": [point(0, 0, 0.1), point(4, 50, 0.2), point(8, 100, 0.4)]},
    }  # fmt: skip
    out = vs_trl.compare("30m", runs, start=0.1)
    assert out["target_accuracy"] == 0.4  # TRL's best, the lower of the two
    assert (runs["asyncrl"]["time_to_accuracy_s"], runs["trl"]["time_to_accuracy_s"]) == (40, 100)
    assert out["time_to_accuracy"] == pytest.approx(0.4)
    assert (out["samples/s"], out["tokens/s"]) == (pytest.approx(3.0), pytest.approx(2.5))
    assert out["targets"]["samples/s"] == {"want": 2.0, "met": True}
    assert out["targets"]["time_to_accuracy"] == {"want": 0.5, "met": True}


def test_no_gain_over_the_start_means_no_time_to_accuracy() -> None:
    flat = [point(0, 0, 0.2), point(2, 10, 0.2)]
    runs = {fw: {"samples/s": 1.0, "tokens/s": 1.0, "curve": flat} for fw in vs_trl.FRAMEWORKS}
    out = vs_trl.compare("30m", runs, start=0.2)
    assert out["time_to_accuracy"] is None and "note" in out
    assert out["targets"]["time_to_accuracy"]["met"] is None


def test_both_frameworks_train_every_seed_and_are_compared(tmp_path: Path) -> None:
    make_model = _load("arith_make_model", ROOT / "examples" / "arith" / "make_model.py")
    cache = tmp_path / "models"
    make_model.build_init(cache / "0.5m", argparse.Namespace(hidden=32, layers=2, heads=2, seed=0))
    out = tmp_path / "vs_trl.json"
    command = [sys.executable, str(ROOT / "bench" / "vs_trl.py"), "--sizes", "0.5m",
               "--steps", "3", "--groups", "2", "--samples", "4", "--save-every", "2",
               "--max-new-tokens", "8", "--eval-rows", "4", "--eval-samples", "2",
               "--seed", "3", "--seeds", "2", "--cache", str(cache), "--keep-checkpoints",
               "--work", str(tmp_path / "runs"), "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, check=True, timeout=400, capture_output=True,
                          text=True)  # fmt: skip
    result = json.loads(out.read_text())["sizes"]["0.5m"]
    assert result["model"]["params"] > 0
    assert [s["seed"] for s in result["seeds"]] == [3, 4]
    for seed in result["seeds"]:
        for fw in vs_trl.FRAMEWORKS:
            run = seed["frameworks"][fw]
            assert run["steps"] == run["requested_steps"] == 3, fw  # each side really trained
            assert run["samples/s"] > 0 and run["tokens/s"] > 0 and run["step_s"] > 0
            assert run["train_s_mean"] > 0  # each step's training phase, timed on each side
            assert 0 < run["cpu_busy"] <= 1 and 0 <= run["cpu_steal"] < 1  # the machine's CPU
            assert all(0 <= s["truncated"] <= 1 for s in run["timeline"])  # replies cut off
            assert ("generate_s_mean" in run) == (fw == "trl") == ("wait_s_mean" not in run)
            curve = run["curve"]
            assert curve[0] == point(0, 0.0, seed["start_accuracy"])
            assert [p["step"] for p in curve[1:]] == [2, 3]  # every K steps and the last
            times = [p["time_s"] for p in curve]
            assert times == sorted(times) and times[1] >= run["first_step_s"] > 0
        ratio = seed["frameworks"]["asyncrl"]["samples/s"] / seed["frameworks"]["trl"]["samples/s"]
        assert seed["comparison"]["samples/s"] == pytest.approx(ratio)
    # TRL trained asyncrl's draws in order, 2 groups a step; asyncrl's audit log gave its own.
    from transformers import AutoTokenizer

    for seed in result["seeds"]:
        folder = tmp_path / "runs" / "0.5m" / f"seed_{seed['seed']}"
        spec = json.loads((folder / "trl.spec.json").read_text())
        order = vs_trl.asyncrl_order(spec, AutoTokenizer.from_pretrained(spec["model"]))
        trl_rows = [s["rows"] for s in seed["frameworks"]["trl"]["timeline"]]
        assert trl_rows == [order[i : i + 2] for i in range(0, 6, 2)]
        asyncrl_rows = [s["rows"] for s in seed["frameworks"]["asyncrl"]["timeline"]]
        assert [len(set(rows)) for rows in asyncrl_rows] == [2, 2, 2]
        shared = vs_trl.shared_prompts({fw: seed["frameworks"][fw]["timeline"]
                                        for fw in vs_trl.FRAMEWORKS})  # fmt: skip
        assert seed["prompts_shared"] == shared and 0 <= shared["per_step"] <= shared["run"] <= 1
    # Each finished run kept its weights, not its optimizer, scheduler or RNG states.
    runs = tmp_path / "runs" / "0.5m"
    assert not list(runs.glob("seed_*/partial_result.json"))  # a finished seed's result.json
    assert sorted(p.name for p in runs.glob("seed_3/asyncrl/checkpoints/trainer/step_*/*")) == [
        "job", "job", "last_batch", "last_batch", "policy", "policy", "trainer.json", "trainer.json"
    ]  # fmt: skip
    for checkpoint in runs.glob("seed_*/trl/checkpoint-*"):
        assert (checkpoint / "model.safetensors").exists()
        assert not any((checkpoint / name).exists() for name in vs_trl.TRAINING_STATE)
    # Each seed trained in its own folder, with its own seed, in alternating order.
    for seed in (3, 4):
        for fw in vs_trl.FRAMEWORKS:
            spec = json.loads(
                (tmp_path / "runs" / "0.5m" / f"seed_{seed}" / f"{fw}.spec.json").read_text()
            )
            assert spec["seed"] == seed
    assert done.stdout.index("seed 3: training asyncrl") < done.stdout.index("seed 3: training trl")
    assert done.stdout.index("seed 4: training trl") < done.stdout.index("seed 4: training asyncrl")
    summary = result["summary"]
    assert summary["seeds"] == 2 and set(summary["ratios"]) == {
        "samples/s", "tokens/s", "time_to_accuracy", "time_to_threshold"
    }  # fmt: skip
    ratios = [s["comparison"]["samples/s"] for s in result["seeds"]]
    assert summary["ratios"]["samples/s"]["mean"] == pytest.approx(sum(ratios) / 2)
    own = [r for s in result["seeds"] if (r := s["comparison"]["time_to_accuracy"]) is not None]
    assert (summary["ratios"]["time_to_accuracy"] or {}).get("n", 0) == len(own)
    assert set(summary["targets"]) == {"samples/s"}
    assert "mean +- standard error over 2 seeds" in done.stdout
    assert out.with_suffix(".png").stat().st_size > 0
    # The same comparison again reads each finished seed instead of training it again.
    again = subprocess.run(command, cwd=ROOT, check=True, timeout=120, capture_output=True,
                           text=True)  # fmt: skip
    assert again.stdout.count("reusing") == 2 and "training" not in again.stdout, again.stdout
    assert json.loads(out.read_text())["sizes"]["0.5m"]["summary"] == summary
    # A seed whose scoring stopped part way is neither trained nor scored again.
    (tmp_path / "runs" / "0.5m" / "seed_4" / "result.json").unlink()
    third = subprocess.run(command, cwd=ROOT, check=True, timeout=120, capture_output=True,
                           text=True)  # fmt: skip
    assert third.stdout.count("trained earlier") == 2 and "training" not in third.stdout
    assert json.loads(out.read_text())["sizes"]["0.5m"]["summary"] == summary
    # An asyncrl variant (its own filter) trains asyncrl alone and borrows the kept TRL run.
    variant = tmp_path / "variant.json"
    flags = ["--seeds", "1", "--work", str(tmp_path / "variant"), "--out", str(variant),
             "--results-from", str(tmp_path / "runs"), "--asyncrl-filters", DROP_FIRST]  # fmt: skip
    fourth = subprocess.run([*command, *flags], cwd=ROOT, check=True, timeout=300,
                            capture_output=True, text=True)  # fmt: skip
    assert "training asyncrl" in fourth.stdout and "training trl" not in fourth.stdout
    [kept] = [s for s in result["seeds"] if s["seed"] == 3]
    [seed] = json.loads(variant.read_text())["sizes"]["0.5m"]["seeds"]
    trl, derived = seed["frameworks"]["trl"], ("reused_from", "time_to_accuracy_s")
    assert trl["reused_from"].endswith("0.5m/seed_3/result.json") and "(kept: " in fourth.stdout
    lent = {k: v for k, v in kept["frameworks"]["trl"].items() if k not in derived}
    assert {k: v for k, v in trl.items() if k not in derived} == lent  # figures, curve as kept
    assert seed["start_accuracy"] == kept["start_accuracy"]
    assert seed["frameworks"]["asyncrl"]["steps"] == 3
    assert seed["prompts_shared"] is not None  # from the lent TRL run's recorded rows
    buffer = (tmp_path / "variant/0.5m/seed_3/asyncrl/metrics/buffer.jsonl").read_text()
    assert json.loads(buffer.splitlines()[-1])["buffer.filtered.first_group"] >= 1


DROP_FIRST = "tests.test_bench_vs_trl:drop_the_first_group"
_SEEN: list[object] = []


def drop_the_first_group(group: object) -> str | None:
    """A dynamic-sampling filter that drops the first group its process sees: the
    variant's filter reached asyncrl's buffer, and the run still trains."""
    _SEEN.append(group)
    return "first_group" if len(_SEEN) == 1 else None


def test_an_asyncrl_variant_reuses_only_the_kept_trl_run() -> None:
    base = {"specs": {"asyncrl": {"lr": 1e-5, "eta": 1}, "trl": {"lr": 1e-5, "eta": 1}},
            "files": {"config": "a"}}  # fmt: skip
    done = {"key": base, "result": {"frameworks": {"asyncrl": {}, "trl": {}}}}
    variant = json.loads(json.dumps(base))
    variant["specs"]["asyncrl"]["filters"] = ["zero_reward_variance"]
    assert vs_trl.reusable_side(done, variant) == "trl"
    variant["specs"]["trl"]["lr"] = 2e-5  # both sides differ: nothing stands in
    assert vs_trl.reusable_side(done, variant) is None
    other_file = json.loads(json.dumps(base)) | {"files": {"config": "b"}}
    assert vs_trl.reusable_side(done, other_file) is None
    assert vs_trl.reusable_side(done, base) is None  # the same key: the whole seed is reused
    assert vs_trl.reusable_side({}, base) is None


def test_a_lent_run_is_marked_and_timed_again_to_the_new_target(tmp_path: Path) -> None:
    kept = {"samples/s": 1.0, "time_to_accuracy_s": 80.0, "curve": [point(0, 0, 0.1)]}
    lent = vs_trl.lent_run(kept, tmp_path / "result.json")
    assert lent["reused_from"] == str(tmp_path / "result.json")
    assert "time_to_accuracy_s" not in lent and lent["curve"] == kept["curve"]
    again = vs_trl.lent_run(lent, tmp_path / "elsewhere.json")  # lent on: the first keeper
    assert again["reused_from"] == lent["reused_from"]
    runs = {
        fw: {
            "samples/s": 1.0,
            "tokens/s": 1.0,
            "time_to_accuracy_s": 5.0,
            "curve": [point(0, 0, 0.1), point(2, 10, 0.11)],
        }
        for fw in vs_trl.FRAMEWORKS
    }
    vs_trl.compare("real", runs, 0.1, 2000)  # no gain over the start: no time, none stale
    assert all(r["time_to_accuracy_s"] is None for r in runs.values())


def test_asyncrl_filters_reach_asyncrls_spec_alone() -> None:
    args = vs_trl.parse_args(["--model", "real", "--asyncrl-filters", "zero_reward_variance"])
    specs = {fw: vs_trl.run_spec(args, "real", "m", fw, 0) for fw in vs_trl.FRAMEWORKS}
    assert specs["asyncrl"]["filters"] == ["zero_reward_variance"] and "filters" not in specs["trl"]
    flags = vs_trl.asyncrl_flags(specs["asyncrl"])
    assert flags[flags.index("--buffer.filters") + 1] == '["zero_reward_variance"]'
    plain = vs_trl.run_spec(vs_trl.parse_args(["--model", "real"]), "real", "m", "asyncrl", 0)
    assert "filters" not in plain  # kept seeds' keys stay valid
    flags = vs_trl.asyncrl_flags(plain)
    assert flags[flags.index("--buffer.filters") + 1] == "[]"


class PlainTokenizer:
    """Character ids and no special tokens: what ``trl_dataset``'s check needs."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


def test_trl_takes_the_prompts_in_the_order_asyncrls_job_draws_them(tmp_path: Path) -> None:
    """``--prompt-order shared`` (the default): TRL's sampler yields the prompts in the
    order the asyncrl job's data source draws them, across an epoch's end; ``own`` keeps
    TRL's shuffle and is not keyed (the earlier series' seeds stay valid)."""
    from trl.trainer.utils import RepeatSampler

    from asyncrl.buffer.sources import PromptSource
    from asyncrl.config import load_config

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n"
                             for i in range(10)))  # fmt: skip
    flags = ["--model", "real", "--train", str(train), "--steps", "3", "--groups", "4"]
    spec = vs_trl.run_spec(vs_trl.parse_args(flags), "real", "m", "trl", 5)
    assert spec["prompt_order"] == "shared"  # TRL's alone: a kept asyncrl run stays valid
    assert "prompt_order" not in vs_trl.run_spec(vs_trl.parse_args(flags), "real", "m",
                                                 "asyncrl", 5)  # fmt: skip
    spec |= {"chat": False, "out": str(tmp_path / "out")}
    cfg = load_config(spec["config"], overrides=vs_trl.asyncrl_flags(spec))
    assert cfg.data is not None
    source = PromptSource.open(cfg.data.model_copy(update={"apply_chat_template": False,
                                                           "num_epochs": 2}))  # fmt: skip
    drawn = [p.label for p in source.take(12)]  # 12 of 10 rows: into the second epoch
    assert drawn != [str(i) for i in range(10)] + ["0", "1"]  # shuffled

    dataset = vs_trl.trl_dataset(spec, PlainTokenizer())
    args = vs_trl.trl_config(spec)
    sampler = RepeatSampler(dataset, mini_repeat_count=spec["samples"],
                            batch_size=args.generation_batch_size // spec["samples"],
                            repeat_count=args.num_iterations * args.steps_per_generation,
                            shuffle=args.shuffle_dataset, seed=args.seed)  # fmt: skip
    batch = sampler.batch_size * sampler.mini_repeat_count  # a generation's samples,
    chunk = batch * sampler.repeat_count  # each batch repeated for its accumulation slices
    every = list(sampler)
    indices = [i for at in range(0, len(every), chunk)
               for i in every[at : at + batch : spec["samples"]]]  # one per group  # fmt: skip
    assert [dataset["label"][i] for i in indices][:12] == drawn

    own = vs_trl.run_spec(vs_trl.parse_args([*flags, "--prompt-order", "own"]), "real", "m",
                          "trl", 5)  # fmt: skip
    assert "prompt_order" not in own
    assert vs_trl.trl_config(own | {"out": str(tmp_path / "own")}).shuffle_dataset


def test_shared_prompts_are_trls_groups_asyncrl_trained_at_its_step_and_in_the_run() -> None:
    def steps(rows: dict[int, list[int]]) -> list[dict]:
        return [{"step": step, "rows": groups} for step, groups in rows.items()]

    trl = steps({1: [1, 2], 2: [3, 4]})
    asyncrl = steps({1: [1, 5], 2: [2, 3]})  # 2 trained a step late, 4 never
    shared = vs_trl.shared_prompts({"asyncrl": asyncrl, "trl": trl})
    assert shared == {"per_step": 0.5, "run": 0.75}
    assert vs_trl.shared_prompts({"asyncrl": asyncrl, "trl": [{"step": 1}]}) is None  # kept
    reward = vs_trl.TaskReward("numeric", samples=2)
    reward(["p"] * 6, ["The answer is 1."] * 6, [[5]] * 6, ["1", "1", "2", "2", "1", "1"],
           row=[7, 7, 9, 9, 7, 7])  # fmt: skip  # row 7 twice: a step across an epoch's end
    assert reward.calls[-1]["rows"] == [7, 9, 7]
    assert vs_trl.row_of("gsm8k@v2:5@0") == vs_trl.row_of("train:5") == 5  # "@" in a name


def test_a_truncated_reward_reaches_both_sides_and_the_scoring_and_is_keyed() -> None:
    """``--truncated-reward 0``: a reply cut off at the budget is wrong on both sides and
    in scoring, however its last number reads; a key without it is the series' as kept."""
    args = vs_trl.parse_args(["--model", "real", "--truncated-reward", "0"])
    specs = {fw: vs_trl.run_spec(args, "real", "m", fw, 0) for fw in vs_trl.FRAMEWORKS}
    assert all(spec["truncated_reward"] == 0.0 for spec in specs.values())
    flags = vs_trl.asyncrl_flags(specs["asyncrl"])
    assert flags[flags.index("--rollout.reward.truncated") + 1] == "0.0"
    assert vs_trl.EngineEvaluator(specs["trl"], 8).cfg.rollout.reward.truncated == 0.0
    reward = vs_trl.TaskReward("numeric", budget=2, stops=frozenset({2}), truncated=0.0)
    replies = [[{"role": "assistant", "content": c}] for c in ("so 28 *", "The answer is 28")]
    assert reward([None] * 2, replies, [[3, 4], [1, 2]], label=["28", "28"]) == [0.0, 1.0]
    plain = vs_trl.parse_args(["--model", "real"])
    spec = vs_trl.run_spec(plain, "real", "m", "trl", 0)
    assert "truncated_reward" not in spec
    flags = vs_trl.asyncrl_flags(vs_trl.run_spec(plain, "real", "m", "asyncrl", 0))
    assert flags[flags.index("--rollout.reward.truncated") + 1] == "null"  # TRL's rule
    assert vs_trl.EngineEvaluator(spec, 8).cfg.rollout.reward.truncated is None


def summary_seed(seed: int, start: float, asyncrl: list, trl: list) -> dict:
    """A seed's result as run_seed reports it: curves of (step, time_s, accuracy)."""

    def run(curve: list, rate: float) -> dict:
        points = [point(*p) for p in curve]
        return {
            "samples/s": rate,
            "tokens/s": 10 * rate,
            "step_s": 1.0,
            "wall_s": 9.0,
            "best_accuracy": max(p["accuracy"] for p in points[1:]),
            "curve": points,
        }

    runs = {"asyncrl": run(asyncrl, 4.0), "trl": run(trl, 2.0)}
    comparison = vs_trl.compare("30m", runs, start, 2000)
    return {"seed": seed, "start_accuracy": start, "scored": 2000, "frameworks": runs,
            "comparison": comparison}  # fmt: skip


def two_seeds() -> list[dict]:
    return [
        summary_seed(0, 0.10, [(0, 0, 0.10), (2, 10, 0.30), (4, 20, 0.40)],
                     [(0, 0, 0.10), (2, 40, 0.20), (4, 80, 0.30)]),
        summary_seed(1, 0.12, [(0, 0, 0.12), (2, 12, 0.25), (4, 24, 0.34)],
                     [(0, 0, 0.12), (2, 40, 0.28), (4, 80, 0.36)]),
    ]  # fmt: skip


def test_across_seeds_averages_each_seeds_time_and_times_one_threshold_where_both_reach_it():
    out = vs_trl.across_seeds("30m", two_seeds())
    # Each seed's own: at 30% (TRL's best) 10 s against 80; at 34% (asyncrl's) 24 against 80.
    assert out["ratios"]["time_to_accuracy"]["mean"] == pytest.approx((10 / 80 + 24 / 80) / 2)
    assert out["ratios"]["time_to_accuracy"]["n"] == 2
    assert out["targets"]["time_to_accuracy"] == {"want": 0.5, "met": True}
    # One threshold, the lower mean best: TRL's (0.30 + 0.36) / 2.
    assert out["threshold"] == pytest.approx(0.33)
    assert out["frameworks"]["asyncrl"]["time_to_threshold_s"] == [20, 24]
    assert out["frameworks"]["trl"]["time_to_threshold_s"] == [None, 80]  # seed 0 never
    assert out["reached_alone"] == {"asyncrl": 1, "trl": 0}
    assert out["ratios"]["time_to_threshold"]["mean"] == pytest.approx(24 / 80)  # both reached
    assert out["ratios"]["time_to_threshold"]["n"] == 1
    assert out["ratios"]["samples/s"] == {"mean": 2.0, "se": 0.0, "min": 2.0, "max": 2.0, "n": 2}
    acc = out["frameworks"]["asyncrl"]["accuracy"]
    assert list(acc) == [0, 2, 4] and acc[4]["mean"] == pytest.approx(0.37)
    assert acc[4]["se"] == pytest.approx(0.03)  # stdev(0.40, 0.34) / sqrt(2)
    # A threshold within two standard errors of the start times nothing.
    low = vs_trl.across_seeds("30m", two_seeds(), threshold=0.12)
    assert (
        low["ratios"]["time_to_threshold"] is None and "within two standard errors" in low["note"]
    )


def test_per_step_differences_are_paired_by_seed(capsys):
    # Seeds 20 points apart, asyncrl 2 points ahead on both at step 2 and level at 4:
    # paired, the difference is exact; unpaired it would drown in the seeds' spread.
    seeds = [
        summary_seed(0, 0.10, [(0, 0, 0.10), (2, 10, 0.22), (4, 20, 0.30)],
                     [(0, 0, 0.10), (2, 40, 0.20), (4, 80, 0.30)]),
        summary_seed(1, 0.30, [(0, 0, 0.30), (2, 12, 0.42), (4, 24, 0.45)],
                     [(0, 0, 0.30), (2, 40, 0.40), (4, 80, 0.47), (6, 99, 0.5)]),
    ]  # fmt: skip
    diff = vs_trl.across_seeds("30m", seeds)["accuracy_difference"]
    assert list(diff) == [2, 4]  # steps on every seed's both curves; not the start
    assert diff[2]["mean"] == pytest.approx(0.02) and diff[2]["se"] == pytest.approx(0.0)
    assert diff[4]["mean"] == pytest.approx(-0.01) and diff[4]["se"] == pytest.approx(0.01)
    unpaired = vs_trl.across_seeds("30m", seeds)["frameworks"]["asyncrl"]["accuracy"][2]
    assert unpaired["se"] == pytest.approx(0.10)
    vs_trl.print_summary(vs_trl.across_seeds("30m", seeds))
    assert "paired by seed (points): 2: +2.0 +- 0.0, 4: -1.0 +- 1.0" in capsys.readouterr().out


def test_a_seed_where_asyncrl_alone_misses_the_threshold_fails_the_time_target():
    seeds = two_seeds()
    seeds.append(summary_seed(2, 0.11, [(0, 0, 0.11), (2, 10, 0.25), (4, 20, 0.32)],
                              [(0, 0, 0.11), (2, 40, 0.30), (4, 80, 0.35)]))  # fmt: skip
    out = vs_trl.across_seeds("30m", seeds, threshold=0.33)
    assert out["reached_alone"] == {"asyncrl": 1, "trl": 1}
    assert out["ratios"]["time_to_accuracy"]["mean"] < 0.5  # each seed's own ratio is fine
    assert out["targets"]["time_to_accuracy"]["met"] is False  # but seed 2 never got there


def test_one_seed_is_not_judged_against_a_target():
    out = vs_trl.across_seeds("30m", two_seeds()[:1])
    assert out["ratios"]["samples/s"]["n"] == 1
    assert out["targets"]["samples/s"]["met"] is None
    assert out["targets"]["time_to_accuracy"]["met"] is None
    assert "not judged" in vs_trl._verdict("samples/s", out["targets"]["samples/s"])


def test_a_gain_within_two_standard_errors_of_the_start_is_noise() -> None:
    # 800 samples scored at a 1.2% start: two standard errors of a difference of two such
    # accuracies are 1.09 points, so both reaching 1.6% is no evidence of learning.
    flat = [point(0, 0, 0.012), point(4, 10, 0.016)]
    runs = {fw: {"samples/s": 1.0, "tokens/s": 1.0, "curve": flat} for fw in vs_trl.FRAMEWORKS}
    out = vs_trl.compare("30m", runs, start=0.012, scored=800)
    assert out["time_to_accuracy"] is None and out["noise"] == pytest.approx(0.0109, abs=1e-4)
    assert "within two standard errors" in out["note"]
    clear = {fw: {**r, "curve": [point(0, 0, 0.012), point(4, 10, 0.03)]} for fw, r in runs.items()}
    assert vs_trl.compare("30m", clear, start=0.012, scored=800)["time_to_accuracy"] == 1.0


def test_eta_is_asyncrls_staleness_bound_per_size_unless_given() -> None:
    def eta(size: str, *flags: str) -> str:
        spec = vs_trl.run_spec(vs_trl.parse_args(list(flags)), size, "m", "asyncrl", 0)
        out = vs_trl.asyncrl_flags(spec)
        return out[out.index("--buffer.max-staleness") + 1]

    assert (eta("0.5m"), eta("30m")) == ("2", "1")
    assert (eta("0.5m", "--eta", "0"), eta("30m", "--eta", "4")) == ("0", "4")


def test_the_real_model_runs_the_word_problems_task_with_its_own_defaults() -> None:
    spec = vs_trl.run_spec(vs_trl.parse_args(["--model", "real"]), "real", "m", "trl", 0)
    assert vs_trl.parse_args(["--model", "real"]).sizes == ["real"]
    assert spec["config"].endswith("examples/word_problems/config.yaml")
    assert spec["train"].endswith("examples/word_problems/data/train.jsonl")
    assert (spec["reward"], spec["temperature"], spec["chat"]) == ("numeric", 0.7, True)
    assert (spec["groups"], spec["samples"], spec["eval_samples"], spec["eta"]) == (8, 4, 4, 1)
    flags = vs_trl.asyncrl_flags(spec)
    assert flags[flags.index("--rm-type") + 1] == "numeric"
    assert json.loads(flags[flags.index("--rollout.sampling") + 1])["temperature"] == 0.7
    # A flag still wins over the task's default; the arith sizes keep theirs.
    spec = vs_trl.run_spec(vs_trl.parse_args(["--groups", "2"]), "real", "m", "trl", 0)
    assert (spec["groups"], spec["samples"]) == (2, 4)
    arith = vs_trl.run_spec(vs_trl.parse_args([]), "30m", "m", "trl", 0)
    assert (arith["reward"], arith["temperature"], arith["groups"]) == ("exact", 1.0, 16)


def test_the_evaluators_batch_is_the_configs_unless_given_and_then_keyed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = vs_trl.parse_args(["--model", "real", "--eval-max-running", "256"])
    spec = vs_trl.run_spec(args, "real", "m", "trl", 0)

    def engine(running: int | None) -> object:
        return vs_trl.EngineEvaluator(spec, 8, running=running).cfg.rollout.engine

    assert engine(None).max_running == 64 and engine(256).max_running == 256
    files = {}
    for name in ("config", "train", "test"):  # their contents are keyed: stand-ins here
        files[name] = str(tmp_path / name)
        (tmp_path / name).write_text(name)
    real_spec = vs_trl.run_spec
    monkeypatch.setattr(vs_trl, "run_spec", lambda *a: real_spec(*a) | files)
    model = {"path": "m", "build": None}
    plain = vs_trl.seed_key(vs_trl.parse_args(["--model", "real"]), "real", model, 0)
    wide = vs_trl.seed_key(args, "real", model, 0)
    assert "eval_max_running" not in plain  # a series begun before the flag keeps its key
    assert vs_trl.key_differences(plain, wide) == ["eval_max_running"]


def test_trl_trains_the_real_models_step_in_accumulated_micro_batches() -> None:
    pytest.importorskip("trl")
    spec = vs_trl.run_spec(vs_trl.parse_args(["--model", "real"]), "real", "m", "trl", 0)
    cfg = vs_trl.trl_config(spec)
    # One generation of the step's 32 samples, trained 8 at a time: one optimizer step.
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) == (8, 4)
    assert cfg.temperature == 0.7 and cfg.num_generations == 4
    with pytest.raises(SystemExit, match="must divide"):
        vs_trl.trl_config({**spec, "groups": 3, "samples": 3})  # 9 samples, 8 a batch


def test_trls_reward_is_asyncrls_numeric_reward_on_chat_completions() -> None:
    reward = vs_trl.TaskReward("numeric", budget=2, stops=frozenset({2}))
    replies = [[{"role": "assistant", "content": "7 x 4 = 28. The answer is 28."}],
               [{"role": "assistant", "content": "The answer is 27"}],
               [{"role": "assistant", "content": "no number"}]]  # fmt: skip
    # [1, 2] ends on the stop token at the budget; [3, 4] is cut off there; [] stopped.
    scores = reward([None] * 3, replies, [[1, 2], [3, 4], []], label=["28", "28", "28"])
    assert scores == [1.0, 0.0, 0.0]
    [call] = reward.calls
    assert call == {"samples": 3, "tokens": 4, "reward": pytest.approx(1 / 3),
                    "truncated": pytest.approx(1 / 3),
                    "scored_at": pytest.approx(time.time(), abs=60)}  # fmt: skip


def test_a_seeds_key_holds_no_checkout_path_so_another_checkout_reads_it() -> None:
    work = Path("/somewhere/runs/vs-trl")
    key = {"specs": {"asyncrl": {"out": f"{work}/real/seed_0/asyncrl", "seed": 0,
                                 "config": f"{vs_trl.ROOT}/examples/word_problems/config.yaml",
                                 "model": "/root/.cache/asyncrl/models/smollm2"}},
           "eval_rows": 500}  # fmt: skip
    assert vs_trl.portable(key, [work, vs_trl.ROOT]) == {
        "specs": {"asyncrl": {"out": "real/seed_0/asyncrl", "seed": 0,
                              "config": "examples/word_problems/config.yaml",
                              "model": "/root/.cache/asyncrl/models/smollm2"}},
        "eval_rows": 500,
    }  # fmt: skip


def test_trls_steps_split_into_generation_and_training_at_the_reward_call() -> None:
    steps = [{"step": 1, "time": 10.0, "scored_at": 7.0},
             {"step": 2, "time": 20.0, "scored_at": 16.0},
             {"step": 3, "time": 30.0, "scored_at": 24.5}]  # fmt: skip
    phases = vs_trl.trl_phases(steps, saves={2: 1.5})  # step 2's checkpoint took 1.5 s
    assert [p["train_s"] for p in phases] == [3.0, 4.0, 5.5]
    assert "generate_s" not in phases[0]  # from launch: model loads are in it
    assert [p["generate_s"] for p in phases[1:]] == [6.0, 3.0]  # 24.5 - (20 + 1.5)
    old = [{"step": 1, "time": 10.0}]  # recorded before the split: kept as it was
    assert vs_trl.trl_phases(old, saves={}) == old


def test_a_seed_not_reused_says_which_settings_differ() -> None:
    old = {"specs": {"asyncrl": {"lr": 1e-5, "seed": 0}}, "files": {"config": "a", "test": "t"}}
    new = {"specs": {"asyncrl": {"lr": 2e-5, "seed": 0}}, "files": {"config": "b", "test": "t"},
           "eval_dtype": "bfloat16"}  # fmt: skip
    assert vs_trl.key_differences(old, new) == [
        "specs.asyncrl.lr", "files.config", "eval_dtype"
    ]  # fmt: skip
    assert vs_trl.key_differences(new, new) == []
    assert vs_trl.key_differences({}, new) == ["specs", "files", "eval_dtype"]


def test_scores_are_kept_per_checkpoint_under_the_seeds_key(tmp_path: Path) -> None:
    calls: list[str] = []

    def evaluate(checkpoint: str) -> float:
        calls.append(checkpoint)
        return len(checkpoint) / 100

    path = tmp_path / "scores.json"
    cache = vs_trl.ScoreCache(path, {"seed": 0}, evaluate)
    assert cache("a/step_2") == cache("a/step_2") == 0.08 and calls == ["a/step_2"]
    again = vs_trl.ScoreCache(path, {"seed": 0}, evaluate)  # a later run of the same seed
    assert again("a/step_2") == 0.08 and calls == ["a/step_2"]
    other = vs_trl.ScoreCache(path, {"seed": 1}, evaluate)  # other settings: scored anew
    assert other("a/step_2") == 0.08 and calls == ["a/step_2", "a/step_2"]
    # A checkpoint under the seed's folder is named relative to it: a moved folder reads it.
    inside = tmp_path / "asyncrl" / "step_4"
    first = vs_trl.ScoreCache(path, {"seed": 1}, evaluate)
    score = first(inside)
    moved = tmp_path.parent / "moved"
    tmp_path.rename(moved)
    later = vs_trl.ScoreCache(moved / "scores.json", {"seed": 1}, evaluate)
    assert later(moved / "asyncrl" / "step_4") == score and calls.count(str(inside)) == 1


def test_a_finished_run_is_found_only_for_the_same_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "train.jsonl").write_text("{}\n")
    files = {"config": str(tmp_path / "config.yaml"), "train": str(tmp_path / "train.jsonl")}
    spec = {"out": str(tmp_path / "asyncrl"), "seed": 0, "lr": 1e-5} | files
    clock = {"t0": 1.0, "end": 2.0, "commit": "abc"}
    assert vs_trl.trained(spec) is None
    body = {"spec": spec, "clock": clock}
    vs_trl.clock_path(Path(spec["out"])).write_text(json.dumps(body))
    assert vs_trl.trained(spec) is None  # its outputs are gone
    Path(spec["out"]).mkdir()
    assert vs_trl.trained(spec) == clock
    assert vs_trl.trained(spec | {"lr": 2e-5}) is None
    # Training it again forgets the earlier run first: a failed run is not "trained".
    monkeypatch.setattr(vs_trl, "run_to_end", lambda *a, **k: 1)
    with pytest.raises(RuntimeError, match="run failed"):
        vs_trl.launch("asyncrl", spec)
    assert vs_trl.trained(spec) is None


def test_a_non_finite_truncated_reward_is_refused_before_anything_runs(capsys) -> None:
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["--model", "real", "--truncated-reward", "nan"])
    assert "--truncated-reward nan: a finite number" in capsys.readouterr().err


def test_a_filter_that_does_not_load_is_refused_before_anything_runs(capsys) -> None:
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["--model", "real", "--asyncrl-filters", "zero_reward_varience"])
    assert "--asyncrl-filters zero_reward_varience" in capsys.readouterr().err


@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_on_a_cpu_that_emulates_it_is_warned_of(monkeypatch, bf16) -> None:
    flags = frozenset({"avx2", *(["avx512_bf16"] if bf16 else [])})
    monkeypatch.setattr(vs_trl.hardware, "cpu_flags", lambda: flags)
    args = vs_trl.parse_args(["--model", "real", "--dtype", "bf16", "--eval-dtype", "bfloat16"])
    notes = vs_trl.slow_dtypes(args)
    assert len(notes) == (0 if bf16 else 2)
    assert all("emulated bf16" in n for n in notes)
    assert notes[1:] == [] or notes[1].startswith("--eval-dtype bfloat16")
    assert vs_trl.slow_dtypes(vs_trl.parse_args(["--model", "real"])) == []
    hf = vs_trl.parse_args(["--model", "real", "--eval-dtype", "bfloat16", "--evaluator", "hf"])
    assert vs_trl.slow_dtypes(hf) == []  # the dtype is the engine evaluator's alone


def test_a_second_copy_on_the_same_work_folder_is_refused_and_deletes_nothing(
    tmp_path: Path,
) -> None:
    import fcntl

    (tmp_path / "real").mkdir()  # the first copy's runs, in progress
    with (tmp_path / ".lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        command = [sys.executable, str(ROOT / "bench" / "vs_trl.py"), "--model", "real",
                   "--frameworks", "asyncrl", "--work", str(tmp_path)]  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "another vs_trl run is using it" in done.stderr
    assert (tmp_path / "real").is_dir()


def _real_args(work: Path, *flags: str) -> argparse.Namespace:
    args = vs_trl.parse_args(["--model", "real", "--work", str(work), *flags])
    args.work = work
    return args


MODEL = {"path": "/models/smollm2", "params": 1, "build": {}}
CLOCK = {"t0": 1.0, "end": 2.0, "commit": "abc"}


def _keep_seed(args: argparse.Namespace, seed: int = 0) -> Path:
    """A finished seed of ``args`` in its --work: each side trained, scores and result."""
    folder = args.work / "real" / f"seed_{seed}"
    key = vs_trl.seed_key(args, "real", MODEL, seed)
    for fw in args.frameworks:
        spec = vs_trl.run_spec(args, "real", MODEL["path"], fw, seed)
        Path(spec["out"]).mkdir(parents=True)
        vs_trl.mark_trained(spec, CLOCK, vs_trl.training_files(spec))
    vs_trl.write_json(folder / "scores.json", {"key": key, "scores": {"a": 0.1}})
    vs_trl.write_json(folder / "result.json", {"key": key, "result": {"commit": "abc"}})
    return folder


def test_a_work_folder_of_other_settings_is_refused_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _keep_seed(_real_args(tmp_path))
    kept = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    monkeypatch.setattr(vs_trl, "ensure_model", lambda *a: MODEL)
    monkeypatch.setattr(vs_trl, "launch", lambda *a: pytest.fail("nothing may train"))
    with pytest.raises(SystemExit) as stop:
        vs_trl.run_size(_real_args(tmp_path, "--lr", "2e-5"), "real")
    said = str(stop.value)
    assert "seed_0/result.json: specs.asyncrl.lr, specs.trl.lr" in said
    assert "seed_0/asyncrl (trained): lr" in said and "--fresh" in said
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == kept
    # Other scoring settings: refused too, unless --rescore (the training is kept).
    assert vs_trl.other_runs(_real_args(tmp_path, "--eval-rows", "200"), "real", MODEL)
    rescore = _real_args(tmp_path, "--eval-rows", "200", "--eval-samples", "2", "--rescore")
    assert vs_trl.other_runs(rescore, "real", MODEL) == []
    spec = vs_trl.run_spec(rescore, "real", MODEL["path"], "asyncrl", 0)
    assert vs_trl.trained(spec) is not None  # not trained again for other scoring
    # --rescore never lets a training setting through.
    assert vs_trl.other_runs(_real_args(tmp_path, "--lr", "2e-5", "--rescore"), "real", MODEL)


def test_fresh_forgets_the_seeds_first_so_an_interrupted_fresh_run_goes_on_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _keep_seed(_real_args(tmp_path))
    _keep_seed(_real_args(tmp_path), seed=1)  # not among the seeds asked for: kept
    fresh = _real_args(tmp_path, "--lr", "2e-5", "--fresh")
    vs_trl.forget_seeds(fresh)
    assert not folder.exists() and (tmp_path / "real" / "seed_1").is_dir()
    launched: list[str] = []

    def launch(framework: str, spec: dict, hold: int | None = None) -> dict:
        launched.append(framework)
        raise KeyboardInterrupt  # killed in its first training

    monkeypatch.setattr(vs_trl, "launch", launch)
    with pytest.raises(KeyboardInterrupt):
        vs_trl.train_and_score(fresh, "real", MODEL, 0, 0, {})
    assert launched == ["asyncrl"]
    # Rerun without --fresh: nothing of the old settings is left to refuse it.
    assert vs_trl.other_runs(_real_args(tmp_path, "--lr", "2e-5"), "real", MODEL) == []


def test_a_side_added_to_a_kept_seed_is_scored_again_with_rescore(tmp_path: Path) -> None:
    _keep_seed(_real_args(tmp_path, "--frameworks", "asyncrl"))
    both = _real_args(tmp_path)
    assert vs_trl.other_runs(both, "real", MODEL) == [
        "seed_0/result.json: specs.trl", "seed_0/scores.json: specs.trl"
    ]  # fmt: skip
    assert vs_trl.other_runs(_real_args(tmp_path, "--rescore"), "real", MODEL) == []


def test_scores_of_another_training_are_not_read(tmp_path: Path) -> None:
    path, calls = tmp_path / "scores.json", []

    def evaluate(checkpoint: str) -> float:
        calls.append(checkpoint)
        return 0.5

    vs_trl.ScoreCache(path, {"seed": 0}, evaluate, {"asyncrl": 1.0})("a/step_2")
    vs_trl.ScoreCache(path, {"seed": 0}, evaluate, {"asyncrl": 1.0})("a/step_2")
    assert len(calls) == 1  # the same training: read
    vs_trl.ScoreCache(path, {"seed": 0}, evaluate, {"asyncrl": 9.0})("a/step_2")
    assert len(calls) == 2  # trained again: scored again
    legacy = {"key": {"seed": 0}, "scores": {"a/step_4": 0.25}}  # kept before the stamps
    vs_trl.write_json(path, legacy)
    assert vs_trl.ScoreCache(path, {"seed": 0}, evaluate, {"asyncrl": 9.0})("a/step_4") == 0.25


def test_a_kept_run_is_found_from_a_moved_work_folder(tmp_path: Path) -> None:
    args = _real_args(tmp_path / "old")
    _keep_seed(args)
    (tmp_path / "old").rename(tmp_path / "new")
    spec = vs_trl.run_spec(_real_args(tmp_path / "new"), "real", MODEL["path"], "trl", 0)
    assert vs_trl.trained(spec) == {"t0": 1.0, "end": 2.0, "commit": "abc"}


@pytest.mark.parametrize(
    "flags",
    [["--eval-samples", "0"], ["--eval-rows", "0"], ["--steps", "0"], ["--samples", "1"],
     ["--lr", "0"], ["--lr", "nan"], ["--save-every", "0"], ["--train", "/no/such.jsonl"],
     ["--test", "/no/such.jsonl"]],
)  # fmt: skip
def test_a_flag_out_of_range_or_a_missing_file_is_refused_at_once(flags, capsys) -> None:
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["--model", "real", *flags])
    assert flags[0] in capsys.readouterr().err


def test_a_damaged_json_file_reads_as_absent(tmp_path: Path, capsys) -> None:
    path = tmp_path / "result.json"
    path.write_text('{"key": {"specs"')  # cut short by a kill before writes were atomic
    assert vs_trl.read_json(path) == {} and "damaged" in capsys.readouterr().out
    vs_trl.write_json(path, {"a": 1})
    assert vs_trl.read_json(path) == {"a": 1} and not list(tmp_path.glob("*.part"))


def test_a_scored_seeds_checkpoints_are_deleted_and_it_is_not_scored_again(
    tmp_path: Path,
) -> None:
    folder = _keep_seed(_real_args(tmp_path))
    checkpoint = folder / "trl" / "checkpoint-2"
    checkpoint.mkdir()
    (folder / "asyncrl" / "checkpoints").mkdir()
    for fw in vs_trl.FRAMEWORKS:
        vs_trl.drop_checkpoints(folder / fw)
    assert not checkpoint.exists() and not (folder / "asyncrl" / "checkpoints").exists()
    spec = vs_trl.run_spec(_real_args(tmp_path), "real", MODEL["path"], "asyncrl", 0)
    assert vs_trl.trained(spec) is None  # nothing left to score: trained again if asked
    rescore = _real_args(tmp_path, "--eval-rows", "200", "--rescore")
    assert vs_trl.other_runs(rescore, "real", MODEL) == [
        "seed_0: its checkpoints were deleted once scored (--keep-checkpoints keeps them); "
        "--fresh trains it again"
    ]
    assert vs_trl.other_runs(_real_args(tmp_path), "real", MODEL) == []  # reused as kept


def test_a_training_file_changed_in_place_is_refused_until_retrained(tmp_path: Path) -> None:
    prompts = tmp_path / "train.jsonl"
    prompts.write_text((vs_trl.ROOT / "examples/word_problems/data/train.jsonl").read_text())
    args = _real_args(tmp_path / "work", "--train", str(prompts))
    spec = vs_trl.run_spec(args, "real", MODEL["path"], "asyncrl", 0)
    Path(spec["out"]).mkdir(parents=True)
    vs_trl.mark_trained(spec, CLOCK, vs_trl.training_files(spec))
    assert vs_trl.trained(spec) is not None and vs_trl.other_runs(args, "real", MODEL) == []
    prompts.write_text(prompts.read_text().splitlines(keepends=True)[0])  # one prompt left
    assert vs_trl.trained(spec) is None
    assert vs_trl.other_runs(args, "real", MODEL) == ["seed_0/asyncrl (trained): files.train"]
    # A clock kept before the hashes were: its files are taken as the same.
    path = vs_trl.clock_path(Path(spec["out"]))
    vs_trl.write_json(path, {k: v for k, v in vs_trl.read_json(path).items() if k != "files"})
    assert vs_trl.trained(spec) is not None


def test_a_training_file_edited_during_the_run_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = tmp_path / "train.jsonl"
    prompts.write_text((vs_trl.ROOT / "examples/word_problems/data/train.jsonl").read_text())
    spec = vs_trl.run_spec(_real_args(tmp_path / "work", "--train", str(prompts)), "real",
                           MODEL["path"], "asyncrl", 0)  # fmt: skip

    def edited_meanwhile(*args: object, **kwargs: object) -> int:
        prompts.write_text(prompts.read_text().splitlines(keepends=True)[0])
        return 0

    monkeypatch.setattr(vs_trl, "run_to_end", edited_meanwhile)
    vs_trl.launch("asyncrl", spec)
    assert vs_trl.trained(spec) is None  # hashed at launch: not the file it now names


def test_checkpoints_are_scored_coarse_first_each_level_alternating_sides() -> None:
    steps = [2, 4, 6, 8, 10, 12, 14, 16]
    order = vs_trl.coarse_first({"asyncrl": steps, "trl": steps[:3]})
    assert order[:4] == [("asyncrl", 16), ("trl", 6), ("asyncrl", 8), ("trl", 4)]
    assert [s for fw, s in order if fw == "asyncrl"] == [16, 8, 4, 12, 2, 6, 10, 14]
    for n in range(20):  # every checkpoint once, whatever the grid
        assert sorted(i for _, i in vs_trl.halvings(n)) == list(range(n))


def _scoring_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved: dict[str, tuple[int, ...]]
) -> tuple[argparse.Namespace, Path, list[str]]:
    """A kept seed trained for 8 steps, each side's checkpoints at ``saved`` steps; the
    scorer records what it scores and stops (Ctrl-C) at the sixth."""
    args = _real_args(tmp_path)
    folder = _keep_seed(args)
    (folder / "scores.json").unlink()
    steps = [{"step": s, "time": 1.0 + 10 * s, "samples": 8, "tokens": 80.0} for s in range(1, 9)]

    def timeline(out: Path, *_: object) -> dict:
        at = [{"step": s, "path": f"{out}/step_{s}", "time": 1.0 + 10 * s, "save_s": 0.1}
              for s in saved[Path(out).name]]  # fmt: skip
        return {"steps": steps, "checkpoints": at}

    accuracy = {"asyncrl/step_8": 0.3, "trl/step_8": 0.2, "asyncrl/step_4": 0.25}
    scored: list[str] = []

    def evaluate(path: str) -> float:
        if len(scored) == 5:
            raise KeyboardInterrupt  # stopped while scoring the sixth
        scored.append(path)
        return accuracy.get("/".join(Path(path).parts[-2:]), 0.1)

    monkeypatch.setattr(vs_trl, "asyncrl_timeline", timeline)
    monkeypatch.setattr(vs_trl, "trl_timeline", timeline)
    monkeypatch.setattr(vs_trl, "make_evaluator", lambda *a: evaluate)
    return args, folder, scored


def test_a_stopped_scoring_leaves_a_coarser_grid_with_its_figures_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grid = (2, 4, 6, 8)
    args, folder, scored = _scoring_only(tmp_path, monkeypatch, {"asyncrl": grid, "trl": grid})
    key = vs_trl.seed_key(args, "real", MODEL, 0)
    with pytest.raises(KeyboardInterrupt):
        vs_trl.train_and_score(args, "real", MODEL, 0, 0, key)
    names = ["/".join(Path(p).parts[-2:]) for p in scored[1:]]
    assert scored[0] == MODEL["path"]
    assert names == ["asyncrl/step_8", "trl/step_8", "asyncrl/step_4", "trl/step_4"]
    partial = json.loads((folder / "partial_result.json").read_text())
    assert partial["key"] == key and partial["result"]["partial"]
    assert partial["trained"] == {"asyncrl": CLOCK["t0"], "trl": CLOCK["t0"]}
    runs = partial["result"]["frameworks"]
    assert runs["asyncrl"]["scored_steps"] == runs["trl"]["scored_steps"] == [4, 8]
    # TRL's best, 20%, is the target: asyncrl's step 4 at 40 s, TRL's step 8 at 80 s.
    comparison = partial["result"]["comparison"]
    assert comparison["time_to_accuracy"] == pytest.approx(0.5)
    assert "targets" not in comparison  # judged on the whole grid only
    scored.clear()
    result = vs_trl.train_and_score(args, "real", MODEL, 0, 0, key)  # goes on: the rest
    names = ["/".join(Path(p).parts[-2:]) for p in scored]
    assert names == ["asyncrl/step_2", "trl/step_2", "asyncrl/step_6", "trl/step_6"]
    assert [p["step"] for p in result["frameworks"]["trl"]["curve"]] == [0, 2, 4, 6, 8]
    assert result["comparison"]["time_to_accuracy"] == pytest.approx(0.5)
    assert result["comparison"]["targets"]["time_to_accuracy"]["met"] is True  # 0.5 <= 0.5


def test_a_side_with_no_checkpoint_is_refused_before_the_other_is_scored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = {"asyncrl": (2, 4, 6, 8), "trl": ()}
    args, _, scored = _scoring_only(tmp_path, monkeypatch, saved)
    with pytest.raises(SystemExit, match="trl saved no checkpoint"):
        vs_trl.train_and_score(args, "real", MODEL, 0, 0, vs_trl.seed_key(args, "real", MODEL, 0))
    assert scored == []  # not even the start


def test_train_first_scores_every_seeds_start_then_each_grid_level_across_the_seeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = _real_args(tmp_path, "--seeds", "2", "--train-first")
    for seed in (0, 1):  # trained, nothing scored; seed 1's TRL is trained below
        folder = _keep_seed(args, seed)
        (folder / "scores.json").unlink()
        (folder / "result.json").unlink()
    vs_trl.clock_path(tmp_path / "real/seed_1/trl").unlink()
    steps = [{"step": s, "time": 1.0 + 10 * s, "samples": 8, "tokens": 80.0} for s in range(1, 9)]

    def timeline(out: Path, *_: object) -> dict:
        at = [{"step": s, "path": f"{out}/step_{s}", "time": 1.0 + 10 * s, "save_s": 0.1}
              for s in (2, 4, 6, 8)]  # fmt: skip
        return {"steps": steps, "checkpoints": at}

    accuracy = {"asyncrl/step_4": 0.3, "asyncrl/step_8": 0.35, "trl/step_8": 0.3}
    events: list[str] = []
    stopped: list[bool] = []

    def evaluate(path: str) -> float:
        if len(events) == 6 and not stopped:  # stopped once, scoring the fourth checkpoint
            stopped.append(True)
            raise KeyboardInterrupt
        events.append("/".join(Path(path).parts[-3:]))
        return accuracy.get("/".join(Path(path).parts[-2:]), 0.1)

    def launch(framework: str, spec: dict, hold: int | None = None) -> dict:
        events.append(f"train {'/'.join(Path(spec['out']).parts[-2:])}")
        vs_trl.mark_trained(spec, CLOCK, vs_trl.training_files(spec))
        return CLOCK

    monkeypatch.setattr(vs_trl, "asyncrl_timeline", timeline)
    monkeypatch.setattr(vs_trl, "trl_timeline", timeline)
    monkeypatch.setattr(vs_trl, "make_evaluator", lambda *a: evaluate)
    monkeypatch.setattr(vs_trl, "ensure_model", lambda *a: MODEL)
    monkeypatch.setattr(vs_trl, "launch", launch)
    with pytest.raises(KeyboardInterrupt):
        vs_trl.run_size(args, "real")
    start = "/".join(Path(MODEL["path"]).parts[-3:])
    assert events == ["train seed_1/trl", start, start, "seed_0/asyncrl/step_8",
                      "seed_0/trl/step_8", "seed_1/asyncrl/step_8"]  # fmt: skip
    partial = json.loads((tmp_path / "real/seed_1/partial_result.json").read_text())["result"]
    assert partial["frameworks"]["asyncrl"]["scored_steps"] == [8]
    assert "trl" not in partial["frameworks"]  # none of its checkpoints scored yet
    events.clear()
    result = vs_trl.run_size(args, "real")  # goes on from the next checkpoint
    assert events == [
        "seed_1/trl/step_8",
        *(f"seed_{seed}/{fw}/step_4" for seed in (0, 1) for fw in ("asyncrl", "trl")),
        *(f"seed_{seed}/{fw}/step_{step}" for step in (2, 6) for seed in (0, 1)
          for fw in ("asyncrl", "trl")),
    ]  # fmt: skip
    for seed in result["seeds"]:
        assert [p["accuracy"] for p in seed["frameworks"]["asyncrl"]["curve"]] == [
            0.1, 0.1, 0.3, 0.1, 0.35
        ]  # fmt: skip
        assert seed["comparison"]["time_to_accuracy"] == pytest.approx(0.5)  # 30%: 40 s vs 80 s
        folder = tmp_path / "real" / f"seed_{seed['seed']}"
        assert not (folder / "partial_result.json").exists()
        for fw in vs_trl.FRAMEWORKS:  # checkpoints deleted once scored
            assert vs_trl.read_json(vs_trl.clock_path(folder / fw))["checkpoints_dropped"]
    events.clear()
    assert vs_trl.run_size(args, "real")["seeds"] == result["seeds"]  # read, not scored
    assert events == []


def test_train_first_is_refused_before_anything_trains_when_the_disk_is_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"0" * 1000)  # 8 checkpoints a side: 8,000 B
    args = _real_args(tmp_path / "work", "--seeds", "2", "--train-first")
    args.work.mkdir()
    spec = vs_trl.run_spec(args, "real", str(model), "trl", 0)
    Path(spec["out"]).mkdir(parents=True)
    vs_trl.mark_trained(spec, CLOCK, vs_trl.training_files(spec))  # 3 sides left to train
    left = Path(vs_trl.run_spec(args, "real", str(model), "asyncrl", 1)["out"]) / "step_2"
    left.mkdir(parents=True)
    (left / "optimizer.pt").write_bytes(b"0" * 1000)  # an interrupted run's: deleted at launch
    # 1.1 x (3 sides x 8,000 B kept + 2 x 8,000 B of optimizer state in training) = 44,000 B
    free = {"bytes": 42_999}
    usage = vs_trl.shutil.disk_usage
    monkeypatch.setattr(
        vs_trl.shutil, "disk_usage", lambda p: usage(p)._replace(free=free["bytes"])
    )
    monkeypatch.setattr(vs_trl, "ensure_model", lambda *a: MODEL | {"path": str(model)})
    launched: list[str] = []

    def launch(framework: str, spec: dict, hold: int | None = None) -> dict:
        launched.append(framework)
        raise KeyboardInterrupt

    monkeypatch.setattr(vs_trl, "launch", launch)
    with pytest.raises(SystemExit, match="the 3 runs still to train"):
        vs_trl.run_size(args, "real")
    assert launched == []
    free["bytes"] = 43_000
    with pytest.raises(KeyboardInterrupt):
        vs_trl.run_size(args, "real")
    assert launched == ["asyncrl"]  # seed 0's first; its TRL was trained
