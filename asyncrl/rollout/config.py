"""Rollout settings that the config tree composes (no torch, no HTTP imports here).

``EngineConfig`` (which engines a rollout actor uses, ``rollout.engine``),
``ToolUseConfig`` (multi-turn tools and limits, ``rollout.tool_use``), ``RolloutConfig``
(the ``rollout`` section: actors, engines, sampling, workflow, reward) and ``EvalConfig``
(the ``eval`` section: named held-out sets, how often). The reward's settings are in
``rollout/reward_config.py``. Read by ``actors/rollout.py``, ``actors/eval.py`` and
``rollout/engines.py``; composed by ``asyncrl.config``.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncrl.engines.sim_latency import LatencyModel
from asyncrl.rollout.reward_config import RewardConfig

#: Arguments of sglang.launch_server that the engine actor sets (model_path, its endpoint).
_ASSIGNED_SERVER_ARGS = ("--model-path", "--model", "--host", "--port")


class EngineConfig(BaseModel):
    """Which engines a rollout actor uses and how they take new weights."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    type: Literal["torch", "sglang", "vllm", "sim"] = Field(
        "torch",
        description="embedded torch, SGLang, vLLM (its own API: engines/vllm_engine.py), "
        "or sim (no model: modelled time)",
    )
    model_path: str | None = Field(
        None,
        description="HF model directory (torch engine; launched sglang and vllm servers; "
        "vllm urls: a local copy for the tokenizer; sim: its vocab and EOS).",
    )
    sim: LatencyModel = Field(
        default_factory=LatencyModel, description="the sim engine's latency model"
    )
    sim_engines: int = Field(
        1, ge=1, description="sim engines in each rollout actor (one server each)"
    )
    in_process: bool = Field(
        True,
        description="embedded engines (torch, sim): non-stream /generate calls skip the "
        "loopback HTTP (false: every call goes over HTTP, as to SGLang)",
    )
    device: str = Field("cpu", description="torch device of the embedded engine.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weights")
    max_running: int = Field(64, ge=1, description="Requests decoded together (torch engine).")
    max_total_tokens: int | None = Field(
        None,
        ge=1,
        description="torch engine: KV positions held at once, padding included (rows x the "
        "longest row's final length); None: what mem_fraction of the free memory holds",
    )
    mem_fraction: float = Field(
        0.2,
        gt=0,
        le=1,
        description="torch engine, no max_total_tokens: the share of the memory free at its "
        "start (the host's, or the GPU's) that its KV cache may take at its peak",
    )
    packed_weights: bool = Field(
        True,
        description="torch engine on the CPU: keep a oneDNN-packed copy of each linear "
        "weight (1.3-2x faster matmuls, for a second copy of those weights; "
        "engines/cpu_linear.py)",
    )
    lean_forward: bool = Field(
        True,
        description="torch engine: run Llama and Qwen2 models through asyncrl's own forward "
        "(fused projections, no per-module Python; engines/lean_forward.py); false, or "
        "another architecture: through transformers",
    )
    seed: int | None = Field(
        None,
        description="torch engine: the stream its requests' sampling seeds come from, "
        "mixed with the actor's name (a restarted actor draws afresh); None: the job's seed",
    )
    urls: list[str] = Field(
        default_factory=list,
        description="server URLs (sglang; vllm: servers started with "
        "asyncrl's arguments, engines/vllm_launch.py)",
    )
    vllm_python: str | None = Field(
        None,
        description="vllm, serve: actor: the interpreter of vLLM's virtualenv (default: "
        "$ASYNCRL_VLLM_PYTHON, else .venv-vllm/bin/python from `make vllm-venv`)",
    )
    router: bool = Field(False, description="The one URL is an sglang-router.")
    on_update: Literal["continue", "abort"] = Field(
        "continue", description="In-flight requests on a weight update: continue or abort."
    )
    update_in_place: bool = Field(
        True,
        description="torch engine, pull and dist: write a new version straight into the "
        "model, decoding paused for the transfer (false: stage a full copy first, then "
        "pause only to swap it in: a shorter pause for a model's worth of memory)",
    )
    serve: Literal["embedded", "actor"] = Field(
        "embedded",
        description="embedded: the torch engine runs in the rollout actor; actor: each "
        "rollout actor gets an engine actor (torch, or an SGLang or vLLM server it "
        "launches)",
    )
    server_args: list[str] = Field(
        default_factory=list,
        description="extra arguments of the launched server (serve: actor): "
        "sglang.launch_server's (--sglang-* flags), or vLLM's api_server's",
    )
    health_interval: float = Field(
        5.0, gt=0, description="seconds between an engine actor's /health_generate checks"
    )
    startup_timeout: float = Field(
        900.0, gt=0, description="seconds an engine actor's server has to become healthy"
    )
    health_check_s: float | None = Field(
        30.0,
        gt=0,
        description="sglang and vllm urls: check each engine with /health_generate this "
        "often; one "
        "that fails leaves the rotation and rejoins, given the current weights first, once "
        "it passes again (null: only failed calls take an engine out)",
    )

    @field_validator("server_args", mode="before")
    @classmethod
    def _as_text(cls, args: Any) -> Any:
        """``[--tp, 2]`` in YAML holds a number: a command line is text."""
        if isinstance(args, list):
            return [a if isinstance(a, str) else json.dumps(a) for a in args]
        return args

    def seeded(self, seed: int, resumed_at: int | None = None) -> EngineConfig:
        """This engine sampling from the job's ``seed`` unless it names its own: a rerun
        replays its draws, another seed draws others (``rollout/engines.py::engine_seed``).
        A job resumed after step ``resumed_at`` samples from that seed mixed with the step:
        a stream of its own, not a replay of the first run's draws on new prompts (the same
        resume point replays the same stream)."""
        own = self if self.seed is not None else self.model_copy(update={"seed": seed})
        if resumed_at is None:
            return own
        mixed = zlib.crc32(f"{own.seed}/resumed-after-{resumed_at}".encode())
        return own.model_copy(update={"seed": mixed})

    @model_validator(mode="after")
    def _sim_is_embedded(self) -> EngineConfig:
        if self.type != "sim":
            return self
        if self.serve != "embedded" or self.urls:
            raise ValueError("the sim engine runs embedded in the rollout actor: no urls, serve")
        if self.model_path:
            sim_shape(self.model_path)  # its vocabulary and EOS: refused now, not at launch
        return self

    @model_validator(mode="after")
    def _complete(self) -> EngineConfig:
        if (self.type == "torch" or self.serve == "actor") and not self.model_path:
            raise ValueError(f"the {self.type} engine needs model_path (an HF model directory)")
        if self.serve == "actor" and self.urls:
            raise ValueError(
                "serve: actor starts its own engines; urls are for engines started elsewhere"
            )
        if self.type in ("sglang", "vllm") and self.serve == "embedded" and not self.urls:
            raise ValueError(
                f"the {self.type} engine type needs urls (server addresses), or serve: actor"
            )
        if self.type == "vllm" and self.router:
            raise ValueError("router: the one url is an sglang-router; vLLM servers are listed")
        taken = [a for a in self.server_args if a.split("=")[0] in _ASSIGNED_SERVER_ARGS]
        if taken:
            raise ValueError(f"server_args {taken}: the engine actor assigns these itself")
        if self.server_args and not (self.type in ("sglang", "vllm") and self.serve == "actor"):
            raise ValueError("server_args apply to launched sglang and vllm servers only")
        if self.type == "vllm":
            from asyncrl.engines.vllm_launch import check_extra

            check_extra(self.server_args)
        if self.vllm_python and not (self.type == "vllm" and self.serve == "actor"):
            raise ValueError("vllm_python is the interpreter of launched vllm servers only")
        if self.vllm_python:
            from asyncrl.engines.vllm_launch import vllm_python

            try:
                vllm_python(self.vllm_python)
            except FileNotFoundError as exc:
                raise ValueError(str(exc)) from None

        return self


