"""Everything about a job that can be checked without starting it, checked before launch.

A job that fails ``preflight`` starts no process, and one ``PreflightError`` lists every
problem found (one line each, with file and line where there is one). Checks that need a
trained model or a live engine are the dry run's (``runtime/dryrun.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.errors import InputError
from asyncrl.observe.logs import get_logger

if TYPE_CHECKING:
    from asyncrl.buffer.sources import PromptSource
    from asyncrl.config import RunConfig


log = get_logger("asyncrl.preflight")


class PreflightError(InputError):
    """The job cannot run as configured; ``problems`` holds one line per finding."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


def preflight(cfg: RunConfig) -> None:
    """Raise ``PreflightError`` naming every problem found in ``cfg``: model folders hold an
    HF ``config.json`` and the policy's tokenizer loads; every data and eval row is valid,
    its chat template renders and it fits the model's context; the user code named by path
    (reward, workflow, filters, priority, tools, agent) loads; ``trainer.compile`` has a
    toolchain."""
    problems: list[str] = []
    for check in _code_checks(cfg):  # first: tool use fills the data's default tools
        _collect(check, problems)
    tokenizer = _models(cfg, problems)
    _compile_toolchain(cfg, problems)
    _reward_model_folders(cfg, problems)
    context = _context_length(cfg.trainer.model_path if cfg.trainer else None)
    if cfg.data is not None:
        data = _source(cfg.data, "data", cfg, tokenizer, context, problems)
        if data is not None:
            _scorable(data, "data", cfg, cfg.rollout.reward, problems)
            _warn_short_data(cfg, data)
    if cfg.eval.enabled:
        _eval_sets(cfg, tokenizer, context, problems)
    if problems:
        raise PreflightError(problems)


def preflight_eval(cfg: RunConfig, model: str) -> None:
    """``asyncrl eval``'s checks (``offline_eval.py``): user code, ``model``'s tokenizer,
    and every eval set's rows, chat template and lengths; ``PreflightError`` names each
    problem."""
    problems: list[str] = []
    for check in _code_checks(cfg):
        _collect(check, problems)
    tokenizer = _collect(lambda: _tokenizer(model), problems)
    _reward_model_folders(cfg, problems)
    _eval_sets(cfg, tokenizer, _context_length(model), problems)
    if problems:
        raise PreflightError(problems)


def _eval_sets(cfg: RunConfig, tokenizer: Any, context: int | None, problems: list[str]) -> None:
    for s in cfg.eval.sets:
        sampling = s.sampling or cfg.rollout.sampling
        source, what = _eval_source(cfg, s), f"eval set {s.name!r}"
        opened = _source(source, what, cfg, tokenizer, context, problems, sampling)
        if opened is not None:
            _scorable(opened, what, cfg, s.reward or cfg.rollout.reward, problems)


def _scorable(
    source: PromptSource, what: str, cfg: RunConfig, reward: Any, problems: list[str]
) -> None:
    """Every row can be scored by ``reward`` (``rewards.unscorable``): a job whose rows
    fail one by one at runtime trains on what is left, or on nothing. A custom workflow
    may score its own way: not checked."""
    from asyncrl.rollout.rewards import unscorable

    if cfg.rollout.workflow is not None:
        return

    found: dict[str, list[str]] = {}
    for row in source.rows:
        if (why := unscorable(reward, row.label, row.metadata)) is not None:
            found.setdefault(why, []).append(row.where)
    for why, wheres in found.items():
        more = f", {wheres[1]}" if len(wheres) > 1 else ""
        problems.append(
            f"{what}: {len(wheres)} of {len(source.rows)} rows cannot be scored: "
            f"{why} (first: {wheres[0]}{more})"
        )


def _collect(check: Callable[[], Any], problems: list[str]) -> Any:
    try:
        return check()
    except (ValueError, OSError) as exc:  # OSError: a file a check reads is missing
        problems.append(str(exc))
        return None


