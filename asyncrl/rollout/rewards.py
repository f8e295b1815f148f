"""The reward scorer: scores a finished sample; a failure is the sample's, never the run's.

``build_reward`` gives the ``RewardScorer`` of ``rollout.reward``: a built-in comparison of
the response's answer with the sample's ``label`` (``exact``, ``numeric``, ``math``, ``f1``,
``dapo``, ``deepscaler``), a reward model, a judge, a user function, a remote URL, or
weighted ``terms`` of these. A timeout, an exception or a result that is not a finite
number (or a dict of them) raises ``RewardError`` with the reason, which fails the sample:
it never becomes a reward of 0, ``stats`` counts it.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import math
import numbers
import re
import string
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from asyncrl.plugins import load_object
from asyncrl.rollout.base import Reward
from asyncrl.rollout.math_graders import dapo_correct, deepscaler_correct
from asyncrl.rollout.reward_config import RewardConfig, RewardTerm
from asyncrl.types import Sample, SampleStatus

__all__ = [
    "RewardConfig",
    "RewardError",
    "RewardScorer",
    "build_reward",
    "exact_match",
    "extract_answer",
    "f1_score",
    "last_boxed",
    "last_number",
    "math_match",
    "numeric_match",
]

_NUMBER = re.compile(r"[-+]?(?:\d+(?:,\d{3})*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_BOXED = "\\boxed{"
_BUILTINS = ("exact", "numeric", "math", "f1", "dapo", "deepscaler")


_PEER_GRADERS = {"dapo": dapo_correct, "deepscaler": deepscaler_correct}


def unscorable(cfg: RewardConfig, label: Any, metadata: dict[str, Any]) -> str | None:
    """Why ``cfg`` can never score a row with ``label`` and ``metadata`` (an ``rm_type``
    that is no built-in, a built-in reward without a label), or None: found before the
    job starts, not sample by sample."""
    if cfg.terms:
        needs = [t.type for t in cfg.terms if t.type in _BUILTINS]
    elif cfg.type in _BUILTINS:
        kind = metadata.get("rm_type", cfg.type)
        if kind not in _BUILTINS:
            return f"rm_type {kind!r} is not a built-in reward ({', '.join(_BUILTINS)})"
        needs = [kind]
    else:
        return None
    return f"no label, which the {needs[0]} reward needs" if needs and label is None else None


class ScoresPairs(Protocol):
    """A reward model as the scorer calls it (``RewardModel``, ``RewardModelClient``)."""

    async def score(self, prompt: str | list[dict[str, Any]], response: str) -> float: ...


class RewardError(RuntimeError):
    """A reward could not be computed; the message is the sample's failure reason."""


# ---------------------------------------------------------------- answers and built-ins


