"""The reward scorer: built-ins on hand-written cases, custom functions, a remote reward model.

Remote rewards are served by a real aiohttp app on 127.0.0.1. Custom rewards are the
module-level functions below, loaded by dotted path as a user's would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from pydantic import ValidationError

from asyncrl.rollout.rewards import (
    RewardConfig,
    RewardError,
    build_reward,
    exact_match,
    extract_answer,
    f1_score,
    last_boxed,
    math_match,
    numeric_match,
)
from asyncrl.types import Sample, SampleStatus
from tests.polling import until

# ------------------------------------------------------------------ custom rewards by path

SYNC_THREADS: list[str] = []
NOT_CALLABLE = 3


def sync_reward(sample: Sample) -> float:
    SYNC_THREADS.append(threading.current_thread().name)
    return float(len(sample.response_text))


async def async_reward(sample: Sample) -> dict[str, float]:
    await asyncio.sleep(0)
    return {"score": 1.0, "length": len(sample.response_text), "ok": True}


class AsyncCallable:
    async def __call__(self, sample: Sample) -> float:
        return 0.25


ASYNC_OBJECT = AsyncCallable()


def raising_reward(sample: Sample) -> float:
    raise ValueError("no answer in the response")


async def hanging_reward(sample: Sample) -> float:
    await asyncio.sleep(60)
    return 1.0


def slow_sync_reward(sample: Sample) -> float:
    time.sleep(0.5)
    return 1.0


#: ``waiting_reward``'s signals: it has started; it may return (set by the test's loop).
STARTED, GO = threading.Event(), threading.Event()


def waiting_reward(sample: Sample) -> float:
    """Returns only once the event loop, free while it waits, says so."""
    STARTED.set()
    if not GO.wait(30):
        raise RuntimeError("the event loop never ran while the reward waited")
    return 1.0


async def own_timeout_reward(sample: Sample) -> float:
    raise TimeoutError("the judge's own client gave up")


async def garbage_reward(sample: Sample) -> Any:
    return sample.metadata["value"]


def sample(response: str = "", label: Any = None, **metadata: Any) -> Sample:
    return Sample(
        uid="g/0", group_id="g", prompt="Q?", response_text=response, label=label, metadata=metadata
    )


def custom(path: str, **kwargs: Any) -> Any:
    return build_reward(RewardConfig(type="custom", path=f"tests.test_rewards:{path}", **kwargs))


# ------------------------------------------------------------------------ answer extraction


def test_the_answer_is_after_the_last_hashes_then_in_the_last_box_then_the_whole_text():
    assert extract_answer("3 + 4 = 7 #### 7 \n") == "7"
    assert extract_answer("#### 1 ... #### 2") == "2"
    assert (
        extract_answer("so \\boxed{1} no, \\boxed{\\frac{\\sqrt{2}}{2}}.") == "\\frac{\\sqrt{2}}{2}"
    )
    assert extract_answer("  just 42 ") == "just 42"


def test_an_unclosed_box_falls_back_to_the_one_before():
    assert last_boxed("\\boxed{1} then \\boxed{2") == "1"
    assert last_boxed("no box") is None


def test_an_answer_pattern_takes_its_group_at_the_last_match_or_nothing():
    assert extract_answer("Answer: 3. Answer: 12.", r"Answer: (\d+)") == "12"
    assert extract_answer("<a>x</a>", r"<a>.*</a>") == "<a>x</a>"  # no group: the match
    assert extract_answer("#### 5", r"Answer: (\d+)") == ""


def test_an_answer_pattern_must_compile_and_have_at_most_one_group():
    with pytest.raises(ValidationError, match="is not a regex"):
        RewardConfig(answer_pattern="(")
    with pytest.raises(ValidationError, match="has 2 groups"):
        RewardConfig(answer_pattern=r"(\d+)-(\d+)")


# --------------------------------------------------------------------------------- built-ins


def test_exact_match_ignores_only_surrounding_whitespace():
    assert exact_match(" 42\n", 42)
    assert not exact_match("42.", "42")
    assert not exact_match("Paris", "paris")


def test_numeric_match_compares_last_numbers_within_an_absolute_then_relative_tolerance():
    assert numeric_match("The answer is 1,234.", 1234)
    assert numeric_match("0.30000000000000004", "0.3")
    assert numeric_match("-3", "-3.0")
    # |0.5000009 - 0.5| = 9e-7 <= 1e-6 * max(1, 0.5); 1.1e-6 is not.
    assert numeric_match("0.5000009", "0.5")
    assert not numeric_match("0.5000011", "0.5")
    # Relative above 1: |2000000.9 - 2000000| = 0.9 <= 1e-6 * 2e6 = 2.
    assert numeric_match("2000000.9", "2000000")
    assert not numeric_match("2000003", "2000000")
    assert numeric_match("7.04", "7", tol=0.01)
    assert not numeric_match("no number here", "7")


def test_math_match_is_symbolic():
    assert math_match("\\frac{1}{2}", "0.5")
    assert math_match("\\boxed{4}", "4")
    assert math_match("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}")
    assert math_match("The answer is $\\frac{3}{4}$.", "0.75")
    assert not math_match("5", "4")
    assert not math_match("", "4")


def test_f1_is_squad_token_f1_and_a_list_label_takes_the_best():
    # answer {cat, sat} vs label {cat, sat, down}: P = 2/2, R = 2/3, F1 = 2PR/(P+R) = 0.8.
    assert f1_score("The cat sat.", "a cat sat down") == pytest.approx(0.8)
    # answer {cat, cat, sat} vs {cat, sat}: common = 2, P = 2/3, R = 1, F1 = 0.8.
    assert f1_score("cat cat sat", "cat sat") == pytest.approx(0.8)
    # vs "dog": 0; vs "cat sat down": 0.8 as above; best of the list.
    assert f1_score("the cat sat", ["dog", "cat sat down"]) == pytest.approx(0.8)
    assert f1_score("Cat, SAT!", "cat sat") == 1.0
    assert f1_score("dog", "cat") == 0.0
    assert f1_score("the", "a") == 1.0  # both empty after normalisation (as SQuAD)


# ------------------------------------------------------------------------- the hub, built-ins


async def test_builtin_hubs_score_correct_and_incorrect_with_the_configured_values():
    exact = build_reward(RewardConfig(type="exact", correct=2.0, incorrect=-1.0))
    assert await exact(sample("so 3 + 4 #### 7", label="7")) == 2.0
    assert await exact(sample("so 3 + 4 #### 8", label="7")) == -1.0
    numeric = build_reward(RewardConfig(type="numeric", answer_pattern=r"Answer: (\S+)"))
    assert await numeric(sample("Answer: 1,000.0", label=1000)) == 1.0
    f1 = build_reward(RewardConfig(type="f1"))
    assert await f1(sample("The cat sat.", label="a cat sat down")) == pytest.approx(0.8)


async def test_a_cut_off_reply_gets_the_truncated_reward_unscored():
    """DAPO's overlong punishment: a reply cut off at its budget states no answer, though
    its last number may be right ("... so 8 * 3 = 24 stickers. Then 24 *"). Per term too;
    beside terms it is refused (the sum would be a number, not the terms' dict)."""
    cut = sample("8 * 3 = 24 stickers. Then 24 *", label="24")
    cut.status = SampleStatus.TRUNCATED
    done = sample("8 * 3 = 24. The answer is 24.", label="24")
    done.status = SampleStatus.COMPLETED
    assert await build_reward(RewardConfig(type="numeric"))(cut) == 1.0
    hub = build_reward(RewardConfig(type="numeric", truncated=-0.5))
    assert (await hub(cut), await hub(done)) == (-0.5, 1.0)
    terms = build_reward(RewardConfig(terms=[
        {"name": "correct", "type": "numeric", "truncated": 0.0},
        {"name": "length", "path": "tests.test_rewards:length_term", "weight": -0.01},
    ]))  # fmt: skip
    assert (await terms(cut))["correct"] == 0.0 and (await terms(done))["correct"] == 1.0
    with pytest.raises(ValidationError, match="drop truncated"):
        RewardConfig(truncated=0.0, terms=[{"name": "a"}])
    with pytest.raises(ValidationError, match="finite number"):
        RewardConfig(truncated=float("nan"))


async def test_a_list_label_accepts_any_of_its_answers():
    hub = build_reward(RewardConfig(type="exact"))
    assert await hub(sample("#### Paris", label=["paris", "Paris"])) == 1.0


async def test_the_math_hub_verifies_in_a_worker_thread():
    # math-verify's default signal-based timeouts fail off the main thread; the hub's work.
    hub = build_reward(RewardConfig(type="math"))
    assert await hub(sample("so the answer is \\boxed{\\frac{1}{2}}", label="0.5")) == 1.0
    assert await hub(sample("\\boxed{3}", label="4")) == 0.0
    assert hub.stats == {"reward/calls": 2, "reward/errors": 0, "reward/timeouts": 0}


async def test_a_builtin_reward_without_a_label_fails_the_sample():
    hub = build_reward(RewardConfig(type="numeric"))
    with pytest.raises(RewardError, match="numeric reward needs a label and the sample has none"):
        await hub(sample("42"))
    assert hub.stats["reward/errors"] == 1


async def test_a_samples_rm_type_picks_its_builtin_comparison():
    hub = build_reward(RewardConfig(type="exact"))
    assert await hub(sample("#### 7.0", label="7")) == 0.0  # exact: "7.0" is not "7"
    assert await hub(sample("#### 7.0", label="7", rm_type="numeric")) == 1.0
    assert await hub(sample("\\boxed{\\frac{1}{2}}", label="0.5", rm_type="math")) == 1.0
    with pytest.raises(RewardError, match="rm_type 'regex' is not a built-in reward"):
        await hub(sample("x", label="x", rm_type="regex"))


def length_term(sample: Sample) -> float:
    return float(len(sample.response_text))


def named_floats_term(sample: Sample) -> dict[str, float]:
    return {"a": 1.0}


async def test_reward_terms_are_each_scored_and_weighted_into_the_score():
    """TRL's reward_funcs with reward_weights: every term under its name, score their
    weighted sum (what the trainer trains on)."""
    hub = build_reward(RewardConfig(terms=[
        {"name": "correct", "type": "numeric"},
        {"name": "length", "path": "tests.test_rewards:length_term", "weight": -0.1},
    ]))  # fmt: skip
    assert await hub(sample("#### 42", label="42")) == {
        "correct": 1.0, "length": 7.0, "score": pytest.approx(1.0 - 0.7)
    }  # fmt: skip
    assert (await hub(sample("#### 41", label="42")))["score"] == pytest.approx(-0.7)


@pytest.mark.parametrize(
    ("term", "reason"),
    [
        ({"path": "tests.test_rewards:raising_reward"}, "reward term 'bad': custom reward raised"),
        ({"path": "tests.test_rewards:named_floats_term"}, "reward term 'bad' returned a dict"),
        ({"path": "tests.test_rewards:hanging_reward", "timeout_s": 0.05}, "timed out after"),
        ({"type": "numeric"}, "reward term 'bad': the numeric reward needs a label"),
    ],
)
async def test_a_failing_term_fails_the_sample_naming_the_term(term, reason):
    ok = {"name": "ok", "path": "tests.test_rewards:length_term"}
    hub = build_reward(RewardConfig(terms=[ok, {"name": "bad", **term}]))
    with pytest.raises(RewardError, match=re.escape(reason)):
        await hub(sample("x", label=None if "type" in term else "x"))


async def test_a_samples_rm_type_picks_the_single_rewards_type_not_a_terms():
    hub = build_reward(RewardConfig(terms=[{"name": "strict", "type": "exact"}]))
    assert (await hub(sample("#### 7.0", label="7", rm_type="numeric")))["strict"] == 0.0


def test_reward_terms_stand_alone_with_unique_names():
    with pytest.raises(ValidationError, match="drop type"):
        RewardConfig(type="math", terms=[{"name": "a"}])
    with pytest.raises(ValidationError, match="unique and not 'score'"):
        RewardConfig(terms=[{"name": "a"}, {"name": "a"}])
    with pytest.raises(ValidationError, match="terms are flat"):
        RewardConfig(terms=[{"name": "a", "terms": [{"name": "b"}]}])


# ------------------------------------------------------------------------------- custom


async def test_a_sync_custom_reward_runs_in_a_worker_thread():
    SYNC_THREADS.clear()
    hub = custom("sync_reward")
    assert await hub(sample("four")) == 4.0
    assert SYNC_THREADS and SYNC_THREADS[0] != threading.main_thread().name


async def test_async_custom_rewards_may_return_named_floats():
    hub = custom("async_reward")
    assert await hub(sample("four")) == {"score": 1.0, "length": 4.0, "ok": 1.0}
    assert await custom("ASYNC_OBJECT")(sample()) == 0.25


async def test_a_raising_custom_reward_is_a_reward_error_with_the_reason():
    hub = custom("raising_reward")
    with pytest.raises(RewardError) as info:
        await hub(sample())
    assert str(info.value) == "custom reward raised ValueError: no answer in the response"
    assert isinstance(info.value.__cause__, ValueError)
    assert hub.stats == {"reward/calls": 1, "reward/errors": 1, "reward/timeouts": 0}


async def test_a_hanging_custom_reward_times_out():
    hub = custom("hanging_reward", timeout_s=0.05)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"^reward timed out after 0.05s$"):
        await hub(sample())
    assert time.monotonic() - start < 1.0
    assert hub.stats == {"reward/calls": 1, "reward/errors": 0, "reward/timeouts": 1}