def _models(cfg: RunConfig, problems: list[str]) -> Any:
    """Each configured model folder has an HF config; the policy's tokenizer, or None."""
    t = cfg.trainer
    folders = {}
    if t is not None and t.backend != "sim":
        folders = {"trainer.model_path (--hf-checkpoint)": t.model_path}
        folders["trainer.ref_model_path"] = t.ref_model_path
        folders["trainer.critic_model_path"] = t.critic_model_path
    for name in ("rollout", "eval"):
        engine = getattr(cfg, name).engine
        launched = engine is not None and engine.type == "vllm" and engine.serve == "actor"
        if engine is not None and (engine.type == "torch" or launched):
            folders[f"{name}.engine.model_path"] = engine.model_path
        if launched:
            from asyncrl.engines.vllm.launch import vllm_python

            _collect(lambda e=engine: vllm_python(e.vllm_python), problems)
    for key, folder in folders.items():
        if folder and not (Path(folder).expanduser() / "config.json").is_file():
            problems.append(f"{key}: {folder} is not a Hugging Face model folder (no config.json)")
    policy = folders.get("trainer.model_path (--hf-checkpoint)")
    for key in ("rollout.engine.model_path", "eval.engine.model_path"):
        if policy and folders.get(key):
            _same_shape(key, folders[key], policy, problems)
    if t is None or t.backend == "sim":
        return None
    return _collect(lambda: _tokenizer(t.model_path), problems)


def _compile_toolchain(cfg: RunConfig, problems: list[str]) -> None:
    """``trainer.compile`` builds kernels at the first step: on a CPU with a C++ compiler,
    on CUDA with triton. Without them that step would fail, after the engines started."""
    t = cfg.trainer
    if t is None or not t.compile or cfg.runtime.type != "local":
        return  # a cluster's trainer node has its own toolchain: checked there
    flag = "trainer.compile (--trainer.compile)"
    if t.device.startswith("cuda"):
        if importlib.util.find_spec("triton") is None:
            problems.append(f"{flag} on {t.device} needs triton, which is not installed: "
                            "pip install triton, or drop --trainer.compile")  # fmt: skip
        return
    compilers = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if not any(shutil.which(c) for c in compilers if c):
        problems.append(f"{flag} on the CPU needs a C++ compiler (g++, clang++ or $CXX) and "
                        "none is on PATH: install one (apt install g++), or drop "
                        "--trainer.compile")  # fmt: skip


#: ``config.json`` keys in which an engine's model must equal the trainer's: a weight
#: version of the trainer's model would not load into another shape.
_SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)


def _same_shape(key: str, folder: str, policy: str, problems: list[str]) -> None:
    """``folder`` (an engine's model) has the shape of the trainer's ``policy``."""
    try:
        mine, theirs = (
            json.loads((Path(p).expanduser() / "config.json").read_text()) for p in (folder, policy)
        )
    except (OSError, ValueError):
        return  # a missing or unreadable config.json is reported on its own
    differ = [
        f"{k} {mine.get(k)} vs {theirs.get(k)}" for k in _SHAPE_KEYS if mine.get(k) != theirs.get(k)
    ]
    if differ:
        problems.append(
            f"{key}: {folder} is not the trainer's model ({policy}): "
            f"{', '.join(differ)}; the trainer's weight versions could not load "
            "into it"
        )


def _reward_model_folders(cfg: RunConfig, problems: list[str]) -> None:
    """Each reward model is an HF folder with tokenizer files and a head with the label
    it reads (transformers' default head has 2 labels)."""
    from asyncrl.rollout.reward_config import reward_models

    for rm in reward_models(cfg.rollout.reward, *(s.reward for s in cfg.eval.sets)):
        folder = Path(rm.path).expanduser()
        try:
            hf = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as exc:
            problems.append(f"reward model {rm.path}: not a Hugging Face model folder ({exc})")
            continue
        if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            problems.append(f"reward model {rm.path}: no tokenizer files")
        labels = len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2))
        if rm.label_index >= labels:
            problems.append(
                f"reward model {rm.path}: label_index {rm.label_index} but its head has "
                f"{labels} label(s)"
            )


#: A tokenizer is read from one of these; without any, transformers builds an empty one.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _tokenizer(path: str) -> Any:
    """The policy's tokenizer, which must come from files in its folder and whose ids must
    all have an embedding row."""
    from transformers import AutoTokenizer

    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        return None  # reported by _models
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"{path}: no tokenizer files ({', '.join(_TOKENIZER_FILES)}): save the tokenizer "
            "with the model (tokenizer.save_pretrained)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises many kinds for a folder it cannot read
        raise ValueError(
            f"{path}: the tokenizer does not load: {type(exc).__name__}: {exc}"
        ) from None
    vocab = json.loads((folder / "config.json").read_text()).get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise ValueError(
            f"{path}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{vocab}: ids past it have no embedding"
        )
    return tokenizer