def extract_answer(text: str, pattern: str | None = None) -> str:
    """The answer part of ``text``, by the first rule that applies.

    ``pattern``'s first group (its whole match if it has none) at the last match, or
    "" when it never matches; else the text after the last ``####``; else the content of
    the last ``\\boxed{...}``; else ``text`` itself. The result is stripped.
    """
    if pattern is not None:
        found = list(re.finditer(pattern, text))
        if not found:
            return ""
        last = found[-1]
        return (last.group(1) if last.re.groups else last.group(0)).strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = last_boxed(text)
    return (boxed if boxed is not None else text).strip()


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` with balanced braces, or None."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth, begin = 1, start + len(_BOXED)
        for i in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[begin:i]
        start = text.rfind(_BOXED, 0, start)  # unclosed: try the one before
    return None


def exact_match(answer: str, label: Any) -> bool:
    """``answer == label`` after stripping surrounding whitespace."""
    return answer.strip() == str(label).strip()


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (``1,234.5``, ``-3``, ``2e-3``), or None."""
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def numeric_match(answer: str, label: Any, tol: float = 1e-6) -> bool:
    """The last numbers ``a`` of ``answer`` and ``b`` of ``label`` satisfy
    ``|a - b| <= tol * max(1, |b|)``; False when either has no number.
    """
    a, b = last_number(answer), last_number(str(label))
    if a is None or b is None:
        return False
    return abs(a - b) <= tol * max(1.0, abs(b))


def math_match(answer: str, label: Any) -> bool:
    """Symbolic equality by ``math-verify`` (``\\frac{1}{2}`` equals ``0.5``).

    math-verify's own timeouts use ``signal.alarm``, which only works on the main thread,
    so they are off here: the scorer runs this in a worker thread under ``timeout_s``.
    """
    from math_verify import verify

    gold, pred = _parse_math(str(label)), _parse_math(answer)
    return bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=None))


def _parse_math(text: str) -> list[Any]:
    from math_verify import parse

    # Bare LaTeX such as ``\frac{\sqrt{2}}{2}`` is only found inside math delimiters.
    return parse(text, parsing_timeout=None) or parse(f"${text}$", parsing_timeout=None)


def f1_score(answer: str, label: Any) -> float:
    """SQuAD token F1 of ``answer`` against ``label`` (or the best of a list of labels).

    With ``common`` the multiset intersection of the normalised tokens,
    ``P = common / len(answer)``, ``R = common / len(label)``, ``F1 = 2 P R / (P + R)``;
    two empty token lists score 1, one empty list scores 0.
    """
    labels = label if isinstance(label, list) else [label]
    return max((_f1(answer, str(gold)) for gold in labels), default=0.0)


def _f1(answer: str, gold: str) -> float:
    pred, ref = _tokens(answer), _tokens(gold)
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if not pred or not ref or common == 0:
        return float(pred == ref)
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _tokens(text: str) -> list[str]:
    """SQuAD normalisation: lower case, drop punctuation, drop articles, split."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return _ARTICLES.sub(" ", text).split()


# ------------------------------------------------------------------------- the scorer


class RewardScorer:
    """``await hub(sample)`` -> reward; ``stats`` counts calls and failures; ``aclose()``.

    Every call has ``timeout_s``. ``stats``: ``reward/calls``, ``reward/errors`` (raised or
    returned garbage) and ``reward/timeouts`` (slower than ``timeout_s``). Build it with
    ``build_reward``.
    """

    def __init__(
        self,
        config: RewardConfig,
        *,
        per_sample_type: bool = True,
        reward_model: ScoresPairs | None = None,
    ) -> None:
        self.config = config
        self._reward_model = reward_model  # the ``model`` reward's (and its terms')
        # A term keeps its own type: a sample's rm_type picks the single reward's.
        self._per_sample_type = per_sample_type
        self.stats = {"reward/calls": 0, "reward/errors": 0, "reward/timeouts": 0}
        self._session: Any = None
        self._judge: Any = None
        self._terms: list[tuple[RewardTerm, RewardScorer]] = []
        self._fn = self._build()
        # Terms run concurrently, each under its own limit: the whole waits for the slowest.
        self._timeout_s = max([config.limit_s, *(t.limit_s for t in config.terms)])

    def _build(self) -> Callable[[Sample], Awaitable[Any]]:
        cfg = self.config
        if cfg.terms:
            self._terms = [
                (t, RewardScorer(t, per_sample_type=False, reward_model=self._reward_model))
                for t in cfg.terms
            ]
            return self._weighted
        if cfg.type == "model":
            if self._reward_model is None:
                raise ValueError(
                    "the model reward needs its reward model: in a job the reward actor "
                    "serves it (build_reward(config, reward_model=...))"
                )
            return self._model
        if cfg.type == "judge":
            from asyncrl.rollout.judge import Judge

            assert cfg.judge is not None  # RewardConfig requires it
            self._judge = Judge(cfg.judge)
            return self._judge.score
        if cfg.type == "custom":
            assert cfg.path is not None  # RewardConfig requires it
            return _custom(cfg.path)
        if cfg.type == "remote":
            return self._remote
        return self._builtin

    async def __call__(self, sample: Sample) -> Reward:
        """The reward of ``sample``; ``RewardError`` says why there is none."""
        self.stats["reward/calls"] += 1
        if self.config.truncated is not None and sample.status is SampleStatus.TRUNCATED:
            return self.config.truncated
        try:
            async with asyncio.timeout(self._timeout_s) as deadline:
                value = await self._fn(sample)
        except TimeoutError as exc:
            if deadline.expired():
                self.stats["reward/timeouts"] += 1
                raise RewardError(f"reward timed out after {self._timeout_s:g}s") from None
            raise self._error(exc) from exc
        except RewardError:
            self.stats["reward/errors"] += 1
            raise
        except Exception as exc:  # user code or the network: the sample fails, we go on
            raise self._error(exc) from exc
        return self._checked(value)

    def _error(self, exc: Exception) -> RewardError:
        self.stats["reward/errors"] += 1
        return RewardError(f"{self.config.type} reward raised {type(exc).__name__}: {exc}")

    def _checked(self, value: Any) -> Reward:
        """A finite float, or a non-empty dict of them; anything else is ``RewardError``."""
        if (number := _finite(value)) is not None:
            return number
        if isinstance(value, dict) and value:
            numbers_ = {str(k): _finite(v) for k, v in value.items()}
            if all(v is not None for v in numbers_.values()):
                return {k: v for k, v in numbers_.items() if v is not None}
        self.stats["reward/errors"] += 1
        raise RewardError(
            f"reward returned {_short(value)}, expected a number or a dict of numbers"
        )

    async def _weighted(self, sample: Sample) -> dict[str, float]:
        """TRL's ``reward_funcs`` with ``reward_weights``: every term concurrently, giving
        ``{name: value, ..., "score": sum(weight * value)}``; the trainer trains on
        ``score``. A failing term fails the sample, named in the reason."""
        try:  # the first failing term cancels the others
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._term(t, s, sample)) for t, s in self._terms]
        except* RewardError as failed:
            raise failed.exceptions[0] from None
        out = {term.name: task.result() for (term, _), task in zip(self._terms, tasks, strict=True)}
        out["score"] = sum(term.weight * out[term.name] for term, _ in self._terms)
        return out

    @staticmethod
    async def _term(term: RewardTerm, scorer: RewardScorer, sample: Sample) -> float:
        try:
            value = await scorer(sample)
        except RewardError as exc:
            raise RewardError(f"reward term {term.name!r}: {exc}") from exc
        if isinstance(value, dict):
            raise RewardError(f"reward term {term.name!r} returned a dict: a term is one number")
        return value

    async def _builtin(self, sample: Sample) -> float:
        """``correct`` or ``incorrect`` (f1: the F1 itself) for the answer in the response.
        A list label holds every acceptable answer (the best counts); a sample's
        ``metadata["rm_type"]`` (slime's per-sample reward type) picks the comparison in
        place of ``type``, except in a term."""
        cfg = self.config
        kind = sample.metadata.get("rm_type", cfg.type) if self._per_sample_type else cfg.type
        if kind not in _BUILTINS:
            raise RewardError(
                f"the sample's rm_type {kind!r} is not a built-in reward ({', '.join(_BUILTINS)})"
            )
        if sample.label is None:
            raise RewardError(f"the {kind} reward needs a label and the sample has none")
        labels = sample.label if isinstance(sample.label, list) else [sample.label]
        if kind in _PEER_GRADERS:  # they read the whole response, by their own rules
            grader, text = _PEER_GRADERS[kind], sample.response_text
            ok = await asyncio.to_thread(lambda: any(grader(text, str(g)) for g in labels))
            return cfg.correct if ok else cfg.incorrect
        answer = extract_answer(sample.response_text, cfg.answer_pattern)
        if kind == "f1":
            return f1_score(answer, labels)
        if kind == "math":  # sympy can take a while: keep it off the event loop
            ok = await asyncio.to_thread(_any_math, answer, labels)
        elif kind == "numeric":
            ok = any(numeric_match(answer, gold, cfg.numeric_tolerance) for gold in labels)
        else:
            ok = any(exact_match(answer, gold) for gold in labels)
        return cfg.correct if ok else cfg.incorrect

    async def _model(self, sample: Sample) -> float:
        assert self._reward_model is not None
        return await self._reward_model.score(sample.prompt, sample.response_text)

    async def _remote(self, sample: Sample) -> Any:
        """POST ``{"prompt", "response", "label", "metadata"}`` to ``url``; the reply is
        ``{"reward": x}`` or a bare number."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        body = {
            "prompt": sample.prompt,
            "response": sample.response_text,
            "label": sample.label,
            "metadata": sample.metadata,
        }
        url = self.config.url
        async with self._session.post(url, json=body) as resp:
            text = await resp.text()
            if not 200 <= resp.status < 300:
                raise RewardError(f"remote reward {url} answered HTTP {resp.status}: {text[:200]}")
        return _remote_value(url, text)

    async def aclose(self) -> None:
        """Close the remote reward's HTTP session (the rollout actor does, on exit)."""
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._judge is not None:
            await self._judge.aclose()
        for _, scorer in self._terms:
            await scorer.aclose()


def build_reward(config: RewardConfig, reward_model: ScoresPairs | None = None) -> RewardScorer:
    """The hub for ``config``; a bad custom path fails here, before any sample.
    ``reward_model`` scores the ``model`` reward (``rollout/reward_model.py``: the reward
    actor's client in a job, a ``RewardModel`` of its own elsewhere)."""
    return RewardScorer(config, reward_model=reward_model)


# ---------------------------------------------------------------------------- helpers


def _custom(path: str) -> Callable[[Sample], Awaitable[Any]]:
    """The user's ``fn(sample) -> float | dict[str, float]`` (slime's ``--custom-rm-path``)
    as an async function (sync ones go to a worker thread, off the event loop)."""
    fn = load_object(path, what="reward")
    if not callable(fn):
        raise ValueError(f"reward path {path!r} names a {type(fn).__name__}, not a function")
    # An object whose class defines ``async def __call__`` is async too.
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        return fn

    async def in_thread(sample: Sample) -> Any:
        value = await asyncio.to_thread(fn, sample)
        # A sync wrapper (functools.partial, a decorator) may hand back a coroutine.
        return await value if inspect.isawaitable(value) else value

    return in_thread


def _any_math(answer: str, labels: list[Any]) -> bool:
    return any(math_match(answer, gold) for gold in labels)


def _finite(value: Any) -> float | None:
    """``value`` as a finite float when it is a real number (bools count), else None."""
    if not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _remote_value(url: str | None, text: str) -> Any:
    """The reward in a remote reply: ``{"reward": x}`` or a bare JSON number."""
    import json

    try:
        reply = json.loads(text)
    except ValueError:
        raise RewardError(f"remote reward {url} answered non-JSON: {text[:200]!r}") from None
    if isinstance(reply, dict):
        if "reward" not in reply:
            raise RewardError(f"remote reward {url} reply has no 'reward' field: {_short(reply)}")
        return reply["reward"]
    return reply


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