async def test_a_slow_sync_reward_times_out_without_blocking_the_event_loop():
    with pytest.raises(RewardError, match=r"timed out after 0\.1s"):
        await custom("slow_sync_reward", timeout_s=0.1)(sample())
    # The loop runs while a sync reward works: only the loop can let this one return
    # (no clock in it: the machine's load cannot make it pass or fail).
    STARTED.clear()
    GO.clear()
    scoring = asyncio.create_task(custom("waiting_reward", timeout_s=60)(sample()))
    await until(STARTED.is_set)
    GO.set()
    assert await scoring == 1.0


async def test_a_timeout_raised_by_the_reward_itself_is_an_error_not_a_timeout():
    hub = custom("own_timeout_reward")
    with pytest.raises(RewardError, match="custom reward raised TimeoutError: the judge's own"):
        await hub(sample())
    assert hub.stats == {"reward/calls": 1, "reward/errors": 1, "reward/timeouts": 0}


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("abc", "'abc'"),
        (None, "None"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        ({}, "{}"),
        ({"score": "1"}, "{'score': '1'}"),
        ({"score": float("nan")}, "{'score': nan}"),
        ([1.0], "[1.0]"),
    ],
)
async def test_a_reward_that_is_not_a_finite_number_or_dict_of_them_fails(value, shown):
    hub = custom("garbage_reward")
    with pytest.raises(RewardError) as info:
        await hub(sample(value=value))
    assert str(info.value) == f"reward returned {shown}, expected a number or a dict of numbers"
    assert hub.stats["reward/errors"] == 1


