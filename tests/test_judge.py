"""The generative judge (``rollout/judge.py``): its request, grade, retries and limits
against a recording aiohttp judge on 127.0.0.1 whose failures the tests choose, and its
wire against the real OpenAI-compatible route of the embedded engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer
from pydantic import ValidationError

from asyncrl.engines.server.app import EngineServer
from asyncrl.engines.torch.engine import TorchEngine
from asyncrl.rollout.reward_config import JudgeConfig, RewardConfig
from asyncrl.rollout.rewards import RewardError, build_reward
from asyncrl.types import Sample
from tests.tiny_model import build_tiny_model


class FakeJudge:
    """A judge whose replies are a script: each entry is (status, body or reply text,
    headers); past the script it grades 7. Records requests and peak concurrency."""

    def __init__(self, script: list[tuple[int, str, dict[str, str]]] | None = None) -> None:
        self.script = list(script or [])
        self.requests: list[dict] = []
        self.headers: list[dict[str, str]] = []
        self.running = self.peak = 0
        self.delay = 0.0

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append(await request.json())
        self.headers.append(dict(request.headers))
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.delay)
            status, text, headers = self.script.pop(0) if self.script else (200, "SCORE: 7", {})
        finally:
            self.running -= 1
        if status != 200:
            return web.Response(status=status, text=text, headers=headers)
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": text}}]})


@pytest_asyncio.fixture
async def judge() -> AsyncIterator[tuple[FakeJudge, str]]:
    fake = FakeJudge()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.handle)
    async with TestServer(app, host="127.0.0.1") as server:
        yield fake, str(server.make_url("/v1"))


def scorer(url: str, **judge: object) -> object:
    return build_reward(RewardConfig(judge={"url": url, "model": "grader", **judge}))


def sample(response: str = "It is 4.", prompt: object = "2+2=?", label: object = "4") -> Sample:
    return Sample(uid="g/0", group_id="g", prompt=prompt, response_text=response, label=label)


async def test_the_request_and_the_grade(judge, monkeypatch):
    fake, url = judge
    monkeypatch.setenv("JUDGE_KEY", "sekret")
    fake.script = [(200, "Right.\nSCORE: 3\nno wait\nSCORE: 9", {})]
    hub = scorer(url, api_key_env="JUDGE_KEY", system="Be strict.", max_tokens=32)
    assert await hub(sample()) == pytest.approx(0.9)  # the last grade, over scale 10
    [body] = fake.requests
    assert body["model"] == "grader" and body["temperature"] == 0.0 and body["max_tokens"] == 32
    system, user = body["messages"]
    assert system == {"role": "system", "content": "Be strict."}
    assert "Question:\n2+2=?" in user["content"] and "Reference answer: 4" in user["content"]
    assert "Answer to grade:\nIt is 4." in user["content"]
    assert fake.headers[0]["Authorization"] == "Bearer sekret"
    chat = [{"role": "user", "content": "2+2=?"}]
    await hub(sample(prompt=chat))  # a chat prompt is written out as its turns
    assert "Question:\nuser: 2+2=?" in fake.requests[1]["messages"][1]["content"]
    await hub.aclose()


async def test_a_verdict_judge(judge):
    fake, url = judge
    verdicts = {"Yes": 1.0, "no": -1.0}
    hub = scorer(url, template="Is {response} right? VERDICT: yes or no",
                 score_pattern=r"(?i)verdict:\s*(\w+)", verdicts=verdicts)  # fmt: skip
    fake.script = [(200, "VERDICT: YES", {}), (200, "verdict: no", {}), (200, "VERDICT: maybe", {})]
    assert [await hub(sample()), await hub(sample())] == [1.0, -1.0]
    with pytest.raises(RewardError, match="no grade: 'VERDICT: maybe'"):
        await hub(sample())
    await hub.aclose()


async def test_busy_and_failing_servers_are_retried_then_give_up(judge):
    fake, url = judge
    fake.script = [(429, "slow down", {"Retry-After": "0"}), (503, "busy", {})]
    hub = scorer(url, retries=3)
    assert await hub(sample()) == pytest.approx(0.7)
    assert len(fake.requests) == 3
    fake.script = [(500, "boom", {})] * 4
    with pytest.raises(RewardError, match=r"HTTP 500: boom \(after 4 tries\)"):
        await hub(sample())
    await hub.aclose()


async def test_a_refusal_or_a_reply_without_a_grade_is_not_retried(judge):
    fake, url = judge
    hub = scorer(url, retries=3)
    fake.script = [(400, "unknown model grader", {})]
    with pytest.raises(RewardError, match="answered HTTP 400: unknown model grader"):
        await hub(sample())
    fake.script = [(200, "I think it is fine.", {})]
    with pytest.raises(RewardError, match=r"reply has no grade: 'I think it is fine\.'"):
        await hub(sample())
    assert len(fake.requests) == 2  # one each
    await hub.aclose()


async def test_requests_in_flight_stay_within_max_concurrency(judge):
    fake, url = judge
    fake.delay = 0.05
    hub = scorer(url, max_concurrency=2)
    scores = await asyncio.gather(*(hub(sample()) for _ in range(6)))
    assert scores == [pytest.approx(0.7)] * 6 and fake.peak == 2
    await hub.aclose()


async def test_a_hung_judge_times_out_per_request_and_is_retried(judge):
    fake, url = judge
    fake.delay = 1.0
    hub = scorer(url, request_timeout_s=0.1, retries=1)
    with pytest.raises(RewardError, match=r"TimeoutError.*after 2 tries"):
        await hub(sample())
    await hub.aclose()


def test_bad_settings_are_refused(monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    with pytest.raises(ValueError, match=r"\$NO_SUCH_KEY is not set"):
        scorer("http://127.0.0.1:9/v1", api_key_env="NO_SUCH_KEY")
    with pytest.raises(ValidationError, match="needs exactly one group"):
        JudgeConfig(url="u", model="m", score_pattern=r"\d+")
    with pytest.raises(ValidationError, match=r"it must use \{response\}"):
        JudgeConfig(url="u", model="m", template="Grade {answer}")


@pytest_asyncio.fixture
async def engine_url(tmp_path: Path) -> AsyncIterator[str]:
    build_tiny_model(tmp_path / "model")
    server = EngineServer(TorchEngine.from_pretrained(str(tmp_path / "model")))
    yield await server.start("127.0.0.1", 0)
    await server.stop()


async def test_the_wire_of_a_real_openai_compatible_server(engine_url):
    """The embedded engine's /v1/chat/completions as the judge: the body is a real chat
    completion that the judge reads (a random tiny model gives no grade, and says so)."""
    hub = scorer(engine_url + "/v1", max_tokens=8, score_pattern=r"(?s)(\d)(?!.*\d)")
    try:
        value = await hub(sample())
    except RewardError as exc:
        assert "reply has no grade" in str(exc), exc
    else:
        assert 0.0 <= value <= 0.9
    await hub.aclose()
