"""``asyncrl eval``: score a model folder on held-out sets, as a training run's eval actor does.

    asyncrl eval [CONFIG.yaml] --model DIR [--eval-sets JSON] [--out FILE.jsonl]
                 [--<config flag> VALUE ...]

The sets are opened and scored by the eval actor's own code (``actors/eval.py``), and the
engine samples from the eval actor's stream at the job's seed, so a row here has the
metrics of the job's ``metrics/eval.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig
from asyncrl.engines.config import EngineConfig, sampled_dtype
from asyncrl.errors import InputError

#: The engine's name in its seed: the eval actor's, so the same seed draws the same stream.
EVAL_ACTOR = "eval"


class EvalFailed(RuntimeError):
    """Every sample of a set failed: the scores would mean nothing."""


def resolve_model(path: str | Path) -> Path:
    """The HF model folder of ``path``: itself, or its ``policy/`` (a checkpoint folder)."""
    folder = Path(path).expanduser()
    for candidate in (folder, folder / "policy"):
        if (candidate / "config.json").is_file():
            return candidate
    if not folder.exists():
        raise InputError(f"--model {path}: no such folder")
    raise InputError(
        f"--model {path}: not a model folder (no config.json there or in {folder / 'policy'})"
    )


def engine_config(cfg: RunConfig, model: Path) -> EngineConfig:
    """An embedded torch engine on ``model``: the rollout engine's settings when it is a
    torch one (device, dtype, batch), seeded as the job's eval actor's is."""
    base = cfg.eval.engine or cfg.rollout.engine
    fields: dict[str, Any] = {"type": "torch", "model_path": str(model)}
    if base is not None and base.type == "torch":
        keep = ("device", "dtype", "max_running", "packed_weights", "lean_forward", "seed",
                "prompt_cache_tokens")  # fmt: skip
        fields |= {k: getattr(base, k) for k in keep}
        if base._dtype_was_auto and cfg.trainer is None:
            fields["dtype"] = "auto"  # chosen for the model evaluated, not the base's
    elif cfg.trainer is not None:  # the job's engine: at the trainer's precision
        fields["dtype"] = sampled_dtype(cfg.trainer.dtype, str(model))
    return EngineConfig.model_validate(fields).seeded(cfg.seed)


async def evaluate_model(cfg: RunConfig, model: Path, out: Path | None = None) -> list[dict]:
    """Every set's row for ``model`` (pass@k, reward, failed, truncated, response_len,
    per-group pass@1), each appended to ``out`` (JSON lines, with ``model``) as it ends;
    ``EvalFailed`` after the last set when a set's samples all failed.

    ``cfg`` is a training config (trainer and data may be absent): the rollout's sampling,
    reward, workflow and tools are each set's defaults, and ``eval.max_concurrency`` bounds
    the requests in flight."""
    from asyncrl.actors.config import WorkflowConfig
    from asyncrl.actors.eval import open_eval_set
    from asyncrl.actors.rollout import policy_tokenizer
    from asyncrl.rollout.engines import EngineHost, engine_seed

    if not cfg.eval.sets:
        raise InputError("no eval sets: give --eval-sets or eval.sets in the config")
    engine = engine_config(cfg, model)
    r = cfg.rollout
    workflow = WorkflowConfig(
        engine=engine,
        sampling=dict(r.sampling),
        reward=r.reward,
        workflow=r.workflow,
        tool_use=r.tool_use,
        agent=r.agent,
        tokenizer=str(model),
    )
    rows, failed = [], []
    async with contextlib.AsyncExitStack() as stack:
        seed = engine_seed(engine.seed, EVAL_ACTOR, restarted=False)
        host = await stack.enter_async_context(EngineHost(engine, seed=seed))
        tokenizer = policy_tokenizer(str(model), host)
        hold = stack.enter_async_context
        rm = await _reward_model(cfg, hold)
        sets = [await open_eval_set(s, workflow, host, tokenizer, hold, rm) for s in cfg.eval.sets]
        for s in sets:
            failures: Counter[str] = Counter()
            row = await s.evaluate(cfg.eval.max_concurrency, "eval-offline", failures)
            rows.append({"model": str(model), "set": s.cfg.name, **row})
            if out is not None:
                _append(out, rows[-1])
            if failures and row["failed"] >= row["samples"]:
                failed.append(f"{s.cfg.name}: {failures.most_common(1)[0][0]}")
    if failed:
        raise EvalFailed("every sample failed in " + "; ".join(failed))
    return rows


async def _reward_model(cfg: RunConfig, hold: Any) -> Any:
    """The sets' reward model, loaded here (no reward actor outside a job), or None."""
    from asyncrl.rollout.reward_config import reward_models
    from asyncrl.rollout.reward_model import RewardModel

    found = reward_models(cfg.rollout.reward, *(s.reward for s in cfg.eval.sets))
    return await hold(RewardModel(found[0])) if found else None


def _append(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def table(rows: list[dict]) -> Any:
    """The rows as a rich table: one line a set, its pass@k columns and the rest."""
    from rich.table import Table

    keys = ["prompts", "samples"]
    keys += sorted(
        {k for r in rows for k in r if k.startswith("pass@") and "/" not in k},
        key=lambda k: int(k[5:]),
    )
    keys += ["reward", "failed", "truncated", "response_len", "seconds"]
    out = Table("set", *keys)
    for r in rows:
        out.add_row(r["set"], *(_cell(r.get(k)) for k in keys))
    return out


def _cell(value: Any) -> str:
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.4f}"
    return "" if value is None else str(int(value)) if isinstance(value, float) else str(value)