async def test_numbers_of_any_real_type_are_floats():
    hub = custom("garbage_reward")
    assert await hub(sample(value=True)) == 1.0
    assert await hub(sample(value=3)) == 3.0
    result = await hub(sample(value={"score": 0, "bonus": 0.5}))
    assert result == {"score": 0.0, "bonus": 0.5}
    assert all(type(v) is float for v in result.values())


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("tests.no_such_module:fn", "cannot import 'tests.no_such_module'"),
        ("tests.test_rewards:missing_fn", "has no 'missing_fn'"),
        ("tests.test_rewards:NOT_CALLABLE", "names a int, not a function"),
        ("no_module_sep", "must look like 'package.module:name'"),
    ],
)
def test_a_bad_custom_path_fails_at_build_time_naming_it(path, reason):
    with pytest.raises(
        ValueError, match=f"reward path {re.escape(repr(path))}.*{re.escape(reason)}"
    ):
        build_reward(RewardConfig(type="custom", path=path))


def test_a_dotted_path_without_a_colon_also_loads():
    assert build_reward(RewardConfig(type="custom", path="tests.test_rewards.sync_reward"))


def test_custom_and_remote_need_their_path_and_url():
    with pytest.raises(ValidationError, match="needs path"):
        RewardConfig(type="custom")
    with pytest.raises(ValidationError, match="needs url"):
        RewardConfig(type="remote")


