"""A generative judge: an OpenAI-compatible chat endpoint grades each response.

The user message is ``template`` with ``{prompt}``, ``{response}`` and ``{label}`` filled
in; the reward is the grade that the last match of ``score_pattern`` finds in the reply,
divided by ``scale`` (the default template asks for ``SCORE: <0-10>``, so 0 to 1), or with
``verdicts`` the value of the word it finds (``{yes: 1, no: 0}``). Every failure is the
sample's, with its reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import TYPE_CHECKING, Any

import aiohttp

from asyncrl.observe.logs import get_logger

if TYPE_CHECKING:
    from asyncrl.rollout.reward_config import JudgeConfig
    from asyncrl.types import Sample

log = get_logger("asyncrl.judge")
_RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})


class JudgeError(RuntimeError):
    """The judge gave no grade; the message is the reason."""


class _Transient(Exception):
    """A failure another try may not repeat."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class Judge:
    """Grades samples through one judge endpoint (module docstring); ``aclose()`` closes
    its HTTP session.

    At most ``max_concurrency`` requests are in flight: a judge is a shared server, so the
    rollout actors' samples queue here rather than flood it. The API key comes from the
    environment variable ``api_key_env`` names, never from the config file.
    """

    def __init__(self, config: JudgeConfig) -> None:
        self.config = config
        self.url = config.url.rstrip("/") + "/chat/completions"
        self._pattern = re.compile(config.score_pattern)
        verdicts = config.verdicts
        self._verdicts = None if verdicts is None else {k.lower(): v for k, v in verdicts.items()}
        self._gate = asyncio.Semaphore(config.max_concurrency)
        self._headers = {}
        if config.api_key_env:
            key = os.environ.get(config.api_key_env)
            if not key:  # before any sample: every call would fail the same way
                raise ValueError(f"judge: the API key variable ${config.api_key_env} is not set")
            self._headers["Authorization"] = f"Bearer {key}"
        self._session: aiohttp.ClientSession | None = None
        self.stats = {"judge/calls": 0, "judge/retries": 0, "judge/unparsed": 0}

    async def aclose(self) -> None:
        """Close the HTTP session (opened at the first request)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def score(self, sample: Sample) -> float:
        """``grade / scale`` for ``sample``; ``JudgeError`` says why there is none."""
        body = self.request(sample)
        async with self._gate:
            self.stats["judge/calls"] += 1
            reply = await self._post_with_retries(body)
        return self.grade(reply)

    def request(self, sample: Sample) -> dict[str, Any]:
        """The chat completion request for ``sample`` (a chat prompt is written out as
        ``role: content`` lines)."""
        cfg = self.config
        prompt = sample.prompt if isinstance(sample.prompt, str) else _transcript(sample.prompt)
        label = "" if sample.label is None else str(sample.label)
        user = cfg.template.format(prompt=prompt, response=sample.response_text, label=label)
        messages = [{"role": "system", "content": cfg.system}] if cfg.system else []
        messages.append({"role": "user", "content": user})
        return {
            "model": cfg.model,
            "messages": messages,
            "temperature": cfg.temperature,
            "max_tokens": cfg.max_tokens,
        }

    def grade(self, reply: str) -> float:
        """The last grade ``score_pattern`` finds in ``reply``: over ``scale``, or the
        reward of that verdict."""
        found = self._pattern.findall(reply)
        verdicts = self._verdicts
        if found and verdicts is not None and found[-1].lower() in verdicts:
            return verdicts[found[-1].lower()]
        if found and verdicts is None:
            return float(found[-1]) / self.config.scale
        self.stats["judge/unparsed"] += 1
        raise JudgeError(f"the judge's reply has no grade: {reply[:200]!r}")

    async def _post_with_retries(self, body: dict[str, Any]) -> str:
        """The reply's text. HTTP 429 and 5xx, a lost connection and a request past
        ``request_timeout_s`` are retried up to ``retries`` times (backoff 0.5 s doubling,
        or the server's ``Retry-After``); any other 4xx or a body that is not a chat
        completion fails at once. The scorer's ``timeout_s`` bounds it all."""
        delay = 0.5
        for attempt in range(self.config.retries + 1):
            try:
                return await self._post(body)
            except _Transient as exc:
                if attempt == self.config.retries:
                    raise JudgeError(
                        f"judge {self.url}: {exc} (after {attempt + 1} tries)"
                    ) from None
                self.stats["judge/retries"] += 1
                wait = exc.retry_after if exc.retry_after is not None else delay
                log.warning("judge retry", reason=str(exc), wait_s=wait)
                await asyncio.sleep(wait)
                delay *= 2
        raise AssertionError("unreachable")

    async def _post(self, body: dict[str, Any]) -> str:
        if self._session is None:  # in the caller's event loop
            self._session = aiohttp.ClientSession(headers=self._headers)
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        try:
            async with self._session.post(self.url, json=body, timeout=timeout) as resp:
                text = await resp.text()
                status, retry_after = resp.status, resp.headers.get("Retry-After")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _Transient(f"{type(exc).__name__}: {exc}") from None
        if status in _RETRIED_STATUS:
            raise _Transient(f"HTTP {status}: {text[:200]}", _seconds(retry_after))
        if not 200 <= status < 300:
            raise JudgeError(f"judge {self.url} answered HTTP {status}: {text[:200]}")
        return _content(text)


def _content(text: str) -> str:
    """``choices[0].message.content`` of a chat completion body."""
    try:
        content = json.loads(text)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise JudgeError(f"the judge's body is not a chat completion: {text[:200]}") from None
    if not isinstance(content, str):
        raise JudgeError(f"the judge's reply has no text content: {text[:200]}")
    return content


def _seconds(header: str | None) -> float | None:
    """A ``Retry-After`` of seconds (an HTTP date is ignored: the backoff applies)."""
    try:
        return min(float(header), 60.0) if header is not None else None
    except ValueError:
        return None


def _transcript(messages: list[dict[str, Any]]) -> str:
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages)