class ToolConfig(BaseModel):
    """One tool of a multi-turn rollout (``rollout/tools/``).

    ``calculator``; ``python`` (the sandbox, with its limits); ``search`` (BM25 over
    ``corpus``); ``custom``: ``path`` names a ``module:factory`` returning a ``Tool``.
    """

    model_config = ConfigDict(extra="forbid")

    type: Literal["calculator", "python", "search", "custom"] = Field(..., description="tool")
    corpus: str | None = Field(None, description="search: jsonl/parquet corpus ('text' rows)")
    k: int = Field(3, ge=1, description="search: results per query")
    max_chars: int = Field(500, ge=1, description="search: characters shown per result")
    cpu_s: int = Field(5, ge=1, description="python: CPU seconds per call")
    memory_mb: int = Field(512, ge=16, description="python: address space per call, MiB")
    wall_s: float = Field(10.0, gt=0, description="python: wall-clock seconds per call")
    output_bytes: int = Field(16384, ge=1, description="python: captured bytes per stream")
    isolate: bool = Field(
        True,
        description="python: Landlock away the job's files, TCP and processes (needs Linux "
        "6.7+; false runs snippets with the limits only)",
    )
    path: str | None = Field(None, description="custom: 'module:factory' returning a Tool")

    @model_validator(mode="after")
    def _complete(self) -> ToolConfig:
        if self.type == "search" and not self.corpus:
            raise ValueError("the search tool needs corpus (a jsonl/parquet file of documents)")
        if self.type == "custom" and not self.path:
            raise ValueError("a custom tool needs path ('module:factory' returning a Tool)")
        return self