# ------------------------------------------------------------------------------- remote


@contextlib.asynccontextmanager
async def reward_model() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A remote reward model on 127.0.0.1 with one route per behaviour; yields its URL."""
    bodies: list[dict[str, Any]] = []

    async def score(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        return web.json_response({"reward": float(body["response"] == body["label"])})

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)
        return web.json_response({"reward": 1.0})

    app = web.Application()
    app.router.add_post("/score", score)
    app.router.add_post("/bare", replying("0.5"))
    app.router.add_post("/fail", replying("judge crashed", status=500))
    app.router.add_post("/html", replying("<html>oops</html>"))
    app.router.add_post("/other", replying('{"score": 1}'))
    app.router.add_post("/slow", slow)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), bodies
    finally:
        await server.close()


def replying(text: str, *, status: int = 200) -> Any:
    """A handler answering ``text`` (labelled JSON, whatever it holds) with ``status``."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=status, text=text, content_type="application/json")

    return handler


def remote(url: str, **kwargs: Any) -> Any:
    return build_reward(RewardConfig(type="remote", url=url, **kwargs))


async def test_a_remote_reward_model_gets_the_sample_and_answers_a_reward():
    async with reward_model() as (url, bodies):
        hub = remote(url + "/score")
        s = sample("42", label="42", source="gsm8k")
        assert await hub(s) == 1.0
        assert await hub(sample("41", label="42")) == 0.0
        assert await remote(url + "/bare")(s) == 0.5
        await hub.aclose()
        assert hub._session is None
    assert bodies[0] == {
        "prompt": "Q?",
        "response": "42",
        "label": "42",
        "metadata": {"source": "gsm8k"},
    }