def _context_length(model_path: str | None) -> int | None:
    """The model's ``max_position_embeddings`` (None when unknown)."""
    if model_path is None:
        return None
    try:
        hf = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = hf.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def _eval_source(cfg: RunConfig, s: Any) -> PromptSource.Config:
    from asyncrl.buffer.sources import PromptSource

    return PromptSource.Config(
        path=s.path,
        input_key=s.input_key,
        label_key=s.label_key,
        metadata_key=s.metadata_key,
        apply_chat_template=bool(s.apply_chat_template),
        shuffle=False,
        name=s.name,
    )


def _warn_short_data(cfg: RunConfig, data: PromptSource) -> None:
    """Data that cannot fill the steps asked for: the job ends early (the last batch may
    be short), or trains nothing, which then fails it with the counts."""
    if cfg.train.debug_rollout_only or cfg.train.num_steps == 0:
        return
    prompts = data.config.num_rollouts or data.num_rows * data.config.num_epochs
    need = cfg.buffer.groups_per_step * cfg.train.num_steps
    if need > prompts:
        log.warning(
            f"{cfg.train.num_steps} steps of {cfg.buffer.groups_per_step} prompt groups "
            f"(--train.num-steps, --rollout-batch-size) need {need} prompts, but the data "
            f"holds {prompts} over all its epochs: the job ends when they run out "
            "(raise --num-epoch to go on)"
        )


def _source(
    source: PromptSource.Config,
    what: str,
    cfg: RunConfig,
    tokenizer: Any,
    context: int | None,
    problems: list[str],
    sampling: dict[str, Any] | None = None,
) -> PromptSource | None:
    """Rows valid, chat template there when asked for, prompts within the context; the
    opened source, or None when it did not open."""
    from asyncrl.buffer.sources import DataError, PromptSource

    if source.apply_chat_template and tokenizer is not None and not tokenizer.chat_template:
        problems.append(
            f"{what}: apply_chat_template is set but the tokenizer of "
            f"{cfg.trainer.model_path if cfg.trainer else '?'} has no chat template"
        )
        return None
    try:
        opened = PromptSource.open(source, tokenizer)
    except (DataError, ValueError, OSError) as exc:
        problems.append(f"{what}: {exc}")
        return None
    if tokenizer is not None and context is not None:
        budget = int((sampling or cfg.rollout.sampling).get("max_new_tokens") or 128)
        _lengths(opened, what, budget, context, problems)
    return opened


def _lengths(
    source: PromptSource, what: str, budget: int, context: int, problems: list[str]
) -> None:
    """A prompt of ``context`` tokens or more is refused (no engine can serve it); one that
    leaves less than ``budget`` new tokens is generated only up to the context: warned."""
    from asyncrl.buffer.sources import DataError

    full: list[str] = []
    short: list[str] = []
    try:
        for where, n in source.prompt_lengths():
            if n >= context:
                full.append(f"{where} has {n} prompt tokens")
            elif n + budget > context:
                short.append(f"{where} has {n} prompt tokens")
    except DataError as exc:
        problems.append(f"{what}: {exc}")
        return
    if full:
        problems.append(
            f"{what}: {len(full)} prompt(s) fill the model's context of {context} tokens, "
            f"leaving no room for a response (first: {full[0]}); shorten or drop them"
        )
    if short:
        log.warning(
            f"{what}: {len(short)} prompt(s) leave less than max_new_tokens {budget} of the "
            f"model's context of {context} tokens; their responses stop at the context "
            f"(first: {short[0]})"
        )


