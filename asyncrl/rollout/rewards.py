"""The reward hub: scores a finished sample; a failure is the sample's, never the run's.

Built-ins compare the answer in the response with the sample's ``label``:

- ``exact``: the answers are equal after stripping whitespace;
- ``numeric``: both parse as numbers and ``|a - b| <= tol * max(1, |b|)``;
- ``math``: ``math_verify.verify(parse(label), parse(answer))`` (LaTeX, fractions, boxed);
- ``f1``: SQuAD token F1, ``2 P R / (P + R)`` with ``P = common / |answer tokens|`` and
  ``R = common / |label tokens|`` over lower-cased, punctuation- and article-free tokens;
  a list label scores the best match.

The answer is ``answer_pattern``'s group when given, else the text after the last
``####``, else the last ``\\boxed{...}``, else the whole response. ``custom`` calls a
user function ``fn(sample)`` (sync ones in a worker thread), ``remote`` POSTs
``{"prompt", "response", "label", "metadata"}`` and reads ``{"reward": x}``. Every call
has ``timeout_s``; a timeout, an exception or a non-number becomes ``RewardError`` with
the reason, which the rollout actor records as the sample's failure.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import math
import re
import string
from collections.abc import Awaitable, Callable
from typing import Any

from asyncrl.plugins import load_object
from asyncrl.rollout.base import Reward
from asyncrl.rollout.config import RewardConfig
from asyncrl.types import Sample

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_ARTICLES = re.compile(r"\b(a|an|the)\b")


class RewardError(RuntimeError):
    """A reward could not be computed; the message is the sample's failure reason."""


def extract_answer(text: str, pattern: str | None = None) -> str:
    """The answer part of ``text`` (see the module docstring for the order of rules)."""
    if pattern is not None:
        found = re.findall(pattern, text)
        return str(found[-1]).strip() if found else ""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = _BOXED.findall(text)
    return boxed[-1].strip() if boxed else text.strip()


def exact_match(answer: str, label: Any) -> bool:
    """``answer == label`` after stripping surrounding whitespace."""
    return answer.strip() == str(label).strip()


def numeric_match(answer: str, label: Any, tol: float = 1e-6) -> bool:
    """Both are numbers (commas allowed) and ``|a - b| <= tol * max(1, |b|)``."""
    try:
        a, b = (float(str(x).replace(",", "").strip()) for x in (answer, label))
    except ValueError:
        return False
    return math.isfinite(a) and abs(a - b) <= tol * max(1.0, abs(b))


def math_match(answer: str, label: Any) -> bool:
    """Symbolic equality by ``math-verify`` (``\\frac{1}{2}`` equals ``0.5``)."""
    from math_verify import parse, verify

    gold, pred = parse(_as_math(str(label))), parse(_as_math(answer))
    return bool(gold) and bool(pred) and bool(verify(gold, pred))


def _as_math(text: str) -> str:
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def f1_score(answer: str, label: Any) -> float:
    """Token F1 against ``label`` (or the best of a list of labels)."""
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
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return _ARTICLES.sub(" ", text).split()


class RewardHub:
    """``await hub(sample)`` -> reward; ``stats`` counts failures; ``aclose()`` at the end."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.stats = {"reward/calls": 0, "reward/errors": 0, "reward/timeouts": 0}
        self._fn = self._build()
        self._session: Any = None

    def _build(self) -> Callable[[Sample], Awaitable[Any]]:
        cfg = self.config
        if cfg.type == "custom":
            assert cfg.path is not None
            fn = load_object(cfg.path, what="reward")
            if not callable(fn):
                raise ValueError(f"reward path {cfg.path!r} is not callable")
            if inspect.iscoroutinefunction(fn):
                return fn
            return lambda sample: asyncio.to_thread(fn, sample)
        if cfg.type == "remote":
            return self._remote
        return self._builtin

    async def __call__(self, sample: Sample) -> Reward:
        self.stats["reward/calls"] += 1
        try:
            async with asyncio.timeout(self.config.timeout_s):
                value = await self._fn(sample)
        except TimeoutError:
            self.stats["reward/timeouts"] += 1
            raise RewardError(f"reward timed out after {self.config.timeout_s:g}s") from None
        except RewardError:
            self.stats["reward/errors"] += 1
            raise
        except Exception as exc:  # user code or the network: the sample fails, we go on
            self.stats["reward/errors"] += 1
            raise RewardError(
                f"{self.config.type} reward raised {type(exc).__name__}: {exc}"
            ) from exc
        return self._checked(value)

    def _checked(self, value: Any) -> Reward:
        if isinstance(value, bool | int | float) and math.isfinite(float(value)):
            return float(value)
        if (
            isinstance(value, dict)
            and value
            and all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                for v in value.values()
            )
        ):
            return {str(k): float(v) for k, v in value.items()}
        self.stats["reward/errors"] += 1
        raise RewardError(f"reward returned {value!r}, expected a number or a dict of numbers")

    async def _builtin(self, sample: Sample) -> float:
        cfg = self.config
        answer = extract_answer(sample.response_text, cfg.answer_pattern)
        if cfg.type == "f1":
            return f1_score(answer, sample.label)
        if cfg.type == "math":
            ok = await asyncio.to_thread(math_match, answer, sample.label)
        elif cfg.type == "numeric":
            ok = numeric_match(answer, sample.label, cfg.numeric_tolerance)
        else:
            ok = exact_match(answer, sample.label)
        return cfg.correct if ok else cfg.incorrect

    async def _remote(self, sample: Sample) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        body = {
            "prompt": sample.prompt,
            "response": sample.response_text,
            "label": sample.label,
            "metadata": sample.metadata,
        }
        assert self.config.url is not None
        async with self._session.post(self.config.url, json=body) as resp:
            if resp.status >= 300:
                raise RewardError(f"remote reward answered {resp.status}: {await resp.text()}")
            reply = await resp.json(content_type=None)
        return reply.get("reward") if isinstance(reply, dict) else reply

    async def aclose(self) -> None:
        """Close the remote reward's HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None


def build_reward(config: RewardConfig) -> RewardHub:
    """The hub for ``config``; a bad custom path fails here, before any sample."""
    return RewardHub(config)