class ToolUseConfig(BaseModel):
    """Multi-turn tool use (``rollout/multi_turn.py``): the tools and the episode limits.

    Setting ``rollout.tool_use`` runs the multi-turn workflow (unless ``rollout.workflow``
    names another) and renders prompts with the tools' schemas when a row has none.
    """

    model_config = ConfigDict(extra="forbid")

    tools: list[ToolConfig] = Field(..., min_length=1, description="the tools offered")
    max_turns: int = Field(8, ge=1, description="assistant turns per episode at most")
    max_tokens_per_turn: int | None = Field(None, ge=1, description="default: the budget")
    parser: str = Field(
        "hermes", description="'hermes', 'llama3' or 'module:Class' (a ToolCallParser)"
    )
    timeout_s: float = Field(30.0, gt=0, description="a tool call slower than this fails")
    max_output_chars: int = Field(4096, ge=1, description="observation characters per call")


class AgentConfig(BaseModel):
    """An agent written against the ``openai`` client, trained through the OpenAI proxy
    (``rollout/openai_proxy.py``): one episode per sample, the agent runs its own tools."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        ..., min_length=1, description="'module:function': async def agent(session, task)"
    )
    max_calls: int = Field(16, ge=1, description="chat completions per episode at most")
    timeout_s: float = Field(600.0, gt=0, description="an episode longer than this fails")
    parser: str = Field(
        "hermes", description="'hermes', 'llama3' or 'module:Class' (a ToolCallParser)"
    )


class RolloutConfig(BaseModel):
    """Rollout actors: how many, their engines, sampling, workflow and reward."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    num_actors: int = Field(2, ge=1, description="number of rollout actors")
    engine: EngineConfig | None = Field(
        None, description="engines of each actor; default: embedded torch on the trainer's model"
    )
    sampling: dict[str, Any] = Field(
        default_factory=lambda: {"temperature": 1.0, "max_new_tokens": 64},
        description="SGLang sampling params of training rollouts (max_new_tokens: budget)",
    )
    max_groups: int = Field(8, ge=1, description="groups in flight per rollout actor")
    workflow: str | None = Field(
        None,
        description="custom workflow 'module:function' (default single-turn)",
        json_schema_extra={"flag": "custom-generate-function-path"},
    )
    reward: RewardConfig = Field(
        default_factory=lambda: RewardConfig(), description="the reward scorer's settings"
    )
    tool_use: ToolUseConfig | None = Field(
        None, description="multi-turn tool use: tools and limits (null: single-turn)"
    )
    agent: AgentConfig | None = Field(
        None, description="an openai-client agent trained through the proxy (null: none)"
    )
    colocate: bool = Field(
        False,
        description="engines and trainer share devices: engines release their memory "
        "before each train step and resume it for the new weights (needs max_staleness 0)",
        json_schema_extra={"flag": "colocate"},
    )

    @field_validator("sampling")
    @classmethod
    def _valid_sampling(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_sampling(value)
        return check_trainable_sampling(value)

    @model_validator(mode="after")
    def _vllm_reports_untruncated(self) -> RolloutConfig:
        """vLLM reports log-probs of the truncated distribution (engines/vllm_engine.py):
        refuse truncated training rollouts now, not as every sample's failure."""
        if self.engine is None or self.engine.type != "vllm":
            return self
        neutral = {"top_p": (1.0,), "top_k": (-1, 0), "min_p": (0.0,)}
        bad = [k for k, off in neutral.items() if self.sampling.get(k, off[0]) not in off]
        greedy = float(self.sampling.get("temperature", 1.0)) == 0
        if bad and not greedy:
            raise ValueError(
                f"rollout.sampling sets {', '.join(bad)}: a vLLM engine reports log-probs "
                "of the truncated distribution, not log_softmax(logits / temperature); "
                "sample without truncation"
            )
        return self


def check_sampling(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` if it is valid SGLang sampling params; else a ValueError naming the field."""
    import msgspec

    from asyncrl.engines.base import SamplingParams

    try:
        msgspec.convert(value, SamplingParams).verify()
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"invalid sampling params: {exc}") from None
    return value


#: Sampling keys whose effect on the engine's distribution the trainer does not reproduce
#: (it recomputes ``log_softmax(z / T)``; engines/sampling.py), with their neutral values.
UNTRAINABLE_SAMPLING = {
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "logit_bias": None,
    # EOS and stop ids are masked out of the reported distribution while it is short of
    # min_new_tokens (engines/sampling.py), which the trainer does not know.
    "min_new_tokens": 0,
}


def check_trainable_sampling(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` unless it sets a key the trainer cannot reproduce (a ValueError naming it):
    training rollouts' log-probs must be the policy's ``log_softmax(z / T)``."""
    bad = [k for k, neutral in UNTRAINABLE_SAMPLING.items() if (value.get(k) or neutral) != neutral]
    if bad:
        raise ValueError(
            f"rollout.sampling sets {', '.join(bad)}: the trainer recomputes each token's "
            "log-prob as log_softmax(logits / temperature) and cannot reproduce penalties, "
            "logit_bias or min_new_tokens' masking, so training would correct for a policy "
            "it never sampled from; drop them (an eval set's own sampling may use them)"
        )
    return value


class EvalSetConfig(BaseModel):
    """One named held-out set: its prompts, and its own reward and sampling settings."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, description="name of the set in metrics/eval.jsonl")
    path: str = Field(..., min_length=1, description="jsonl/parquet file; 'file@[a:b]' rows")
    input_key: str = Field("prompt", description="key of the prompt")
    label_key: str = Field("label", description="key of the label")
    metadata_key: str | None = Field("metadata", description="key of a metadata object")
    apply_chat_template: bool | None = Field(
        None, description="render with the chat template; default: the training data's"
    )
    reward: RewardConfig | None = Field(None, description="default: the rollout reward")
    sampling: dict[str, Any] | None = Field(None, description="default: rollout sampling")
    n_samples: int = Field(1, ge=1, description="samples per prompt (pass@k needs k of them)")
    pass_k: list[int] = Field(default_factory=lambda: [1], description="k of each pass@k")
    group_by: str | None = Field(None, description="metadata key to break accuracy down by")

    @model_validator(mode="after")
    def _k_fits(self) -> EvalSetConfig:
        bad = [k for k in self.pass_k if not 1 <= k <= self.n_samples]
        if bad:
            raise ValueError(
                f"eval set {self.name!r}: pass@k needs 1 <= k <= n_samples "
                f"({self.n_samples}); got k={bad}"
            )
        if self.sampling is not None:
            check_sampling(self.sampling)
        return self


class EvalConfig(BaseModel):
    """Evaluation during training: an eval actor follows the trainer's weight versions."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    interval: int = Field(0, ge=0, description="evaluate every N trainer steps; 0: never")
    sets: list[EvalSetConfig] = Field(default_factory=list, description="named held-out sets")
    at_start: bool = Field(True, description="evaluate the initial weights (version 0) too")
    engine: EngineConfig | None = Field(None, description="default: like the rollout engine")
    max_concurrency: int = Field(256, ge=1, description="eval requests in flight at once")
    nice: int = Field(
        10,
        ge=0,
        le=19,
        description="CPU priority the eval actor gives up (os.nice): off the training's "
        "critical path, it takes the cores the trainer and rollouts leave; 0: an equal share",
    )
    final_timeout: float = Field(
        600.0, gt=0, description="seconds the job waits for the final version's eval"
    )
    final_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads of the final version's eval, which runs after training "
        "and the rollouts end; default: every core of the machine",
    )

    @model_validator(mode="after")
    def _sets_when_on(self) -> EvalConfig:
        if self.interval > 0 and not self.sets:
            raise ValueError("eval.interval is set but eval.sets is empty: name a held-out set")
        names = [s.name for s in self.sets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval set names must be unique, got {names}")
        return self

    @property
    def enabled(self) -> bool:
        """True when an eval actor runs."""
        return self.interval > 0


def sim_shape(model_path: str) -> dict[str, int]:
    """``vocab_size`` and ``eos_token_id`` of ``model_path``'s ``config.json`` (a sim
    engine's tokens must fit the model that is trained on them); ``ValueError`` naming the
    file when it has no vocabulary."""
    path = Path(model_path).expanduser() / "config.json"
    try:
        hf = json.loads(path.read_text())
        shape = {"vocab_size": int(hf["vocab_size"])}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"the sim engine takes its vocabulary from {path}, which has none "
            f"({type(exc).__name__}: {exc})"
        ) from None
    eos = hf.get("eos_token_id")
    if eos is not None:
        shape["eos_token_id"] = int(eos[0] if isinstance(eos, list) else eos)
    return shape