@pytest.mark.parametrize(
    ("route", "reason"),
    [
        ("/fail", r"answered HTTP 500: judge crashed"),
        ("/html", r"answered non-JSON: '<html>oops</html>'"),
        ("/other", r"reply has no 'reward' field: \{'score': 1\}"),
        ("/missing", r"answered HTTP 404"),
    ],
)
async def test_a_failing_remote_reward_is_a_reward_error_naming_the_url(route, reason):
    async with reward_model() as (url, _):
        hub = remote(url + route)
        with pytest.raises(RewardError, match=f"^remote reward {url}{route} {reason}"):
            await hub(sample("x", label="x"))
        await hub.aclose()
    assert hub.stats == {"reward/calls": 1, "reward/errors": 1, "reward/timeouts": 0}


async def test_a_slow_remote_reward_times_out():
    async with reward_model() as (url, _):
        hub = remote(url + "/slow", timeout_s=0.1)
        with pytest.raises(RewardError, match=r"timed out after 0\.1s"):
            await hub(sample("x", label="x"))
        await hub.aclose()
    assert hub.stats["reward/timeouts"] == 1


async def test_an_unreachable_remote_reward_is_a_reward_error():
    hub = remote("http://127.0.0.1:9/score", timeout_s=2)
    with pytest.raises(RewardError, match="remote reward raised ClientConnectorError"):
        await hub(sample("x", label="x"))
    await hub.aclose()
