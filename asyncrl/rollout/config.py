"""Rollout settings that the config tree composes (no torch, no HTTP imports here).

``RolloutConfig`` is the ``rollout`` section (actors, engines, sampling, workflow, tool use,
reward) and ``EvalConfig`` the ``eval`` section (named held-out sets, how often). The
reward's settings are in ``reward_config.py``, the engines' in ``engines/config.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncrl.engines.config import EngineConfig
from asyncrl.rollout.reward_config import RewardConfig


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

    num_actors: int = Field(
        2,
        ge=1,
        description="number of rollout actors; unset: 2, or 1 (with max_groups doubled) where "
        "a local CPU trainer lends its idle cores to its engine (runtime.lend_trainer_cores) "
        "and the machine has fewer cores than the trainer, two engines and the eval actor: "
        "each of two engines would run a thread beyond its share, taken from the trainer",
    )
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
        """vLLM reports log-probs of the truncated distribution (engines/vllm/engine.py):
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
    from asyncrl.rollout.base import parse_sampling

    parse_sampling(value)
    return value


#: Sampling keys whose effect on the engine's distribution the trainer does not reproduce
#: (it recomputes ``log_softmax(z / T)``; engines/torch/sampling.py), with their neutral values.
UNTRAINABLE_SAMPLING = {
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "logit_bias": None,
    # EOS and stop ids are masked out of the reported distribution while it is short of
    # min_new_tokens (engines/torch/sampling.py), which the trainer does not know.
    "min_new_tokens": 0,
    # A grammar masks tokens out before sampling: the log-probs are renormalised over
    # what it allows (engines/torch/grammar.py).
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
}


def check_trainable_sampling(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` unless it sets a key the trainer cannot reproduce (a ValueError naming it):
    training rollouts' log-probs must be the policy's ``log_softmax(z / T)``."""
    bad = [k for k, neutral in UNTRAINABLE_SAMPLING.items() if (value.get(k) or neutral) != neutral]
    if bad:
        raise ValueError(
            f"rollout.sampling sets {', '.join(bad)}: the trainer recomputes each token's "
            "log-prob as log_softmax(logits / temperature) and cannot reproduce penalties, "
            "logit_bias, min_new_tokens' masking or a grammar's, so training would correct "
            "for a policy it never sampled from; drop them (an eval set's own sampling may "
            "use them)"
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
