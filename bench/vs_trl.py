"""asyncrl against TRL's GRPOTrainer, side by side in one run, on toy sizes and a real model.

Two tasks. The toy sizes (``0.5m``, ``30m``) train GRPO on the arith demo
(``examples/arith``: character tokenizer, ``data/train.jsonl`` prompts as raw text,
exact-match reward on the text after ``####``) from a locally built checkpoint. The real
model (``real``, or ``--model real``) is SmolLM2-135M-Instruct on the word-problems
example (``examples/word_problems``: chat prompts rendered with the model's template,
the numeric reward, T = 0.7, 8 prompts x 4 samples a step). Both frameworks run on the
same machine (CPU, no vLLM), one after the other, with the same batch shape and
hyper-parameters:

    G prompts x N samples a step (one optimizer step per generated batch), learning rate,
    seed, max_new_tokens, the task's temperature (top-p 1, no top-k), KL coefficient 0, entropy 0,
    clip 0.2, token-mean loss (TRL's ``dapo``), advantages (r - mean) / std within a group,
    AdamW (betas 0.9/0.999, no weight decay), grad clip 1.0, constant LR, float32, no
    gradient checkpointing, and no dynamic-sampling filter (every sample is trained).

``--dtype bf16`` computes in bf16 on both sides with fp32 master weights and optimizer
state: TRL's ``bf16=True`` (Accelerate's autocast wraps its forwards, ``generate``
included); asyncrl's ``trainer.dtype bf16-mixed`` and an engine that samples from bf16
weights (``DTYPE_FLAGS``). Checkpoints are scored in fp32 unless ``--eval-dtype bfloat16``
(the engine evaluator only: 1.5x faster on a bf16 CPU, the same start accuracy within
0.1 point on the real model).

asyncrl runs ``asyncrl train`` (``run_job``) on the task's example config with those
settings: async with a staleness bound eta per size (``--eta``; 2 at 0.5M, the demo's
setting, 1 at 30M and on the real model), one rollout actor on the embedded engine, the
trainer in its own process (asyncrl gives each of the two torch processes its share of the
cores). TRL runs ``GRPOTrainer`` with transformers ``generate`` (``use_cpu``; it
generates, then trains, in one process on all the cores); on the real model it trains
each step's batch in micro-batches of 8 samples with gradients accumulated (the whole
batch in one forward takes 20 GB and more here). What differs is each framework's own
design: asyncrl trains on samples up to eta versions stale (decoupled PPO correction),
TRL on fresh ones. TRL takes the prompts in the order asyncrl's data source draws them
(``--prompt-order shared``, ``asyncrl_order``; asyncrl's step trains the first groups to
finish of those in flight, so its steps hold nearly the same prompts); with ``own`` each
shuffles with its own sampler, as in the series before 2026-12-02. Each step's prompts
are recorded on both sides (TRL's reward sees each group's file row; asyncrl's audit log,
``trained.jsonl``, names its groups) and a seed's ``prompts_shared`` says how alike they
were (``shared_prompts``).

``--truncated-reward R`` gives a reply cut off at ``--max-new-tokens`` the reward ``R``
on both sides, and in scoring, unscored (DAPO's overlong punishment): without it, a
cut-off reply whose last number happens to be the answer scores as correct.

``--asyncrl-filters zero_reward_variance`` runs asyncrl as a user would at its best: groups
whose samples all scored alike (no GRPO gradient) are dropped and replaced from the
engine's spare time, so each step's G groups all carry a gradient; TRL trains every
group, and its groups without a spread add nothing. With ``--results-from`` a kept seed
whose settings differ only in asyncrl's lends its TRL run and start score: asyncrl alone
trains and is scored.

Each run is a child process of this script (the same interpreter, started fresh), timed
from just before it is launched, so start-up (imports, model load, actors) counts for both.
The machine's CPU over each run is kept with its clock (``cpu_busy``; ``cpu_steal``, the
share a virtual machine's host took): runs timed one after the other compare alike only
where neither lost its cores to a neighbour.
Both write a checkpoint every ``--save-every`` steps with weights, optimizer and scheduler
(asyncrl's ``step_N/policy``, TRL's ``checkpoint-N``); the saves are inside the timed
part on both sides, and their measured seconds are reported. Once a run has finished its
optimizer, scheduler and RNG states are deleted (scoring reads the weights only; on the
real model they are 1.1 of a checkpoint's 1.6 GB).

Reported per size and framework:

- ``samples/s`` = trained samples / seconds between the first and the last step's end
  (the steady state: the steps after the first, which includes start-up); ``tokens/s``
  the same for trained (response, loss) tokens; ``step_s`` the mean seconds per step;
- held-out accuracy: pass@1 at the task's temperature (``--eval-samples`` samples a
  prompt) on the first ``--eval-rows`` rows of the task's ``data/test.jsonl``, scored
  after training (outside the timed part) for the starting checkpoint and every saved
  one, by one evaluator for both, seeded the same for every checkpoint: asyncrl's
  embedded engine through ``asyncrl eval``'s code (``--evaluator engine``, the default:
  every sample at once, continuously batched) or Hugging Face ``generate`` with
  ``examples/arith/evaluate.py``'s ``generate`` (``--evaluator hf``), scored by the
  task's reward. Checkpoints are scored coarse-first (each side's last, then the grid
  halved again and again, the sides alternating) and ``seed_S/partial_result.json``
  holds the figures of those scored so far (no targets judged), so a scoring stopped
  part way leaves a coarser grid; a rerun scores the rest;
- time to accuracy: wall seconds from launch to the end of the first step whose
  checkpoint reaches the target, the highest accuracy both frameworks reach (the smaller
  of their two best); none when that is within two standard errors of the start.

``--seeds N`` runs both frameworks on seeds ``--seed`` .. ``--seed + N - 1`` (their
order alternating from seed to seed; a seed whose ``result.json`` has the same settings is
read, not run again, so a long comparison can stop and go on) and reports each seed's
figures, then the mean +-
standard error over seeds of every figure, of the accuracy at each checkpoint step and of
the ratios asyncrl / TRL; time to accuracy is then timed to one ``--threshold`` for all
seeds (default: the lower of the two frameworks' mean best accuracy). The ratios are
printed next to the issue's targets: at 30M and on the real model, samples/s >= 2x and
time to accuracy <= 0.5x; at 0.5M, samples/s >= 1x. The figure (``--out`` with ``.png``)
draws every seed's held-out accuracy against wall seconds and, below, against the
training step: learning per step, side by side, whatever each side's speed.

``--train-first`` trains every seed before scoring any, then scores level by level of
the grid across the seeds (every seed's start, then every seed's last checkpoints, then
their midpoints, ...): a comparison stopped part way holds a coarse grid of every seed,
not the whole grid of the first. Every seed's checkpoints are kept meanwhile (about 4 GB
a side on the real model), so it is refused before anything trains when ``--work``'s disk
cannot hold them.

Models: ``--cache/<size>`` holds each size's starting checkpoint, built when missing with
``examples/arith/make_model.py``'s recipe (``build_init``: random-init Qwen2 and the
character tokenizer; ``sft_command``: ``asyncrl sft`` with label smoothing 0.1), on SFT
data written by ``make_data.py`` into the cache (the repository's data files are not
touched); ``build.json`` records the flags and the seconds it took. The real model comes
from ``asyncrl.model_zoo`` (``make smollm2``).

``.venv/bin/python bench/vs_trl.py`` prints the table, writes ``bench/results/vs_trl.json``
and ``bench/results/vs_trl.png`` (accuracy against wall seconds, per size). It needs
``pip install -e '.[bench]'`` (TRL, matplotlib).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model is local
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import argparse
import dataclasses
import fcntl
import importlib.util
import json
import math
import shutil
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl import hardware  # noqa: E402
from asyncrl.buffer.filters import load_filter  # noqa: E402
from asyncrl.runtime.tether import tie_to_parent  # noqa: E402
from bench.seeds import commit, mean_se, read_json, run_to_end, sha256, write_json  # noqa: E402

ARITH = ROOT / "examples" / "arith"
WORDS = ROOT / "examples" / "word_problems"
FRAMEWORKS = ("asyncrl", "trl")
MISSING_BENCH = "bench/vs_trl.py needs TRL and matplotlib: pip install -e '.[bench]'"


@dataclasses.dataclass(frozen=True)
class Task:
    """What both frameworks train on: asyncrl's starting config, the data, the reward
    (asyncrl's built-in type), the sampling temperature, whether prompts are chat messages
    (rendered with the model's template), the batch shape and the held-out scoring."""

    config: Path
    train: Path
    test: Path
    reward: str
    temperature: float
    chat: bool
    groups: int
    samples: int
    eval_samples: int
    trl_micro: int | None  # TRL's per-device batch in samples; None: the whole step


ARITH_TASK = Task(ARITH / "config.yaml", ARITH / "data" / "train.jsonl",
                  ARITH / "data" / "test.jsonl", reward="exact", temperature=1.0, chat=False,
                  groups=16, samples=8, eval_samples=4, trl_micro=None)  # fmt: skip
WORDS_TASK = Task(WORDS / "config.yaml", WORDS / "data" / "train.jsonl",
                  WORDS / "data" / "test.jsonl", reward="numeric", temperature=0.7, chat=True,
                  groups=8, samples=4, eval_samples=4, trl_micro=8)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Build:
    """A toy checkpoint: the Qwen2 shape and its SFT warm-up."""

    hidden: int
    layers: int
    heads: int
    num_sft: int
    epochs: int
    batch_size: int
    sft_lr: float


@dataclasses.dataclass(frozen=True)
class Size:
    """A model: how its checkpoint is made (None: the real model, from the model zoo),
    its task, and the default RL steps, LR and asyncrl's staleness bound eta."""

    build: Build | None
    task: Task
    steps: int
    lr: float
    eta: int


SIZES: dict[str, Size] = {
    # 0.50M parameters: per-sample overhead dominates. The demo's SFT recipe, half the rows.
    "0.5m": Size(Build(hidden=80, layers=5, heads=4, num_sft=32000, epochs=2, batch_size=32,
                       sft_lr=3e-3), ARITH_TASK, steps=60, lr=1e-4, eta=2),
    # 31.6M parameters: compute dominates. One epoch of 1,800 steps at a lower LR (43
    # minutes here; pass@1 25% after it). At 1e-3 the loss stalled near 1.55, and 400
    # steps left the model at 1.2%, which 16 RL steps could not move beyond noise. RL at
    # 1e-4 overshot here: TRL peaked at step 12 and fell back, asyncrl (two versions
    # stale) at step 4. At 3e-5, eta 2 stopped gaining near 42% while TRL went on to 52%;
    # eta 1 climbs like TRL (51.4% at step 40): 2.64x its samples/s and 0.44x its time
    # to 51.4% (docs/benchmarks.md).
    "30m": Size(Build(hidden=512, layers=8, heads=8, num_sft=57600, epochs=1, batch_size=32,
                      sft_lr=3e-4), ARITH_TASK, steps=40, lr=3e-5, eta=1),
    # SmolLM2-135M-Instruct (134.5M parameters, 49k vocabulary): the word-problems
    # example's settings, eta 1 as at 30M.
    "real": Size(None, WORDS_TASK, steps=16, lr=2.5e-5, eta=1),
}  # fmt: skip

#: The issue's targets, asyncrl / TRL: samples/s at least, time to accuracy at most.
TARGETS: dict[str, dict[str, float]] = {
    "0.5m": {"samples/s": 1.0},
    "30m": {"samples/s": 2.0, "time_to_accuracy": 0.5},
    "real": {"samples/s": 2.0, "time_to_accuracy": 0.5},
}


def load_module(name: str, path: Path) -> ModuleType:
    """Import the file ``path`` as ``name`` (the example scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of ``path`` (none if it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- models ---------------------------------------------------------------------------


def count_params(model_dir: Path) -> int:
    """Parameters stored in the checkpoint (tied embeddings once)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            total += math.prod(f.get_slice(key).get_shape())
    return total


def build_model(size: str, dest: Path, seed: int) -> dict[str, Any]:
    """Build ``size``'s starting checkpoint into ``dest`` with make_model.py's recipe."""
    shape = SIZES[size].build
    assert shape is not None, f"{size} is not built here"
    make_model = load_module("arith_make_model", ARITH / "make_model.py")
    work = dest.parent / f"{dest.name}-work"
    shutil.rmtree(work, ignore_errors=True)
    args = argparse.Namespace(hidden=shape.hidden, layers=shape.layers, heads=shape.heads,
                              seed=seed, num_sft=shape.num_sft, epochs=shape.epochs,
                              batch_size=shape.batch_size, lr=shape.sft_lr,
                              label_smoothing=0.1)  # fmt: skip
    start = time.perf_counter()
    subprocess.run([sys.executable, str(ARITH / "make_data.py"), "--out", str(work / "data"),
                    "--seed", str(seed), "--num-sft", str(shape.num_sft)],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    make_model.build_init(work / "init", args)
    command = make_model.sft_command(
        work / "init", work / "sft", args, data=work / "data" / "sft.jsonl"
    )
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    part = dest.with_name(f"{dest.name}.part")  # renamed whole: a kill leaves no half model
    shutil.rmtree(part, ignore_errors=True)
    install(make_model, work, part)
    info = {"size": size, "build": dataclasses.asdict(shape), "seed": seed,
            "seconds": time.perf_counter() - start}  # fmt: skip
    write_json(part / "build.json", info)
    shutil.rmtree(dest, ignore_errors=True)
    part.rename(dest)
    shutil.rmtree(work, ignore_errors=True)
    return info


def install(make_model: ModuleType, work: Path, dest: Path) -> None:
    """Copy the SFT weights and the tokenizer files into ``dest``, as make_model.py does."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in make_model.MODEL_FILES:
        shutil.copy2(work / "sft" / "model" / name, dest / name)
    for path in (work / "init").iterdir():
        if path.name.startswith("tokenizer") or path.suffix == ".jinja":
            shutil.copy2(path, dest / path.name)


def built_model(size: str, cache: Path) -> dict[str, Any] | None:
    """``size``'s checkpoint, its parameter count and build time; None if not built yet."""
    if SIZES[size].build is None:
        from asyncrl.model_zoo import smollm2_dir

        path = smollm2_dir()
        return {"path": str(path), "params": count_params(path), "build_s": None, "build": {}}
    dest = cache / size
    if not (dest / "model.safetensors").exists():
        return None
    info = read_json(dest / "build.json")
    return {"path": str(dest), "params": count_params(dest), "build_s": info.get("seconds"),
            "build": info}  # fmt: skip


def ensure_model(size: str, cache: Path, seed: int) -> dict[str, Any]:
    """``size``'s checkpoint (built when missing), its parameter count and build time."""
    if (model := built_model(size, cache)) is not None:
        return model
    dest = cache / size
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f".{size}.lock").open("w") as lock:  # two benches sharing --cache: one builds
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another bench building the {size} model in {cache} ...",
                  flush=True)  # fmt: skip
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / "model.safetensors").exists():  # another bench may have built it
            print(f"building the {size} model into {dest} ...", flush=True)
            build_model(size, dest, seed)
    model = built_model(size, cache)
    assert model is not None
    return model