def _code_checks(cfg: RunConfig) -> list[Callable[[], Any]]:
    """Loaders of every piece of user code the job names."""
    from asyncrl.rollout.rewards import build_reward

    checks: list[Callable[[], Any]] = [lambda: check_tool_use(cfg), lambda: check_agent(cfg)]
    rewards = [cfg.rollout.reward, *(s.reward for s in cfg.eval.sets if s.reward)]
    built = ("custom", "judge")  # user code, or a judge's API key, is checked at build
    custom = [r for r in rewards if r.type in built or any(t.type in built for t in r.terms)]
    # A model term beside them is served by the reward actor: a stand-in is enough here.
    checks += [lambda r=r: build_reward(r, reward_model=_NOT_SERVED) for r in custom]
    if cfg.algo.custom_advantage_path or cfg.algo.custom_loss_path:
        from asyncrl.policies.objective import load_hooks

        checks.append(lambda: load_hooks(cfg.algo))
    if cfg.rollout.workflow:
        from asyncrl.rollout.workflows import load_workflow

        checks.append(lambda: load_workflow(cfg.rollout.workflow))
    from asyncrl.buffer.filters import load_filter
    from asyncrl.buffer.store import load_priority

    checks += [lambda name=name: load_filter(name) for name in cfg.buffer.filters]
    checks.append(lambda: load_priority(cfg.buffer.priority))
    return checks


class _NotServed:
    """The reward model of a check that scores nothing (the reward actor serves it)."""

    async def score(self, prompt: Any, response: str) -> float:
        raise RuntimeError("no reward model is served in the preflight")


_NOT_SERVED = _NotServed()


def tool_schemas(cfg: RunConfig) -> list[dict[str, Any]] | None:
    """The schemas of ``rollout.tool_use``'s tools (None without tool use).

    Building the registry loads each tool, so a missing corpus or a bad custom tool is
    refused here, before any process starts (``asyncrl train`` calls this first).
    """
    if cfg.rollout.tool_use is None:
        return None
    from asyncrl.rollout.tools.build import build_registry

    return build_registry(cfg.rollout.tool_use).schemas()


def _local_tokenizer(path: str) -> Any:
    """The tokenizer of the model folder at ``path``; None when there is no such folder
    (transformers would take the path for a hub id and retry the network for a minute)."""
    from transformers import AutoTokenizer

    if not (Path(path).expanduser() / "config.json").is_file():
        return None
    return AutoTokenizer.from_pretrained(path)


def check_tool_use(cfg: RunConfig) -> None:
    """Before launch: the tools load and the policy's chat template can render a tool
    observation after an assistant turn (a template that is not prefix-stable, or that
    closes turns with another token than ``eos_token``, is a ``ValueError`` here, not a
    failed sample per episode later)."""
    if cfg.rollout.tool_use is None or cfg.trainer is None:
        return
    schemas = tool_schemas(cfg)
    if cfg.data is not None and cfg.data.default_tools is None:
        cfg.data.default_tools = schemas  # so launching does not load every tool again
    from asyncrl.rollout.multi_turn import ObservationRenderer

    if (tokenizer := _local_tokenizer(cfg.trainer.model_path)) is None:
        return  # reported by _models
    try:
        ObservationRenderer(tokenizer).render([{"role": "tool", "content": "ok"}], turn_closed=True)
    except Exception as exc:  # jinja raises its own errors; all mean the same here
        raise ValueError(
            f"{cfg.trainer.model_path}: the chat template cannot render tool observations "
            f"for multi-turn rollouts: {exc}"
        ) from None


def check_agent(cfg: RunConfig) -> None:
    """Before launch: ``rollout.agent`` loads, and the policy's tokenizer has a chat
    template that renders the messages an agent appends after a reply."""
    if cfg.rollout.agent is None or cfg.trainer is None:
        return
    from asyncrl.rollout.multi_turn import ObservationRenderer
    from asyncrl.rollout.workflows import load_workflow

    load_workflow(None, agent=cfg.rollout.agent)
    if (tokenizer := _local_tokenizer(cfg.trainer.model_path)) is None:
        return  # reported by _models
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{cfg.trainer.model_path}: rollout.agent needs a chat template")
    renderer, errors = ObservationRenderer(tokenizer), []
    for role in ("tool", "user"):  # an agent appends one or the other after a reply
        try:
            renderer.render([{"role": role, "name": "f", "content": "ok"}], turn_closed=True)
        except Exception as exc:  # jinja raises its own errors; all mean the same here
            errors.append(f"{role}: {exc}")
    if len(errors) == 2:
        raise ValueError(
            f"{cfg.trainer.model_path}: the chat template cannot render the messages an "
            f"agent appends after a reply ({'; '.join(errors)})"
        )
