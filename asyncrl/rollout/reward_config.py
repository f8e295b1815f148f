"""The reward's settings: which reward scores a sample (``RewardConfig``, for
``rollout.reward`` and an eval set's ``reward``), and the reward model's and the generative
judge's own (no torch, no HTTP imports here; ``rollout/config.py`` composes them).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class RewardModelConfig(BaseModel):
    """A reward model (``rollout/reward_model.py``): an HF sequence-classification folder,
    served in a job by a reward actor of its own (``actors/reward_model.py``)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        ...,
        min_length=1,
        description="HF sequence-classification model folder",
        json_schema_extra={"flag": "reward-model-path"},
    )
    device: str = Field("cpu", description="torch device of the reward model")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weights")
    batch_size: int = Field(16, ge=1, description="pairs scored in one forward at most")
    batch_wait_ms: float = Field(
        5.0, ge=0, description="how long a batch waits for more pairs after its first"
    )
    max_length: int = Field(
        4096, ge=8, description="tokens of prompt and response; a longer pair fails alone"
    )
    label_index: int = Field(
        0, ge=0, description="the logit that is the score (0 for a one-label reward head)"
    )
    threads: int | None = Field(
        None, ge=1, description="torch threads of the reward actor; None: torch's default"
    )


#: The judge's default instructions: a grade from 0 to 10 on the reply's last line.
JUDGE_TEMPLATE = (
    "You grade answers. Question:\n{prompt}\n\nReference answer: {label}\n\n"
    "Answer to grade:\n{response}\n\nIs the answer correct and complete? Reply with a "
    "short reason, then a last line of the form SCORE: <0-10>."
)