# -- the timed runs (each in a child process: ``--worker FRAMEWORK --spec FILE``) ------


#: asyncrl's flags per ``--dtype``. bf16: the trainer as TRL's ``bf16=True`` (fp32
#: master weights, bf16 autocast), and the engine samples from bf16 weights, as TRL's
#: ``generate`` runs under the same autocast.
DTYPE_FLAGS = {
    "float32": ["--trainer.dtype", "float32"],
    "bf16": ["--trainer.dtype", "bf16-mixed", "--rollout.engine.dtype", "bfloat16"],
}


def asyncrl_flags(spec: dict[str, Any]) -> list[str]:
    """``asyncrl train`` flags for ``spec`` on top of the demo's config."""
    sampling = {"temperature": spec["temperature"], "top_p": 1.0,
                "max_new_tokens": spec["max_new_tokens"]}  # fmt: skip
    seed = str(spec["seed"])
    return ["--name", "vs-trl-asyncrl", "--output-dir", spec["out"], "--seed", seed,
            "--prompt-data", spec["train"], "--hf-checkpoint", spec["model"],
            "--rollout.engine.model-path", spec["model"], "--lr", str(spec["lr"]),
            "--rollout-batch-size", str(spec["groups"]),
            "--n-samples-per-prompt", str(spec["samples"]),
            "--buffer.filters", json.dumps(spec.get("filters", [])),
            "--rollout.sampling", json.dumps(sampling), "--rm-type", spec["reward"],
            "--train.num-steps", str(spec["steps"]), "--save-interval", str(spec["save_every"]),
            "--eval-interval", "0", "--kl-coef", "0", "--use-kl-loss", "false",
            "--entropy-coef", "0", "--eps-clip", "0.2", "--loss-aggregation", "token-mean",
            "--clip-grad", "1.0", "--weight-decay", "0", "--trainer.lr-schedule", "constant",
            "--lr-warmup-iters", "0", *DTYPE_FLAGS[spec.get("dtype", "float32")],
            "--trainer.seed", seed, "--rollout-seed", seed,
            "--buffer.max-staleness", str(spec["eta"]), "--train.audit-log", "true",
            *truncated_flags(spec)]  # fmt: skip


def truncated_flags(spec: dict[str, Any]) -> list[str]:
    """asyncrl's reward flag for ``--truncated-reward``; ``null`` (scored as any other)
    where the spec has none, as TRL's side, whatever the example's config says."""
    value = spec.get("truncated_reward")
    return ["--rollout.reward.truncated", "null" if value is None else str(value)]


def run_asyncrl(spec: dict[str, Any]) -> None:
    """The asyncrl job, in this process's event loop (its actors are child processes)."""
    import asyncio

    from asyncrl.config import load_config
    from asyncrl.job import run_job

    cfg = load_config(spec["config"], overrides=asyncrl_flags(spec))
    result = asyncio.run(run_job(cfg))
    if not result.ok:
        raise SystemExit(f"asyncrl: {result.error or result.codes}")


def render(prompt: Any, tokenizer: Any, chat: bool) -> str:
    """A prompt as asyncrl's data source renders it: raw text, or chat messages through
    the model's template with the assistant turn opened."""
    if not chat:
        return prompt
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)


def trl_dataset(spec: dict[str, Any], tokenizer: Any) -> Any:
    """``prompt`` and ``label`` columns of the task's training data, and ``row``, each one's
    row in the file (recorded by ``TaskReward``). Chat prompts stay messages (TRL renders
    them with the same template); checked to give asyncrl's ids."""
    from datasets import Dataset

    rows = read_jsonl(Path(spec["train"]))
    for row in rows[:32]:  # TRL tokenizes with special tokens, asyncrl without: same ids?
        text = render(row["prompt"], tokenizer, spec["chat"])
        if tokenizer(text)["input_ids"] != tokenizer(text, add_special_tokens=False)["input_ids"]:
            raise SystemExit(f"the tokenizer adds special tokens to {text!r}")
    order = list(range(len(rows)))
    if spec.get("prompt_order") == "shared":
        order = asyncrl_order(spec, tokenizer)
    rows = [rows[i] for i in order]
    return Dataset.from_dict({"prompt": [r["prompt"] for r in rows],
                              "label": [r["label"] for r in rows], "row": order})  # fmt: skip


def trl_prompts(spec: dict[str, Any]) -> int:
    """The prompts TRL's run draws: one group per prompt, ``groups`` a step."""
    return spec["steps"] * spec["groups"]


def asyncrl_order(spec: dict[str, Any], tokenizer: Any) -> list[int]:
    """The training file's rows (0-based) of the prompts TRL's run takes, in the order the
    asyncrl job of ``spec`` draws them: its data source, configured as the job configures
    it (seed, shuffle, a length limit), drawing across epochs; not a copy of the rule."""
    from asyncrl.buffer.sources import PromptSource
    from asyncrl.config import load_config

    data = load_config(spec["config"], overrides=asyncrl_flags(spec)).data
    if data is None:
        raise SystemExit(f"{spec['config']}: asyncrl's job has no prompt data")
    count = trl_prompts(spec)
    data = data.model_copy(update={"num_epochs": count, "num_rollouts": None})
    source = PromptSource.open(data, tokenizer if data.max_prompt_length else None)
    return [row_of(p.prompt_id) for p in source.take(count)]


def row_of(prompt_id: str) -> int:
    """The training file's row (0-based) of an asyncrl prompt id or group uid:
    ``NAME:ROW`` or ``NAME:ROW@N``."""
    return int(prompt_id.rpartition(":")[2].partition("@")[0])


def matches(kind: str, text: str, label: str) -> bool:
    """asyncrl's built-in reward ``kind`` (exact or numeric) on one reply, as a bool."""
    from asyncrl.rollout.rewards import exact_match, extract_answer, numeric_match

    answer = extract_answer(text)
    return numeric_match(answer, label) if kind == "numeric" else exact_match(answer, label)


def task_score(kind: str, text: str, label: str, cut_off: bool, truncated: float | None) -> float:
    """The task's reward of one reply: ``truncated`` for one cut off at the budget where
    set (``--truncated-reward``), else 1.0 if it ``matches``, 0.0 if not."""
    if cut_off and truncated is not None:
        return truncated
    return float(matches(kind, text, label))


class TaskReward:
    """asyncrl's reward of the task for TRL; records each call's samples, completion
    tokens, mean reward, the share of replies cut off at the budget (``budget`` tokens
    without an end token among ``stops``) and the training file's rows it scored."""

    def __init__(
        self,
        kind: str,
        budget: int = 0,
        stops: frozenset[int] = frozenset(),
        truncated: float | None = None,
        samples: int = 1,
    ) -> None:
        self.kind, self.__name__ = kind, kind
        self.budget, self.stops, self.truncated = budget, stops, truncated
        self.samples = samples  # a group's, consecutive in TRL's batch
        self.calls: list[dict[str, Any]] = []

    def _cut_off(self, ids: list[int]) -> bool:
        return len(ids) >= self.budget and not (ids and ids[-1] in self.stops)

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        label: list[str],
        row: list[int] | None = None,
        **_: Any,
    ) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        cuts = [bool(self.budget) and self._cut_off(ids) for ids in completion_ids]
        scores = [task_score(self.kind, t, want, cut, self.truncated)
                  for t, want, cut in zip(texts, label, cuts, strict=True)]  # fmt: skip
        cut = statistics.fmean(cuts) if self.budget else None
        self.calls.append({"samples": len(scores), "tokens": sum(map(len, completion_ids)),
                           "reward": statistics.fmean(scores), "truncated": cut,
                           "scored_at": time.time()})  # fmt: skip  # generation's end
        if row is not None:
            self.calls[-1]["rows"] = row[:: self.samples]  # one a group
        return scores


def trl_config(spec: dict[str, Any]) -> Any:
    """``GRPOConfig`` with asyncrl's settings (see the module docstring)."""
    from trl import GRPOConfig

    batch = spec["groups"] * spec["samples"]
    micro = min(spec["trl_micro"] or batch, batch)
    if batch % micro:
        raise SystemExit(f"TRL's micro-batch {micro} must divide the step's {batch} samples")
    # One generation of the whole step, trained in batch / micro accumulated micro-batches.
    return GRPOConfig(
        output_dir=spec["out"], use_cpu=True, bf16=spec.get("dtype") == "bf16", fp16=False,
        seed=spec["seed"],
        max_steps=spec["steps"], per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro, num_generations=spec["samples"],
        num_iterations=1, max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"], top_p=1.0, top_k=0,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", gradient_checkpointing=False, use_vllm=False,
        save_strategy="steps", save_steps=spec["save_every"], logging_steps=1,
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
        shuffle_dataset=spec.get("prompt_order") != "shared",  # shared: trl_dataset's order
    )  # fmt: skip


def run_trl(spec: dict[str, Any]) -> None:
    """TRL's GRPOTrainer; writes ``timeline.json`` (step ends, saves, tokens) to ``out``."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from transformers.trainer_callback import PrinterCallback
        from trl import GRPOTrainer
    except ImportError as exc:
        raise SystemExit(f"{MISSING_BENCH} ({exc})") from None

    class Clock(TrainerCallback):
        """Wall time at each step's end and at each save (seconds since step end)."""

        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.saves: list[dict[str, float]] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self.steps.append({"step": state.global_step, "time": time.time()})

        def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            now = time.time()
            self.saves.append({"step": state.global_step, "time": now,
                               "seconds": now - self.steps[-1]["time"]})  # fmt: skip

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    # TRL stops on the tokenizer's end token and the generation config's: either ends a reply.
    stops = frozenset(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    stops -= {None}
    reward = TaskReward(spec["reward"], spec["max_new_tokens"], stops,
                        spec.get("truncated_reward"), spec["samples"])  # fmt: skip
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=trl_config(spec),
                          train_dataset=trl_dataset(spec, tokenizer),
                          processing_class=tokenizer, callbacks=[clock])  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # a dict on stdout every step
    trainer.train()
    if len(reward.calls) != len(clock.steps):
        raise SystemExit(f"trl: {len(reward.calls)} generations for {len(clock.steps)} steps")
    steps = [step | call for step, call in zip(clock.steps, reward.calls, strict=True)]
    timeline = {"steps": steps, "saves": clock.saves, "threads": torch.get_num_threads()}
    (Path(spec["out"]) / "timeline.json").write_text(json.dumps(timeline, indent=2) + "\n")


def worker(framework: str, spec_path: Path, parent: int | None, hold: int | None) -> None:
    """Run one framework's timed run as described by the spec file. ``parent``: the bench,
    whose death stops this run; ``hold``: the ``--work`` lock, held to this process's exit
    and not passed on to what it starts."""
    tie_to_parent(signal.SIGTERM, parent)  # a killed bench leaves no run training on
    if hold is not None:
        os.set_inheritable(hold, False)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames
    spec = json.loads(spec_path.read_text())
    (run_asyncrl if framework == "asyncrl" else run_trl)(spec)


def launch(framework: str, spec: dict[str, Any], hold: int | None = None) -> dict[str, float]:
    """Run ``framework`` on ``spec`` in a fresh child process; its launch and end times.
    ``hold``: the ``--work`` lock's descriptor, which the child holds too, so a rerun is
    refused until a run outliving a killed bench has stopped."""
    out = Path(spec["out"])
    clock_path(out).unlink(missing_ok=True)  # a run that fails now leaves no finished mark
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec_path = out.parent / f"{out.name}.spec.json"
    write_json(spec_path, spec)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", framework,
               "--spec", str(spec_path), "--parent", str(os.getpid())]  # fmt: skip
    if hold is not None:
        command += ["--hold", str(hold)]
    files = training_files(spec)  # what it trains from: a file edited meanwhile is caught
    t0, cpu0 = time.time(), hardware.cpu_times()
    rc = run_to_end(command, pass_fds=() if hold is None else (hold,))
    end, cpu1 = time.time(), hardware.cpu_times()
    if rc != 0:
        raise RuntimeError(f"{framework} run failed (exit {rc}): {out}")
    drop_training_state(out)
    clock = {"t0": t0, "end": end, "commit": commit(), "cpu": hardware.cpu_shares(cpu0, cpu1)}
    mark_trained(spec, clock, files)
    return clock


def mark_trained(spec: dict[str, Any], clock: dict[str, Any], files: dict[str, str]) -> None:
    """Keep a finished run's clock beside its spec (paths relative to ``spec_roots``) and
    the hashes of the files it trained from (``training_files`` at its launch)."""
    record = {"spec": portable(spec, spec_roots(spec)), "clock": clock, "files": files}
    write_json(clock_path(Path(spec["out"])), record)


def training_files(spec: dict[str, Any]) -> dict[str, str]:
    """sha256 of the config and prompts a run trains from."""
    return {k: sha256(Path(spec[k])) for k in ("config", "train")}


#: A finished run's checkpoint entries that scoring never reads: TRL's files, asyncrl's
#: folders (``step_N/optimizer``, ``step_N/rng``).
TRAINING_STATE = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "optimizer", "rng")


def drop_training_state(out: Path) -> None:
    """Delete the optimizer, scheduler and RNG states of ``out``'s checkpoints."""
    checkpoints = [*out.glob("checkpoint-*"), *(out / "checkpoints" / "trainer").glob("step_*")]
    for entry in (c / name for c in checkpoints for name in TRAINING_STATE):
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)


def drop_checkpoints(out: Path) -> None:
    """Once a seed is scored (its ``result.json`` holds every curve): delete ``out``'s
    checkpoints (about 4 GB a side on the real model) and mark its clock, so the run is
    not taken as one that could be scored again."""
    saved = read_json(clock_path(out))
    if not saved or saved.get("checkpoints_dropped"):
        return
    for checkpoint in [*out.glob("checkpoint-*"), out / "checkpoints"]:
        shutil.rmtree(checkpoint, ignore_errors=True)
    write_json(clock_path(out), saved | {"checkpoints_dropped": True})


def clock_path(out: Path) -> Path:
    """Where a finished run's launch and end times are kept, beside its spec."""
    return out.parent / f"{out.name}.clock.json"


def trained(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The clock of a run of ``spec`` that finished earlier (its outputs kept), or None:
    scoring that stopped part way does not train the seed again."""
    saved = read_json(clock_path(Path(spec["out"])))
    found = saved and not run_differences(saved, spec)
    found = found and not saved.get("checkpoints_dropped")  # nothing left to score
    return saved["clock"] if found and Path(spec["out"]).is_dir() else None


#: Spec entries only the scoring reads: changing one rescores a seed, never retrains it.
SCORING_ONLY = ("test", "eval_samples")


def spec_roots(spec: dict[str, Any]) -> list[Path]:
    """What a spec's paths are made relative to: its ``--work`` (``out`` is
    ``WORK/SIZE/seed_S/FRAMEWORK``) and the checkout."""
    return [Path(spec["out"]).parents[2], ROOT]


def training_differences(saved: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """The training settings in which a kept run's spec differs from ``spec`` (paths
    compared relative to ``spec_roots``: a moved folder or checkout is the same run)."""
    roots = spec_roots(spec)
    old, new = ({k: v for k, v in portable(s, roots).items() if k not in SCORING_ONLY}
                for s in (saved, spec))  # fmt: skip
    return key_differences(old, new)


def run_differences(kept: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """How a kept clock's run differs from what ``spec`` would train: its settings, and
    the files' contents (a clock from before the hashes were kept has none to compare)."""
    files = kept.get("files", {})
    changed = [f"files.{k}" for k, v in training_files(spec).items() if files.get(k, v) != v]
    return training_differences(kept.get("spec", {}), spec) + changed


# -- what the runs left: steps, checkpoints -------------------------------------------


def asyncrl_timeline(out: Path, groups: int, samples: int) -> dict[str, Any]:
    """Steps from ``metrics.jsonl`` (trained samples: the groups not dropped as failed;
    the training file's rows of its batch's groups from ``trained.jsonl``, the audit log) and
    checkpoints ``checkpoints/trainer/step_N/policy`` (each at its step's end; save
    seconds from the files' modification times)."""
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "step" in r and "num_tokens" in r]
    steps = [{"step": int(r["step"]), "time": float(r["time"]),
              "samples": (groups - int(r.get("batch/dropped_groups", 0))) * samples,
              "tokens": float(r["num_tokens"]), "reward": r.get("reward/mean"),
              "truncated": r.get("response/truncated"), "train_s": r.get("time/step"),
              "wait_s": r.get("time/wait_data"), "publish_s": r.get("time/publish")}
             for r in rows]  # fmt: skip
    # the audit's "version" is the step it trained, counted from 1 as metrics.jsonl's
    batched = {int(r["version"]): [row_of(g) for g in r["groups"]]
               for r in read_jsonl(out / "trained.jsonl") if r.get("trained")}  # fmt: skip
    for step in steps:
        if step["step"] in batched:
            step["rows"] = batched[step["step"]]
    at = {s["step"]: s["time"] for s in steps}
    checkpoints = []
    for path in sorted((out / "checkpoints" / "trainer").glob("step_*")):
        policy = path / "policy"
        if path.suffix or not (policy / "model.safetensors").exists():
            continue  # .tmp / .old: a save in progress
        step = int(path.name.removeprefix("step_"))
        save_s = (path / "trainer.json").stat().st_mtime - (policy / "config.json").stat().st_mtime
        checkpoints.append({"step": step, "path": str(policy), "time": at.get(step),
                            "save_s": save_s})  # fmt: skip
    return {"steps": steps, "checkpoints": checkpoints}


def trl_timeline(out: Path) -> dict[str, Any]:
    """Steps and saves recorded by the TRL worker, checkpoints ``checkpoint-N``."""
    recorded = json.loads((out / "timeline.json").read_text())
    at = {s["step"]: s["time"] for s in recorded["steps"]}
    saves = {s["step"]: s["seconds"] for s in recorded["saves"]}
    checkpoints = [
        {"step": int(p.name.removeprefix("checkpoint-")), "path": str(p)}
        for p in out.glob("checkpoint-*")
        if (p / "model.safetensors").exists()
    ]
    for c in checkpoints:
        c |= {"time": at.get(c["step"]), "save_s": saves.get(c["step"])}
    checkpoints.sort(key=lambda c: c["step"])
    return {"steps": trl_phases(recorded["steps"], saves), "checkpoints": checkpoints,
            "threads": recorded["threads"]}  # fmt: skip