class JudgeConfig(BaseModel):
    """A generative judge (``rollout/judge.py``): an OpenAI-compatible chat endpoint asked
    to grade each response, its grade read from the reply."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(..., min_length=1, description="OpenAI-compatible base URL (.../v1)")
    model: str = Field(..., min_length=1, description="the judge model's name at that URL")
    api_key_env: str | None = Field(
        None, description="environment variable that holds the API key (never the key)"
    )
    template: str = Field(
        JUDGE_TEMPLATE, description="the user message; {prompt} {response} {label} filled in"
    )
    system: str | None = Field(None, description="a system message before it")
    score_pattern: str = Field(
        r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)",
        description="regex whose group is the grade; its last match in the reply counts",
    )
    scale: float = Field(10.0, gt=0, description="reward = grade / scale")
    verdicts: dict[str, float] | None = Field(
        None,
        description="words the grade may be, and their rewards (e.g. {yes: 1, no: 0}, "
        "case-insensitive); None: the grade is a number",
    )
    temperature: float = Field(0.0, ge=0, description="the judge's sampling temperature")
    max_tokens: int = Field(256, ge=1, description="the judge's reply budget")
    max_concurrency: int = Field(16, ge=1, description="requests in flight at once")
    retries: int = Field(3, ge=0, description="retries of a 429, a 5xx or a lost connection")
    request_timeout_s: float = Field(60.0, gt=0, description="one request's limit")

    @field_validator("score_pattern")
    @classmethod
    def _one_group(cls, value: str) -> str:
        try:
            groups = re.compile(value).groups
        except re.error as exc:
            raise ValueError(f"score_pattern {value!r} is not a regex: {exc}") from None
        if groups != 1:
            raise ValueError(f"score_pattern {value!r} needs exactly one group (the grade)")
        return value

    @field_validator("template")
    @classmethod
    def _fields_known(cls, value: str) -> str:
        import string

        names = {f for _, f, _, _ in string.Formatter().parse(value) if f is not None}
        unknown = names - {"prompt", "response", "label"}
        if unknown or "response" not in names:
            raise ValueError(
                f"template fields {sorted(names)}: it must use {{response}} and may use "
                "{prompt} and {label}, nothing else"
            )
        return value


#: The default limit of a reward, and of one that queues for a shared model or judge.
QUICK_TIMEOUT_S, QUEUED_TIMEOUT_S = 10.0, 600.0


class RewardConfig(BaseModel):
    """The reward scorer (``rollout/rewards.py``): which reward, and its limits.

    ``type``: ``exact`` / ``numeric`` / ``math`` / ``f1`` compare the answer in the
    response with the sample's label; ``dapo`` / ``deepscaler`` are those recipes' own
    checks of the whole response; ``model`` scores with a reward model (``model``);
    ``judge`` asks a generative judge over an OpenAI-compatible API (``judge``);
    ``custom`` calls ``path`` (``module:function``, slime's ``--custom-rm-path``);
    ``remote`` POSTs to ``url``.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    type: Literal[
        "exact",
        "numeric",
        "math",
        "f1",
        "dapo",
        "deepscaler",
        "model",
        "judge",
        "custom",
        "remote",
    ] = Field("exact", description="which reward", json_schema_extra={"flag": "rm-type"})
    path: str | None = Field(
        None,
        description="custom reward 'module:function' (sync or async, fn(sample))",
        json_schema_extra={"flag": "custom-rm-path"},
    )
    url: str | None = Field(None, description="remote reward model URL (POST JSON)")
    model: RewardModelConfig | None = Field(
        None, description="the reward model of type model (a reward actor serves it)"
    )
    judge: JudgeConfig | None = Field(None, description="the generative judge of type judge")
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="a reward slower than this fails, its wait for a turn included; "
        f"default {QUICK_TIMEOUT_S:g} s, {QUEUED_TIMEOUT_S:g} s for model and judge (they "
        "queue: a batch of samples waits for one reward model or judge)",
    )
    answer_pattern: str | None = Field(
        None,
        description="regex whose one group (or whole match) is the answer; its last match counts",
    )
    numeric_tolerance: float = Field(1e-6, ge=0, description="numeric: allowed difference")
    correct: float = Field(1.0, description="reward of a correct answer")
    incorrect: float = Field(0.0, description="reward of a wrong answer")
    truncated: float | None = Field(
        None,
        allow_inf_nan=False,
        description="the reward of a reply cut off (status truncated: its token budget, or "
        "a multi-turn episode's context or turn limit), unscored (DAPO's overlong "
        "punishment: an unfinished reply states no answer, though its last number may "
        "match); None: scored as any other",
    )
    terms: list[RewardTerm] = Field(
        default_factory=list,
        description="several rewards, each {name, weight, type, path, ...} (TRL's "
        "reward_funcs and reward_weights): the reward is {name: value, ..., score: the "
        "weighted sum}, and the trainer trains on score",
    )

    @property
    def limit_s(self) -> float:
        """``timeout_s``, or its default for this type."""
        if self.timeout_s is not None:
            return self.timeout_s
        return QUEUED_TIMEOUT_S if self.type in ("model", "judge") else QUICK_TIMEOUT_S

    @field_validator("answer_pattern")
    @classmethod
    def _valid_pattern(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            groups = re.compile(value).groups
        except re.error as exc:
            raise ValueError(f"answer_pattern {value!r} is not a regex: {exc}") from None
        if groups > 1:
            raise ValueError(
                f"answer_pattern {value!r} has {groups} groups; use one (?:...) for the others"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _path_selects_custom(cls, data: Any) -> Any:
        """A custom path (or remote url) without a type selects that type, as slime's
        ``--custom-rm-path`` does; with another type it is a contradiction (``_complete``)."""
        if isinstance(data, dict) and "type" not in data:
            if data.get("path"):
                return {**data, "type": "custom"}
            if data.get("url"):
                return {**data, "type": "remote"}
            if data.get("model"):
                return {**data, "type": "model"}
            if data.get("judge"):
                return {**data, "type": "judge"}
        return data

    @model_validator(mode="after")
    def _complete(self) -> RewardConfig:
        if self.terms:
            return self._terms_alone()
        if self.path and self.type != "custom":
            raise ValueError(
                f"path (--custom-rm-path {self.path}) is set but the reward type is "
                f"{self.type!r} (--rm-type): drop --rm-type to use the custom reward, or "
                "drop --custom-rm-path"
            )
        if self.url and self.type != "remote":
            raise ValueError(
                f"url {self.url} is set but the reward type is {self.type!r}: drop the type "
                "to use the remote reward, or drop the url"
            )
        if self.answer_pattern is not None and self.type in ("dapo", "deepscaler"):
            raise ValueError(
                f"answer_pattern is set but the {self.type} reward finds the answer by its "
                "own rule (DAPO: the last 'Answer:' line; DeepScaleR: the last \\boxed{}): "
                "drop answer_pattern"
            )
        if (self.model is not None) != (self.type == "model"):
            raise ValueError(
                "the model reward needs model (--reward-model-path DIR)"
                if self.type == "model"
                else f"model is set but the reward type is {self.type!r}: drop one"
            )
        if (self.judge is not None) != (self.type == "judge"):
            raise ValueError(
                "the judge reward needs judge (url and model)"
                if self.type == "judge"
                else f"judge is set but the reward type is {self.type!r}: drop one"
            )
        if self.type == "custom" and not self.path:
            raise ValueError("the custom reward needs path (--custom-rm-path module:function)")
        if self.type == "remote" and not self.url:
            raise ValueError("the remote reward needs url")
        return self

    def _terms_alone(self) -> RewardConfig:
        """With ``terms`` the reward is theirs: a type, path or url beside them would be
        silently unused."""
        stray = [k for k in ("path", "url", "model", "judge") if getattr(self, k)]
        stray += ["truncated"] if self.truncated is not None else []
        stray += ["type"] if self.type != "exact" else []  # read back from a dump, it is set
        if stray:
            raise ValueError(
                f"reward.terms replaces the single reward: drop {', '.join(stray)} (give "
                "each term its own)"
            )
        names = [t.name for t in self.terms]
        dup = sorted({n for n in names if names.count(n) > 1} | ({"score"} & set(names)))
        if dup:
            raise ValueError(
                f"reward.terms names must be unique and not 'score' (the weighted sum): {dup}"
            )
        return self


class RewardTerm(RewardConfig):
    """One reward of ``RewardConfig.terms``: a reward of its own, its name and weight."""

    name: str = Field(..., min_length=1, description="the term's key in the reward dict")
    weight: float = Field(1.0, description="its weight in the score (TRL's reward_weights)")

    @model_validator(mode="after")
    def _flat(self) -> RewardTerm:
        if self.terms:
            raise ValueError(f"reward term {self.name!r} has terms of its own: terms are flat")
        return self


RewardConfig.model_rebuild()  # its terms are RewardTerms, defined after it


def reward_models(*rewards: RewardConfig | None) -> list[RewardModelConfig]:
    """The distinct reward models that ``rewards`` (and their terms) score with."""
    found: list[RewardModelConfig] = []
    for r in rewards:
        for one in [r, *r.terms] if r is not None else []:
            if one.model is not None and one.model not in found:
                found.append(one.model)
    return found