def trl_phases(steps: list[dict[str, Any]], saves: dict[int, float]) -> list[dict[str, Any]]:
    """Each step's ``train_s`` (its end less when its generation was scored) and, after
    the first, ``generate_s`` (from the previous step's end and save to that scoring)."""
    out = []
    for prev, step in zip([None, *steps], steps, strict=False):
        if "scored_at" not in step:  # recorded before the split was
            out.append(step)
            continue
        phase = {"train_s": step["time"] - step["scored_at"]}
        if prev is not None:
            begun = prev["time"] + saves.get(prev["step"], 0.0)
            phase["generate_s"] = step["scored_at"] - begun
        out.append(step | phase)
    return out


def shared_prompts(steps: dict[str, list[dict[str, Any]]]) -> dict[str, float] | None:
    """How alike the two sides' prompts were, from each step's training-file ``rows``:
    ``per_step``, the mean over TRL's steps of the share of its groups asyncrl batched at
    the same step; ``run``, the share of TRL's groups asyncrl batched at any step (a group
    whose samples all failed is batched, not trained: rare). None where a side recorded
    no rows (a run trained before this was recorded: ``--fresh`` trains it again)."""
    rows = {fw: {s["step"]: s["rows"] for s in steps.get(fw, []) if s.get("rows")}
            for fw in FRAMEWORKS}  # fmt: skip
    a, t = rows["asyncrl"], rows["trl"]
    if not (a and t):
        return None
    per_step = [len(set(a.get(step, ())) & set(groups)) / len(groups) for step, groups in t.items()]
    anywhere = set().union(*a.values())
    every = [row for groups in t.values() for row in groups]
    return {"per_step": statistics.fmean(per_step),
            "run": sum(row in anywhere for row in every) / len(every)}  # fmt: skip


def relative(step: dict[str, Any], t0: float) -> dict[str, Any]:
    """A step's record with its times in seconds since launch."""
    return step | {k: step[k] - t0 for k in ("time", "scored_at") if k in step}


def figures(steps: list[dict[str, Any]], clock: dict[str, float]) -> dict[str, Any]:
    """Throughput over the steady state (steps after the first), start-up and wall time."""
    if len(steps) < 2:
        raise RuntimeError(f"only {len(steps)} steps recorded: no steady state to measure")
    span = steps[-1]["time"] - steps[0]["time"]
    steady = steps[1:]
    rewards = [s["reward"] for s in steps if s.get("reward") is not None]
    keys = ("train_s", "wait_s", "publish_s", "generate_s")
    phases = {f"{k}_mean": statistics.fmean(v) for k in keys
              if (v := [s[k] for s in steady if s.get(k) is not None])}  # fmt: skip
    run = {
        "steps": len(steps),
        "samples/s": sum(s["samples"] for s in steady) / span,
        "tokens/s": sum(s["tokens"] for s in steady) / span,
        "step_s": span / len(steady),
        "first_step_s": steps[0]["time"] - clock["t0"],
        "wall_s": clock["end"] - clock["t0"],
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
    }
    return phases | run | machine_shares(clock.get("cpu"))


def machine_shares(cpu: dict[str, float] | None) -> dict[str, float]:
    """The machine's CPU over a run: the share its cores were busy (user, nice, system)
    and the share the host took (a VM's neighbours); empty for a run kept from before it
    was recorded."""
    if not cpu:
        return {}
    busy = sum(cpu.get(k, 0.0) for k in ("user", "nice", "system"))
    return {"cpu_busy": busy, "cpu_steal": cpu.get("steal", 0.0)}


# -- held-out accuracy ----------------------------------------------------------------


class Evaluator:
    """pass@1 of a checkpoint at the task's temperature: ``n`` samples for each of
    ``rows``, Hugging Face ``generate`` through ``examples/arith/evaluate.py``, scored by
    the task's reward, the same seed for every model."""

    def __init__(self, tokenizer_dir: Path, rows: list[dict[str, Any]], spec: dict[str, Any]):
        from transformers import AutoTokenizer

        self.arith = load_module("arith_evaluate", ARITH / "evaluate.py")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.tokenizer.padding_side = "left"  # generate continues each prompt's last token
        texts = [render(r["prompt"], self.tokenizer, spec["chat"]) for r in rows]
        self.rows = sorted(zip(texts, [r["label"] for r in rows], strict=True),
                           key=lambda r: len(r[0]))  # fmt: skip  # batches of like lengths
        self.n, self.seed = spec["eval_samples"], spec["seed"]
        self.temperature, self.reward = spec["temperature"], spec["reward"]
        self.max_new_tokens, self.truncated = spec["max_new_tokens"], spec.get("truncated_reward")
        self.batch = max(1, 256 // self.n)

    def __call__(self, model_dir: str) -> float:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(self.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        correct = 0
        for lo in range(0, len(self.rows), self.batch):
            chunk = self.rows[lo : lo + self.batch]
            samples = self.arith.generate(model, self.tokenizer, [text for text, _ in chunk],
                                          n=self.n, temperature=self.temperature,
                                          max_new_tokens=self.max_new_tokens)  # fmt: skip
            for (_, label), drawn in zip(chunk, samples, strict=True):
                correct += sum(
                    task_score(self.reward, t, label, not ended, self.truncated) >= 1.0
                    for t, _, ended in drawn
                )
        return correct / (self.n * len(self.rows))


class EngineEvaluator:
    """pass@1 of a checkpoint at the task's temperature by ``asyncrl eval``'s code: the
    embedded engine (``dtype`` weights, every core) samples all ``n`` x ``rows`` at once with
    continuous batching, from the same seeded stream for every checkpoint, scored by the
    task's reward. Checkpoints of both frameworks are plain HF folders."""

    def __init__(
        self, spec: dict[str, Any], rows: int, dtype: str = "float32", running: int | None = None
    ) -> None:
        from asyncrl.config import load_config

        sampling = {"temperature": spec["temperature"], "top_p": 1.0,
                    "max_new_tokens": spec["max_new_tokens"]}  # fmt: skip
        test = [{"name": "test", "path": f"{spec['test']}@[0:{rows}]",
                 "n_samples": spec["eval_samples"], "pass_k": [1],
                 "apply_chat_template": spec["chat"], "sampling": sampling}]  # fmt: skip
        flags = ["--seed", str(spec["seed"]), "--eval.sets", json.dumps(test),
                 "--rm-type", spec["reward"], "--rollout.engine.dtype", dtype,
                 *truncated_flags(spec)]  # fmt: skip
        if running is not None:  # else the config's (64): a batch-size changes the draws
            flags += ["--rollout.engine.max-running", str(running)]
        self.cfg = load_config(spec["config"], overrides=flags)

    def __call__(self, model_dir: str) -> float:
        import asyncio

        from asyncrl.offline_eval import evaluate_model

        rows = asyncio.run(evaluate_model(self.cfg, Path(model_dir)))
        return float(rows[0]["pass@1"])


def make_evaluator(
    kind: str,
    model: dict[str, Any],
    spec: dict[str, Any],
    rows: int,
    dtype: str = "float32",
    running: int | None = None,
) -> Evaluator | EngineEvaluator:
    """``--evaluator``: ``engine`` (asyncrl's, the default) or ``hf`` (``generate``)."""
    if kind == "engine":
        return EngineEvaluator(spec, rows, dtype, running)
    return Evaluator(Path(model["path"]), read_jsonl(Path(spec["test"]))[:rows], spec)


class ScoreCache:
    """An evaluator whose scores are kept in ``path`` under the seed's ``key`` as each is
    made, so a comparison stopped while scoring goes on from the next checkpoint.
    ``trained``: each side's launch time; scores of another training (a side trained
    again) are not read. Files written before it was kept hold none and are read."""

    def __init__(
        self,
        path: Path,
        key: dict[str, Any],
        evaluate: Callable[[str], float],
        trained: dict[str, float] | None = None,
    ):
        self.path, self.key, self.evaluate, self.trained = path, key, evaluate, trained or {}
        saved = read_json(path)
        same = saved.get("key") == key and saved.get("trained", self.trained) == self.trained
        self.scores: dict[str, float] = saved.get("scores", {}) if same else {}

    def __call__(self, checkpoint: str | Path) -> float:
        path = str(checkpoint)
        name = portable(path, [self.path.parent])  # the seed's folder may move (a checkout)
        if path in self.scores:  # named whole by a bench before 2026-11-30
            self.scores[name] = self.scores.pop(path)
        if name not in self.scores:
            self.scores[name] = self.evaluate(path)
            write_json(self.path, {"key": self.key, "trained": self.trained, "scores": self.scores})
        return self.scores[name]

    def has(self, checkpoint: str | Path) -> bool:
        path = str(checkpoint)
        return path in self.scores or portable(path, [self.path.parent]) in self.scores


def accuracy_curve(
    timeline: dict[str, Any],
    t0: float,
    start: float,
    evaluator: ScoreCache,
    scored_only: bool = False,
) -> list[dict[str, Any]]:
    """Accuracy at launch (the starting checkpoint) and at every saved checkpoint (with
    ``scored_only``, at those ``evaluator`` has scored so far)."""
    curve = [{"step": 0, "time_s": 0.0, "accuracy": start}]
    for c in timeline["checkpoints"]:
        if c["time"] is None:
            continue  # a checkpoint without a recorded step (the final one on stop)
        if scored_only and not evaluator.has(c["path"]):
            continue
        point = {"step": c["step"], "time_s": c["time"] - t0, "save_s": c["save_s"]}
        curve.append(point | {"accuracy": evaluator(c["path"])})
        if not scored_only:
            print(f"  step {c['step']:>4}: accuracy {curve[-1]['accuracy']:.1%}", flush=True)
    return curve


def coarse_first(sides: dict[str, list[Any]]) -> list[tuple[str, Any]]:
    """Each side's checkpoints (given in step order) in the order that leaves a stopped
    scoring most use: every side's last, then the grid halved again and again (steps
    2..16: 16, then 8, then 4 and 12, then 2, 6, 10, 14), the sides alternating within a
    level. What is scored so far is then a coarser grid."""
    return [(side, item) for _, side, item in sorted(coarse_ranks(sides), key=lambda r: r[0])]


def coarse_ranks(sides: dict[str, list[Any]]) -> list[tuple[tuple[int, int, int], str, Any]]:
    """``coarse_first``'s order as a sort key per checkpoint: ``(level, place in the
    level, side)``."""
    ranked = []
    for order, (side, items) in enumerate(sides.items()):
        levels = [level for level, _ in halvings(len(items))]
        for k, (level, index) in enumerate(halvings(len(items))):
            ranked.append(((level, k - levels.index(level), order), side, items[index]))
    return ranked


def halvings(n: int) -> list[tuple[int, int]]:
    """``(level, index)`` for indices ``0..n-1``: the last at level 0, then the midpoint
    of each gap left (the start counts as index -1), one level deeper per halving."""
    out, gaps, level = ([(0, n - 1)] if n else []), [(-1, n - 1)], 0
    while gaps:
        level += 1
        wide = [(lo, hi) for lo, hi in gaps if hi - lo > 1]
        mids = [(lo + hi + 1) // 2 for lo, hi in wide]
        out += [(level, mid) for mid in mids]
        pairs = zip(wide, mids, strict=True)
        gaps = [gap for (lo, hi), mid in pairs for gap in ((lo, mid), (mid, hi))]
    return out


def partial_runs(
    runs: dict[str, dict[str, Any]],
    timelines: dict[str, tuple[dict[str, Any], dict[str, float]]],
    start: float,
    evaluator: ScoreCache,
) -> dict[str, dict[str, Any]]:
    """Each side's figures with the curve of the checkpoints scored so far."""
    out = {fw: dict(run) for fw, run in runs.items()}
    for fw, (timeline, clock) in timelines.items():
        curve = accuracy_curve(timeline, clock["t0"], start, evaluator, scored_only=True)
        out[fw] |= {"curve": curve, "scored_steps": [p["step"] for p in curve[1:]]}
    return {fw: run for fw, run in out.items() if len(run.get("curve", [])) > 1}


def time_to(curve: list[dict[str, Any]], target: float) -> float | None:
    """Wall seconds to the first point of ``curve`` at ``target`` accuracy or above."""
    return next((p["time_s"] for p in curve if p["accuracy"] >= target - 1e-12), None)


def compare(
    size: str, runs: dict[str, dict[str, Any]], start: float, scored: int = 0
) -> dict[str, Any]:
    """Ratios asyncrl / TRL, the common accuracy target and the issue's targets met.

    The target must clear the start by more than ``noise_floor``; below that a "gain" is
    noise, and no time to accuracy is reported.
    """
    if set(FRAMEWORKS) - set(runs):
        return {}
    a, t = runs["asyncrl"], runs["trl"]
    target = min(max(p["accuracy"] for p in runs[fw]["curve"][1:]) for fw in FRAMEWORKS)
    noise = noise_floor(start, scored)
    out: dict[str, Any] = {"samples/s": a["samples/s"] / t["samples/s"],
                           "tokens/s": a["tokens/s"] / t["tokens/s"],
                           "target_accuracy": target, "time_to_accuracy": None,
                           "noise": noise}  # fmt: skip
    if target > start + noise:
        for fw in FRAMEWORKS:
            runs[fw]["time_to_accuracy_s"] = time_to(runs[fw]["curve"], target)
        out["time_to_accuracy"] = a["time_to_accuracy_s"] / t["time_to_accuracy_s"]
    else:
        for fw in FRAMEWORKS:
            runs[fw]["time_to_accuracy_s"] = None
        out["note"] = (f"the accuracy both reach ({target:.1%}) is within two standard "
                       f"errors ({noise:.1%}) of the start ({start:.1%}): no time to "
                       "accuracy")  # fmt: skip
    out["targets"] = {key: {"want": want, "met": _met(key, out[key], want)}
                      for key, want in TARGETS[size].items()}  # fmt: skip
    return out


def noise_floor(start: float, scored: int) -> float:
    """Two standard errors of the difference of two accuracies, each measured on ``scored``
    samples at the start's ``p``: ``2 sqrt(2 p (1 - p) / scored)``, at least
    ``2 / scored`` (0 when nothing says how many were scored)."""
    if not scored:
        return 0.0
    return 2 * max(math.sqrt(2 * start * (1 - start) / scored), 1 / scored)


def _met(key: str, ratio: float | None, want: float) -> bool | None:
    if ratio is None:
        return None
    return ratio <= want if key == "time_to_accuracy" else ratio >= want


# -- one size, the report -------------------------------------------------------------


def run_spec(
    args: argparse.Namespace, size: str, model: str, framework: str, seed: int
) -> dict[str, Any]:
    """The settings both frameworks share, and where this run writes: the size's task
    and defaults, where a flag does not set them."""
    sz, task = SIZES[size], SIZES[size].task

    def pick(flag: Any, default: Any) -> Any:
        return default if flag is None else flag

    spec = {"model": model, "config": str(task.config),
            "train": str(pick(args.train, task.train)),
            "test": str(pick(args.test, task.test)), "reward": task.reward,
            "temperature": task.temperature, "chat": task.chat, "trl_micro": task.trl_micro,
            "out": str(args.work / size / f"seed_{seed}" / framework),
            "steps": pick(args.steps, sz.steps),
            "groups": pick(args.groups, task.groups), "samples": pick(args.samples, task.samples),
            "eval_samples": pick(args.eval_samples, task.eval_samples),
            "lr": pick(args.lr, sz.lr), "seed": seed, "save_every": args.save_every,
            "max_new_tokens": args.max_new_tokens, "eta": pick(args.eta, sz.eta),
            "dtype": args.dtype}  # fmt: skip
    return spec | shared_extras(args) | asyncrl_only(args, framework) | trl_only(args, framework)


def shared_extras(args: argparse.Namespace) -> dict[str, Any]:
    """Settings of both sides added since the first series: keyed only when set, so the
    seeds run without them stay valid."""
    if args.truncated_reward is None:
        return {}
    return {"truncated_reward": args.truncated_reward}


def trl_only(args: argparse.Namespace, framework: str) -> dict[str, Any]:
    """TRL's own settings: the prompts' order (asyncrl's run does not depend on it, so a
    kept asyncrl run stays reusable); keyed only when shared."""
    if framework != "trl" or args.prompt_order != "shared":
        return {}
    return {"prompt_order": "shared"}


def asyncrl_only(args: argparse.Namespace, framework: str) -> dict[str, Any]:
    """asyncrl's own settings beyond the shared ones: keyed only when set, so the seeds
    run without them stay valid (and their TRL runs reusable: ``reusable_side``)."""
    if framework != "asyncrl" or not args.asyncrl_filters:
        return {}
    return {"filters": list(args.asyncrl_filters)}


def seed_order(index: int, frameworks: list[str]) -> list[str]:
    """The frameworks' order for the ``index``-th seed: reversed every other seed, so
    neither always runs on a machine the other has just warmed (page cache, clocks)."""
    return list(frameworks) if index % 2 == 0 else list(reversed(frameworks))


def run_seed(
    args: argparse.Namespace, size: str, model: dict[str, Any], seed: int, index: int
) -> dict[str, Any]:
    """Both frameworks on ``size`` with ``seed``, back to back, then every checkpoint's
    held-out accuracy; read from ``seed_S/result.json`` when it holds these settings."""
    key = seed_key(args, size, model, seed)
    done, reuse = kept_seed(args, size, seed, key)
    if done is not None:
        return done
    result_path(args, size, seed).unlink(missing_ok=True)  # of other settings: replaced
    result = train_and_score(args, size, model, seed, index, key, reuse)
    return keep_seed(args, size, model, seed, key, result)


def kept_seed(
    args: argparse.Namespace, size: str, seed: int, key: dict[str, Any]
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(result, None)`` where ``seed_S/result.json`` (or ``--results-from``'s) holds these
    settings; else ``(None, reuse)``, ``reuse`` a side lent by ``--results-from`` (see
    ``train_and_score``) or None. A stale result is left for the caller to delete."""
    saved = result_path(args, size, seed)
    kept = [saved] + ([args.results_from / size / f"seed_{seed}" / "result.json"]
                      if args.results_from else [])  # fmt: skip
    reuse: dict[str, Any] | None = None
    for path in kept if not args.fresh else []:
        done = read_json(path)
        if done.get("key") == key:
            print(f"{size} seed {seed}: reusing {path} (at {done['result']['commit']})",
                  flush=True)  # fmt: skip
            return done["result"], None
        # Only another folder lends a side: this seed's own result is replaced below.
        side = reusable_side(done, key) if path.resolve() != saved.resolve() else None
        if side and reuse is None:
            print(f"{size} seed {seed}: reusing {side}'s run and the start's score from "
                  f"{path}: only the other side's settings differ", flush=True)  # fmt: skip
            reuse = {"framework": side, "start": done["result"]["start_accuracy"],
                     "run": lent_run(done["result"]["frameworks"][side], path)}  # fmt: skip
        elif done:  # say why: a changed file or flag costs a whole seed's training again
            differ = ", ".join(key_differences(done.get("key", {}), key))
            print(f"{size} seed {seed}: not reusing {path}: it was run with other {differ}",
                  flush=True)  # fmt: skip
    return None, reuse


def result_path(args: argparse.Namespace, size: str, seed: int) -> Path:
    """Where a scored seed's result is kept (``run_seed``)."""
    return args.work / size / f"seed_{seed}" / "result.json"


def keep_seed(
    args: argparse.Namespace,
    size: str,
    model: dict[str, Any],
    seed: int,
    key: dict[str, Any],
    result: dict[str, Any],
) -> dict[str, Any]:
    """Write a scored seed's ``result.json`` (its partial one deleted) and, unless
    ``--keep-checkpoints``, delete its checkpoints."""
    saved = result_path(args, size, seed)
    result = result | {"commit": commit()}
    write_json(saved, {"key": key, "result": result})
    (saved.parent / "partial_result.json").unlink(missing_ok=True)
    if not args.keep_checkpoints:
        for fw in args.frameworks:
            drop_checkpoints(Path(run_spec(args, size, model["path"], fw, seed)["out"]))
    return result


def train_first(args: argparse.Namespace, size: str, model: dict[str, Any]) -> list[dict]:
    """``--train-first``: every seed's sides trained (or found trained), then scored
    together: every seed's start, then each level of the coarse-first grid across all
    seeds (``score_across``), so a stopped comparison holds a coarse grid of every seed.
    Every seed's checkpoints are kept until the end: refused when the disk cannot hold
    them (``checkpoint_bytes``)."""
    found: dict[int, dict[str, Any]] = {}
    pending: list[tuple[int, int, dict[str, Any], dict[str, Any] | None]] = []
    for index, seed in enumerate(args.seeds):
        key = seed_key(args, size, model, seed)
        done, reuse = kept_seed(args, size, seed, key)
        if done is not None:
            found[seed] = done
        else:
            pending.append((seed, index, key, reuse))
    refuse_short_disk(args, size, model, [(seed, reuse) for seed, _, _, reuse in pending])
    for seed, *_ in pending:
        result_path(args, size, seed).unlink(missing_ok=True)  # of other settings: replaced
    scorings = [train_seed(args, size, model, seed, index, key, reuse)
                for seed, index, key, reuse in pending]  # fmt: skip
    score_across(size, scorings)
    for scoring, (seed, _, key, _) in zip(scorings, pending, strict=True):
        found[seed] = keep_seed(args, size, model, seed, key, finish_seed(size, scoring))
    return [found[seed] for seed in args.seeds]


def checkpoint_bytes(args: argparse.Namespace, size: str, model: dict[str, Any]) -> int:
    """What one side's saved checkpoints take on disk, estimated: one copy of the starting
    model's weight files (float32 on the real model, as both sides save them) for each
    checkpoint, the last step's included."""
    weights = sum(f.stat().st_size for f in Path(model["path"]).glob("*.safetensors"))
    spec = run_spec(args, size, model["path"], "asyncrl", args.seeds[0])
    return weights * math.ceil(spec["steps"] / spec["save_every"])


def refuse_short_disk(
    args: argparse.Namespace,
    size: str,
    model: dict[str, Any],
    pending: list[tuple[int, dict[str, Any] | None]],
) -> None:
    """Refuse ``--train-first`` before anything trains when the free space on ``--work``
    cannot hold the checkpoints of every side still to train (``checkpoint_bytes`` each),
    the optimizer states of the run in progress (AdamW's two moments in every checkpoint
    until it ends: twice its weights) and a tenth more (tokenizers, logs). What an
    interrupted run left in a side's folder counts as free: ``launch`` deletes it."""
    specs = [run_spec(args, size, model["path"], fw, seed)
             for seed, reuse in pending for fw in args.frameworks
             if not (reuse and reuse["framework"] == fw)]  # fmt: skip
    sides = [Path(spec["out"]) for spec in specs if trained(spec) is None]
    need = int(1.1 * (len(sides) + 2 * bool(sides)) * checkpoint_bytes(args, size, model))
    left = sum(f.stat().st_size for out in sides for f in out.rglob("*") if f.is_file())
    free = shutil.disk_usage(args.work).free + left
    if need > free:
        raise SystemExit(
            f"--train-first: the {len(sides)} runs still to train save about "
            f"{need / 1e9:.1f} GB of checkpoints, kept until every seed is scored, and "
            f"{args.work} has {free / 1e9:.1f} GB free: run fewer --seeds, or without "
            "--train-first (each seed's checkpoints are deleted once it is scored)"
        )


def forget_seeds(args: argparse.Namespace) -> None:
    """``--fresh``: delete what ``--work`` holds for ``args.seeds`` before anything runs,
    so an interrupted ``--fresh`` run goes on without it."""
    for size in args.sizes:
        for seed in args.seeds:
            folder = args.work / size / f"seed_{seed}"
            if folder.exists():
                print(f"--fresh: deleting {folder}", flush=True)
                shutil.rmtree(folder)


def refuse_other_runs(args: argparse.Namespace, size: str, model: dict[str, Any]) -> None:
    """Stop, naming each difference, where ``--work`` holds ``size``'s seeds under other
    settings (``other_runs``)."""
    if held := other_runs(args, size, model):
        raise SystemExit(f"--work {args.work} holds runs of other settings:\n  "
                         + "\n  ".join(held) + "\nPass --fresh to train and score them "
                         "again, --rescore to score them again (other scoring settings, or "
                         "a side added), or another --work for a new series.")  # fmt: skip


def other_runs(args: argparse.Namespace, size: str, model: dict[str, Any]) -> list[str]:
    """What this ``--work`` holds for ``args.seeds`` under other settings (a seed's result,
    a side's finished training, its scores), and how each differs: a changed flag is
    stopped before it deletes hours of runs."""
    held = []
    for seed in args.seeds:
        key = seed_key(args, size, model, seed)
        folder = args.work / size / f"seed_{seed}"
        for name in ("result.json", "scores.json"):
            kept = read_json(folder / name)
            differ = key_differences(kept["key"], key) if "key" in kept else []
            sides = kept.get("key", {}).get("specs", {})
            added = {f"specs.{fw}" for fw in key["specs"] if fw not in sides}  # a side fewer
            refused = [d for d in differ
                       if not (args.rescore and (scoring_only(d) or d in added))]  # fmt: skip
            if refused:
                held.append(f"seed_{seed}/{name}: {', '.join(refused)}")
            elif differ and any(read_json(folder / f"{fw}.clock.json").get("checkpoints_dropped")
                                for fw in FRAMEWORKS):  # fmt: skip
                gone = (f"seed_{seed}: its checkpoints were deleted once scored "
                        "(--keep-checkpoints keeps them); --fresh trains it again")  # fmt: skip
                held += [gone] if gone not in held else []
        for fw in args.frameworks:
            spec = run_spec(args, size, model["path"], fw, seed)
            kept = read_json(clock_path(Path(spec["out"])))
            if kept and (differ := run_differences(kept, spec)):
                held.append(f"seed_{seed}/{fw} (trained): {', '.join(differ)}")
    return held


def scoring_only(difference: str) -> bool:
    """Whether a ``seed_key`` difference changes only the scoring (``--rescore``)."""
    field = difference.rsplit(".", 1)[-1]
    return difference in ("evaluator", "eval_rows", "eval_dtype", "eval_max_running",
                          "files.test") or (difference.startswith("specs.")
                                            and field in SCORING_ONLY)  # fmt: skip


def seed_key(args: argparse.Namespace, size: str, model: dict[str, Any], seed: int) -> dict:
    """What a seed's result depends on: both specs, the starting model (its build), the
    contents of the config and data files, the evaluator and its rows. (The code's
    commit is recorded beside it, not part of it: ``--fresh`` retrains.)"""
    specs = {fw: run_spec(args, size, model["path"], fw, seed) for fw in args.frameworks}
    spec = next(iter(specs.values()))
    files = {k: sha256(Path(spec[k])) for k in ("config", "train", "test")}
    key = {"specs": specs, "model": model["build"], "files": files,
           "evaluator": args.evaluator, "eval_rows": args.eval_rows}  # fmt: skip
    if args.eval_dtype != "float32":  # keyed only when set: earlier results stay valid
        key["eval_dtype"] = args.eval_dtype
    if args.eval_max_running is not None:
        key["eval_max_running"] = args.eval_max_running
    return portable(key, [args.work, ROOT])


def lent_run(run: dict[str, Any], path: Path) -> dict[str, Any]:
    """A kept run as another seed's result holds it: its own figures and curve, marked with
    where it was first kept; its time to accuracy is timed again to the new seed's target."""
    lent = {k: v for k, v in run.items() if k != "time_to_accuracy_s"}
    lent.setdefault("reused_from", portable(str(path.resolve()), [ROOT]))
    return lent


def reusable_side(done: dict[str, Any], key: dict[str, Any]) -> str | None:
    """The framework of a kept seed ``done`` that can stand in this seed: where only the
    other framework's spec differs from ``key`` (an asyncrl variant against a series' TRL
    runs: the same start, prompts, evaluator and scoring stream)."""
    frameworks = done.get("result", {}).get("frameworks", {})
    differ = key_differences(done.get("key", {}), key) if done else []
    if not differ or set(key.get("specs", {})) != set(FRAMEWORKS):
        return None
    for fw in FRAMEWORKS:
        other = next(f for f in FRAMEWORKS if f != fw)
        if fw in frameworks and all(d.startswith(f"specs.{other}.") for d in differ):
            return fw
    return None


def key_differences(old: Any, new: Any, at: str = "") -> list[str]:
    """The dotted keys whose values differ between two seed keys (``seed_key``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = dict.fromkeys([*old, *new])
        return [d for k in keys for d in key_differences(old.get(k), new.get(k), f"{at}{k}.")]
    return [] if old == new else [at.rstrip(".") or "settings"]


def portable(value: Any, roots: list[Path]) -> Any:
    """``value`` with every path string under one of ``roots`` made relative to it, so a
    seed's key does not hold where it ran: a finished seed is read in another checkout."""
    if isinstance(value, dict):
        return {k: portable(v, roots) for k, v in value.items()}
    if isinstance(value, str):
        for root in roots:
            prefix = f"{root}/"
            if value.startswith(prefix):
                return value[len(prefix) :]
    return value


def train_and_score(
    args: argparse.Namespace,
    size: str,
    model: dict[str, Any],
    seed: int,
    index: int,
    key: dict[str, Any],
    reuse: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Both frameworks trained in this seed's order (or found trained), then every
    checkpoint scored (or found scored, under ``key``). ``reuse`` (``run_seed``) holds one
    framework's finished run and the start's score, kept from another series."""
    scoring = train_seed(args, size, model, seed, index, key, reuse)
    score_across(size, [scoring])
    return finish_seed(size, scoring)


@dataclasses.dataclass
class SeedScoring:
    """A trained seed on its way to its result: each side's figures and timeline, the
    checkpoints to score (``sides``: those not lent by ``reuse``) and its kept scores."""

    seed: int
    key: dict[str, Any]
    runs: dict[str, dict[str, Any]]
    timelines: dict[str, tuple[dict[str, Any], dict[str, float]]]
    sides: dict[str, list[dict[str, Any]]]
    evaluator: ScoreCache
    start_path: str
    partial: Path
    scored: int
    rows: str  # what is scored, said when the scoring starts
    prompts_shared: dict[str, float] | None = None  # shared_prompts
    lent_start: float | None = None
    start: float | None = None


def train_seed(
    args: argparse.Namespace,
    size: str,
    model: dict[str, Any],
    seed: int,
    index: int,
    key: dict[str, Any],
    reuse: dict[str, Any] | None = None,
) -> SeedScoring:
    """Both frameworks trained in this seed's order (or found trained), each side's
    figures read from its run; nothing scored yet. Refused when a side saved no
    checkpoint at a recorded step: it would have nothing to score."""
    runs: dict[str, dict[str, Any]] = {}
    timelines: dict[str, tuple[dict[str, Any], dict[str, float]]] = {}
    reused = reuse["framework"] if reuse else None
    spec = run_spec(args, size, model["path"], "none", seed)
    for fw in seed_order(index, args.frameworks):
        spec = run_spec(args, size, model["path"], fw, seed)
        if reuse and fw == reused:
            runs[fw] = dict(reuse["run"])
            continue
        if (clock := trained(spec)) is not None:
            print(f"{size} seed {seed}: {fw} trained earlier (at {clock['commit']})", flush=True)
        else:
            print(f"{size} seed {seed}: training {fw} ({spec['steps']} steps) ...", flush=True)
            clock = launch(fw, spec, getattr(args, "lock_fd", None))
        out = Path(spec["out"])
        if fw == "asyncrl":
            timeline = asyncrl_timeline(out, spec["groups"], spec["samples"])
        else:
            timeline = trl_timeline(out)
        timelines[fw] = timeline, clock
        runs[fw] = figures(timeline["steps"], clock) | {
            "requested_steps": spec["steps"],
            "trained_at": clock.get("commit"),
        }
        runs[fw]["save_s"] = sum(c["save_s"] or 0.0 for c in timeline["checkpoints"])
        runs[fw]["timeline"] = [relative(s, clock["t0"]) for s in timeline["steps"]]
    sides = {fw: [c for c in timelines[fw][0]["checkpoints"] if c["time"] is not None]
             for fw in args.frameworks if fw != reused}  # fmt: skip
    if empty := [fw for fw, saved in sides.items() if not saved]:
        raise SystemExit(f"{size} seed {seed}: {empty[0]} saved no checkpoint at a recorded "
                         f"step in {Path(spec['out']).parent}: nothing to score")  # fmt: skip
    rows = read_jsonl(Path(spec["test"]))[: args.eval_rows]
    scorer = make_evaluator(
        args.evaluator, model, spec, len(rows), args.eval_dtype, args.eval_max_running
    )
    stamps = {fw: clock["t0"] for fw, (_, clock) in timelines.items()}
    folder = Path(spec["out"]).parent
    shared = shared_prompts({fw: run["timeline"] for fw, run in runs.items()})  # a lent one too
    if shared:
        print(f"{size} seed {seed}: TRL's groups asyncrl trained: {shared['per_step']:.0%} "
              f"at the same step, {shared['run']:.0%} in the run", flush=True)  # fmt: skip
    return SeedScoring(
        seed=seed, key=key, runs=runs, timelines=timelines, sides=sides,
        evaluator=ScoreCache(folder / "scores.json", key, scorer, stamps),
        start_path=model["path"], partial=folder / "partial_result.json",
        scored=len(rows) * spec["eval_samples"], rows=f"{len(rows)} test rows ({args.evaluator})",
        lent_start=reuse["start"] if reuse else None,
        prompts_shared=shared,
    )  # fmt: skip


def score_across(size: str, scorings: list[SeedScoring]) -> None:
    """Score every seed's start, then every checkpoint not yet scored: level by level of
    each seed's coarse-first grid (``coarse_first``), the seeds in turn within a level.
    Each seed's ``partial_result.json`` is rewritten after each score."""
    for s in scorings:
        print(f"{size} seed {s.seed}: evaluating the checkpoints on {s.rows} ...", flush=True)
        s.start = s.lent_start if s.lent_start is not None else s.evaluator(s.start_path)
        print(f"  seed {s.seed} start: accuracy {s.start:.1%}", flush=True)
        keep_partial(size, s)  # replaces one left by other settings or another training
    ranked = [((*rank[:2], i, *rank[2:]), s, side, c)
              for i, s in enumerate(scorings)
              for rank, side, c in coarse_ranks(s.sides)]  # fmt: skip
    for _, s, side, c in sorted(ranked, key=lambda r: r[0]):
        if not s.evaluator.has(c["path"]):
            accuracy = s.evaluator(c["path"])
            print(f"  seed {s.seed} {side} step {c['step']}: accuracy {accuracy:.1%}", flush=True)
            keep_partial(size, s)


def keep_partial(size: str, s: SeedScoring) -> None:
    """What is scored so far, for a person to read while the scoring runs; the targets are
    judged on the whole grid only."""
    assert s.start is not None
    so_far = partial_runs(s.runs, s.timelines, s.start, s.evaluator)
    comparison = compare(size, so_far, s.start, s.scored)
    comparison.pop("targets", None)
    result = {"seed": s.seed, "start_accuracy": s.start, "scored": s.scored, "partial": True,
              "frameworks": so_far, "comparison": comparison,
              "prompts_shared": s.prompts_shared}  # fmt: skip
    write_json(s.partial, {"key": s.key, "trained": s.evaluator.trained, "result": result})


def finish_seed(size: str, s: SeedScoring) -> dict[str, Any]:
    """A scored seed's result: each side's held-out curve and best, and the comparison."""
    assert s.start is not None
    for fw in s.sides:
        timeline, clock = s.timelines[fw]
        print(f"  seed {s.seed} {fw}:", flush=True)
        s.runs[fw]["curve"] = accuracy_curve(timeline, clock["t0"], s.start, s.evaluator)
        s.runs[fw]["best_accuracy"] = max(p["accuracy"] for p in s.runs[fw]["curve"][1:])
    comparison = compare(size, s.runs, s.start, s.scored)
    return {"seed": s.seed, "start_accuracy": s.start, "scored": s.scored,
            "frameworks": s.runs, "comparison": comparison,
            "prompts_shared": s.prompts_shared}  # fmt: skip


def run_size(args: argparse.Namespace, size: str) -> dict[str, Any]:
    """Every seed on ``size``, then the figures across seeds."""
    model = ensure_model(size, args.cache, args.seeds[0])
    print(f"{size}: {model['params']:,} parameters ({model['path']})", flush=True)
    refuse_other_runs(args, size, model)
    if args.train_first:
        seeds = train_first(args, size, model)
    else:
        seeds = [run_seed(args, size, model, seed, i) for i, seed in enumerate(args.seeds)]
    return {"model": model, "temperature": SIZES[size].task.temperature, "seeds": seeds,
            "summary": across_seeds(size, seeds, args.threshold)}  # fmt: skip


FIGURES = ("samples/s", "tokens/s", "step_s", "wall_s", "best_accuracy")


def across_seeds(
    size: str, seeds: list[dict[str, Any]], threshold: float | None = None
) -> dict[str, Any]:
    """Mean +- standard error over seeds: each framework's figures and accuracy at each
    checkpoint step, and the ratios asyncrl / TRL.

    Two times to accuracy. ``time_to_accuracy``, the one judged: each seed's own ratio at
    the lower of its two best accuracies (``compare``; both frameworks reach it on every
    seed). ``time_to_threshold``: one ``threshold`` for every seed (default: the lower of
    the two frameworks' mean best), over the seeds where both reach it; a seed where only
    one does is counted in ``reached_alone``, and one where asyncrl alone misses fails the
    target. A target is judged on two seeds or more."""
    frameworks = sorted({fw for s in seeds for fw in s["frameworks"]})
    out: dict[str, Any] = {"frameworks": {fw: _framework_stats(seeds, fw) for fw in frameworks},
                           "seeds": len(seeds)}  # fmt: skip
    out["start_accuracy"] = mean_se([s["start_accuracy"] for s in seeds])
    if set(FRAMEWORKS) - set(frameworks):
        return out
    out["accuracy_difference"] = _paired_difference(seeds)
    if threshold is None:
        threshold = min(out["frameworks"][fw]["best_accuracy"]["mean"] for fw in FRAMEWORKS)
    out["threshold"] = threshold
    scored = min(s.get("scored", 0) for s in seeds)
    noise = noise_floor(out["start_accuracy"]["mean"], scored)
    if threshold <= out["start_accuracy"]["mean"] + noise:
        out["note"] = (
            f"the threshold ({threshold:.1%}) is within two standard errors "
            f"({noise:.1%}) of the start ({out['start_accuracy']['mean']:.1%}): no time to it"
        )
    for fw in FRAMEWORKS:
        times = [time_to(s["frameworks"][fw]["curve"], threshold) for s in seeds]
        out["frameworks"][fw]["time_to_threshold_s"] = times
        out["frameworks"][fw]["reached"] = sum(t is not None for t in times)
    pairs = list(zip(*(out["frameworks"][fw]["time_to_threshold_s"] for fw in FRAMEWORKS),
                     strict=True))  # fmt: skip
    out["reached_alone"] = {"asyncrl": sum(a is not None and t is None for a, t in pairs),
                            "trl": sum(a is None and t is not None for a, t in pairs)}  # fmt: skip
    out["ratios"] = _ratios(seeds, pairs, timed="note" not in out)
    out["targets"] = _targets(size, out)
    return out


def _framework_stats(seeds: list[dict[str, Any]], fw: str) -> dict[str, Any]:
    """One framework's ``FIGURES`` and accuracy at each step every seed checkpointed."""
    runs = [s["frameworks"][fw] for s in seeds if fw in s["frameworks"]]
    stats: dict[str, Any] = {key: mean_se([r[key] for r in runs]) for key in FIGURES}
    steps = set.intersection(*({p["step"] for p in r["curve"]} for r in runs))
    stats["accuracy"] = {
        step: mean_se([p["accuracy"] for r in runs for p in r["curve"] if p["step"] == step])
        for step in sorted(steps)
    }
    return stats


def _paired_difference(seeds: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """asyncrl's accuracy minus TRL's at each step both checkpointed on every seed, paired
    by seed (a seed's two runs share the start and the scoring stream, and under
    ``--prompt-order shared`` the prompts, so what varies between seeds drops out): mean
    +- s.e. over seeds."""
    curves = [
        [{p["step"]: p["accuracy"] for p in s["frameworks"][fw]["curve"]} for fw in FRAMEWORKS]
        for s in seeds
    ]
    steps = set.intersection(*(set(a) & set(t) for a, t in curves)) - {0}
    return {step: mean_se([a[step] - t[step] for a, t in curves]) for step in sorted(steps)}


def _ratios(
    seeds: list[dict[str, Any]], pairs: list[tuple[float | None, float | None]], timed: bool
) -> dict[str, Any]:
    """asyncrl / TRL per seed, mean +- s.e.: speeds, each seed's own time to accuracy,
    and the time to the common threshold where both reach it."""
    ratios: dict[str, Any] = {}
    for key in ("samples/s", "tokens/s"):
        ratios[key] = mean_se([s["frameworks"]["asyncrl"][key] / s["frameworks"]["trl"][key]
                               for s in seeds])  # fmt: skip
    own = [r for s in seeds if (r := s.get("comparison", {}).get("time_to_accuracy")) is not None]
    ratios["time_to_accuracy"] = mean_se(own) if own else None
    both = [a / t for a, t in pairs if a is not None and t is not None and t > 0]
    ratios["time_to_threshold"] = mean_se(both) if both and timed else None
    return ratios


def _targets(size: str, summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target against its ratio's mean, judged on two seeds or more (None: not
    measurable); time to accuracy also fails where asyncrl alone missed the threshold."""
    out = {}
    for key, want in TARGETS[size].items():
        stats = summary["ratios"][key]
        met = None if stats is None or stats["n"] < 2 else _met(key, stats["mean"], want)
        if key == "time_to_accuracy" and summary["reached_alone"]["trl"] and met:
            met = False
        out[key] = {"want": want, "met": met}
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _verdict(key: str, goal: dict[str, Any] | None) -> str:
    if goal is None:
        return ""
    sign = "<=" if key == "time_to_accuracy" else ">="
    met = {True: "met", False: "NOT met", None: "not judged (no ratio, or one seed)"}[goal["met"]]
    return f"  (target {sign} {goal['want']}x: {met})"


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """Per size and seed: each framework's figures; then the means across seeds and the
    ratios next to the targets."""
    cols = [("samples/s", ".1f"), ("tokens/s", ".0f"), ("step_s", ".2f"),
            ("train_s_mean", ".2f"), ("generate_s_mean", ".2f"),
            ("first_step_s", ".1f"), ("wall_s", ".0f"), ("save_s", ".1f"),
            ("best_accuracy", ".1%"), ("time_to_accuracy_s", ".0f"),
            ("cpu_steal", ".1%")]  # fmt: skip
    for size, res in results.items():
        print(f"\n{size}: {res['model']['params']:,} parameters")
        print(f"{'':<16}" + "".join(f"{c:>19}" for c, _ in cols))
        for seed in res["seeds"]:
            print(f"seed {seed['seed']} (start {seed['start_accuracy']:.1%})")
            for fw, r in seed["frameworks"].items():
                print(f"  {fw:<14}" + "".join(f"{_fmt(r.get(c), f):>19}" for c, f in cols))
                if r.get("reused_from"):  # timed in another run of this bench: say so
                    print(f"  {'':<14}(kept: {r['reused_from']}, trained at {r.get('trained_at')})")
        print_summary(res["summary"])


def _pm(stats: dict[str, Any] | None, spec: str) -> str:
    if stats is None:
        return "-"
    if stats["se"] is None:
        return f"{stats['mean']:{spec}} (n=1)"
    if spec.endswith("%"):
        return f"{stats['mean']:{spec}} +- {stats['se'] * 100:.1f}"
    return f"{stats['mean']:{spec}} +- {stats['se']:{spec}}"


def _pm_points(stats: dict[str, Any]) -> str:
    se = "" if stats["se"] is None else f" +- {stats['se'] * 100:.1f}"
    return f"{stats['mean'] * 100:+.1f}{se}"


def print_summary(summary: dict[str, Any]) -> None:
    """Mean +- s.e. over seeds, then the ratios asyncrl / TRL against the targets."""
    n = summary["seeds"]
    print(f"mean +- standard error over {n} seed{'s' if n > 1 else ''}:")
    for fw, stats in summary["frameworks"].items():
        cells = [f"{key} {_pm(stats[key], '.1%' if key == 'best_accuracy' else '.2f')}"
                 for key in FIGURES]  # fmt: skip
        reached = stats.get("reached")
        tail = f", reached the threshold on {reached} of {n}" if reached is not None else ""
        print(f"  {fw:<8} " + "; ".join(cells) + tail)
        steps = stats["accuracy"]
        print("           accuracy by step: "
              + ", ".join(f"{step}: {_pm(m, '.1%')}" for step, m in steps.items()))  # fmt: skip
    if "ratios" not in summary:
        return
    diff = summary.get("accuracy_difference", {})
    print("  asyncrl - TRL by step, paired by seed (points): "
          + ", ".join(f"{step}: {_pm_points(d)}" for step, d in diff.items()))  # fmt: skip
    note = f" ({summary['note']})" if "note" in summary else ""
    alone = summary["reached_alone"]
    print(f"threshold accuracy: {summary['threshold']:.1%}{note}; seeds where only asyncrl "
          f"reached it: {alone['asyncrl']}, only TRL: {alone['trl']}")  # fmt: skip
    print("time_to_accuracy: to each seed's lower best; time_to_threshold: to the threshold, "
          "over the seeds where both reach it")  # fmt: skip
    for key, stats in summary["ratios"].items():
        verdict = _verdict(key, summary["targets"].get(key))
        over = f" over {stats['n']} of {summary['seeds']} seeds" if stats else ""
        print(f"  asyncrl / TRL {key:<17} {_pm(stats, '.2f')}x{over}{verdict}")


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Held-out accuracy per size against wall seconds since launch (top) and against
    the training step (below: learning per step, whatever the speed), one line per seed
    and framework, a colour per framework, the threshold dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"asyncrl": "tab:blue", "trl": "tab:orange"}
    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 8), squeeze=False)
    for col, (size, res) in enumerate(results.items()):
        for row, x in enumerate(("time_s", "step")):
            ax = axes[row][col]
            for seed in res["seeds"]:
                for fw, r in seed["frameworks"].items():
                    first = seed is res["seeds"][0]
                    label = f"{fw} ({r['samples/s']:.1f} samples/s)" if first else None
                    curve = r["curve"]
                    ax.plot([p[x] for p in curve], [p["accuracy"] for p in curve],
                            marker="o", color=colours.get(fw), alpha=0.7, label=label)  # fmt: skip
            if "threshold" in res["summary"]:
                ax.axhline(res["summary"]["threshold"], color="k", ls=":", label="threshold")
            n = len(res["seeds"])
            ax.set_title(f"{size} ({res['model']['params'] / 1e6:.1f}M parameters, "
                         f"{n} seed{'s' if n > 1 else ''})")  # fmt: skip
            ax.set_xlabel("wall seconds since launch" if x == "time_s" else "training step")
            ax.set_ylabel(f"held-out pass@1 (T = {res.get('temperature', 1.0):g})")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_json(payload: dict[str, Any], path: Path) -> None:
    """``asyncrl plot bench/results/vs_trl.json``: the figure again from the JSON."""
    plot(payload["sizes"], path)


#: Each numeric flag's lowest value (a group needs two samples for an advantage).
LOWEST = {"--steps": 1, "--groups": 1, "--samples": 2, "--eta": 0, "--max-new-tokens": 1,
          "--save-every": 1, "--eval-rows": 1, "--eval-samples": 1, "--eval-max-running": 1,
          "--threshold": 0.0}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["0.5m", "30m"], choices=list(SIZES))
    parser.add_argument("--model", choices=list(SIZES), help="one size: --model real")
    parser.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per run (default per size: " +
                        ", ".join(f"{k} {v.steps}" for k, v in SIZES.items()) + ")")  # fmt: skip
    parser.add_argument(
        "--groups",
        type=int,
        default=None,
        help="prompts per step, G (default per task: arith 16, real 8)",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples per prompt, N (default per task: arith 8, real 4)",
    )
    parser.add_argument("--lr", type=float, default=None,
                        help="RL learning rate of both (default per size: " +
                        ", ".join(f"{k} {v.lr:g}" for k, v in SIZES.items()) + ")")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--seeds", type=int, default=1,
                        help="N seeds, --seed to --seed + N - 1; both frameworks on each, "
                        "their order alternating")  # fmt: skip
    parser.add_argument("--threshold", type=float, default=None,
                        help="the accuracy timed to (default: the lower of the two "
                        "frameworks' mean best accuracy)")  # fmt: skip
    parser.add_argument("--eta", type=int, default=None,
                        help="asyncrl's staleness bound (default per size: " +
                        ", ".join(f"{k} {v.eta}" for k, v in SIZES.items()) + ")")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-order", choices=["shared", "own"], default="shared",
                        help="shared: TRL takes the prompts in asyncrl's order; own: each "
                        "shuffles with its own sampler (the series before 2026-12-02)")  # fmt: skip
    parser.add_argument("--dtype", choices=list(DTYPE_FLAGS), default="float32",
                        help="bf16: fp32 master weights and bf16 compute on both sides "
                        "(TRL bf16=True; asyncrl bf16-mixed and a bf16 engine)")  # fmt: skip
    parser.add_argument("--save-every", type=int, default=2, help="checkpoint every K steps")
    parser.add_argument("--eval-rows", type=int, default=500, help="first N test rows")
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=None,
        help="samples per test prompt (default 4)",
    )
    parser.add_argument("--eval-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the engine evaluator's weights")  # fmt: skip
    parser.add_argument("--eval-max-running", type=int, default=None,
                        help="requests the engine evaluator decodes together (default: the "
                        "config's, 64); 256 scores about 1.2x faster on 2 cores, on other "
                        "draws: a series keeps one value")  # fmt: skip
    parser.add_argument("--evaluator", choices=["engine", "hf"], default="engine",
                        help="who samples the held-out set: asyncrl's embedded engine "
                        "(asyncrl eval's code) or Hugging Face generate")  # fmt: skip
    parser.add_argument("--results-from", type=Path, default=None,
                        help="also reuse finished seeds' SIZE/seed_S/result.json from this "
                        "folder (e.g. docs/data/vs_trl_real_bf16_seeds)")  # fmt: skip
    parser.add_argument("--truncated-reward", type=float, default=None, metavar="R",
                        help="the reward of a reply cut off at --max-new-tokens, on both "
                        "sides and in scoring (DAPO's overlong punishment; e.g. 0: a "
                        "cut-off reply is wrong whatever its last number); default: "
                        "scored as any other")  # fmt: skip
    parser.add_argument("--asyncrl-filters", nargs="+", default=None, metavar="FILTER",
                        help="asyncrl's dynamic-sampling filters (e.g. zero_reward_variance: "
                        "groups whose samples all scored alike are dropped and replaced); "
                        "default none, every sample trained as TRL does. With "
                        "--results-from DIR (and both --frameworks), a seed kept in DIR "
                        "without them lends its TRL run, timed when it was kept")  # fmt: skip
    parser.add_argument("--fresh", action="store_true",
                        help="delete what --work holds for these seeds, then train and score "
                        "them (without it or --rescore, a --work holding runs of other "
                        "settings is refused; an interrupted --fresh run goes on "
                        "without it)")  # fmt: skip
    parser.add_argument("--rescore", action="store_true",
                        help="let a --work whose seeds were scored under other settings (the "
                        "evaluator, --eval-*, --test), or with a side fewer, be scored again, "
                        "their training kept; their earlier scores are replaced")  # fmt: skip
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep each seed's checkpoints once it is scored (default: deleted, "
                        "about 8 GB a seed on the real model; --rescore needs them)")  # fmt: skip
    parser.add_argument("--train-first", action="store_true",
                        help="train every seed before scoring any, then score them together, "
                        "coarse grids first (every seed's checkpoints are kept meanwhile: "
                        "refused when the disk cannot hold them)")  # fmt: skip
    parser.add_argument("--train", type=Path, default=None, help="default: the task's")
    parser.add_argument("--test", type=Path, default=None, help="default: the task's")
    parser.add_argument("--cache", type=Path, default=Path("runs/vs-trl/models"))
    parser.add_argument("--work", type=Path, default=Path("runs/vs-trl"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/vs_trl.json"))
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hold", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model:
        args.sizes = [args.model]
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: at least 1")
    args.seeds = list(range(args.seed, args.seed + args.seeds))
    if args.truncated_reward is not None and not math.isfinite(args.truncated_reward):
        parser.error(f"--truncated-reward {args.truncated_reward}: a finite number")
    for flag, low in LOWEST.items():  # refused now, not after hours of training
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None and not value >= low:  # NaN included
            parser.error(f"{flag} {value}: at least {low}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr {args.lr}: a positive number")
    for flag, path in (("--train", args.train), ("--test", args.test)):
        if path is not None and not path.is_file():
            parser.error(f"{flag} {path}: no such file")
    for name in args.asyncrl_filters or []:  # a typo fails now, not after a run trained
        try:
            load_filter(name)
        except Exception as exc:
            parser.error(f"--asyncrl-filters {name}: {exc}")
    return args


def slow_dtypes(args: argparse.Namespace) -> list[str]:
    """bf16 asked of a CPU without bf16 instructions, where torch emulates it: a bf16
    matmul there ran at 1/50 of float32's (0.9 against 44.8 GFLOP/s, an AVX2 EPYC)."""
    if hardware.cpu_bf16():
        return []
    slow = [f"--dtype {args.dtype}: both sides train"] if args.dtype != "float32" else []
    if args.eval_dtype != "float32" and args.evaluator == "engine":
        slow.append(f"--eval-dtype {args.eval_dtype}: every checkpoint is scored")
    return [f"{what} in emulated bf16 on this CPU (no avx512_bf16 or amx_bf16): "
            "many times slower than float32" for what in slow]  # fmt: skip


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args.worker, args.spec, args.parent, args.hold)
        return
    needed = ["matplotlib", *(["trl"] if "trl" in args.frameworks else [])]
    if any(importlib.util.find_spec(name) is None for name in needed):
        raise SystemExit(MISSING_BENCH)
    args.cache, args.work = args.cache.resolve(), args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    lock = (args.work / ".lock").open("w")  # held to exit: a second copy would delete our runs
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"--work {args.work}: another vs_trl run is using it") from None
    args.lock_fd = lock.fileno()
    for note in slow_dtypes(args):
        print(f"warning: {note}", file=sys.stderr, flush=True)
    if args.fresh:
        forget_seeds(args)
    for size in args.sizes:  # before any size trains (or builds its model), where it can
        if (model := built_model(size, args.cache)) is not None:
            refuse_other_runs(args, size, model)
    results = {size: run_size(args, size) for size in args.sizes}
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                if k not in ("worker", "spec", "lock_fd")}  # fmt: skip
    payload = {"settings": settings,
               "shapes": {k: dataclasses.asdict(SIZES[k]) for k in args.sizes},
               "targets": TARGETS, "sizes": results}  # fmt: skip
    write_json(args.out, payload)  # paths as text
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
