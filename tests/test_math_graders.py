"""DAPO's and DeepScaleR's answer checks (``rollout/math_graders.py``) on hand-written cases.

Each case's verdict was worked out by hand from the peer's rules (verl's
``math_dapo.compute_score``, rLLM's ``RewardMathFn``), including the ones where the two
disagree with each other or with plain symbolic equality: that is what a user moving a
recipe over relies on.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.rollout.config import RewardConfig
from asyncrl.rollout.math_graders import (
    dapo_correct,
    deepscaler_correct,
    last_boxed_content,
    normalize_dapo,
    normalize_mathd,
)
from asyncrl.rollout.rewards import build_reward
from asyncrl.types import Sample

# ------------------------------------------------------------------------------------ DAPO


@pytest.mark.parametrize(
    ("response", "label", "correct"),
    [
        ("Let me think.\nAnswer: 42", "42", True),
        ("answer:   42", "42", True),  # the pattern ignores case
        ("Answer: 7\nwait, no.\nAnswer: 8", "8", True),  # the last one counts
        ("Answer: 7\nwait, no.\nAnswer: 8", "7", False),
        ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}", True),
        ("Answer: \\frac12", "\\frac{1}{2}", True),  # shorthand TeX
        ("Answer: 1,000", "1000", True),
        ("Answer: x = 5", "5", True),  # what follows the last "="
        ("Answer: 5 degrees", "5", True),
        ("Answer: \\text{east}", "east", True),
        ("Answer: 0.5", "\\frac{1}{2}", False),  # no symbolic equality in DAPO
        ("The result is \\boxed{42}.", "42", False),  # no "Answer:" line: invalid
        ("Answer: 42\n" + "more words " * 40, "42", False),  # outside the last 300 chars
    ],
)
def test_dapo(response: str, label: str, correct: bool) -> None:
    assert dapo_correct(response, label) is correct


def test_dapo_normalisation_rules() -> None:
    assert normalize_dapo("\\boxed{12}") == "12"
    assert normalize_dapo("\\sqrt2") == "\\sqrt{2}"
    assert normalize_dapo("90^\\circ") == "90"
    # Every comma goes when only digits remain: DAPO reads the pair "1,2" as 12.
    assert normalize_dapo("1,2") == "12"


# ------------------------------------------------------------------------------ DeepScaleR


@pytest.mark.parametrize(
    ("response", "label", "correct"),
    [
        ("<think>half</think> It is \\boxed{\\frac{1}{2}}.", "0.5", True),  # mathd: 0.5
        ("\\boxed{\\dfrac{3}{4}}", "3/4", True),  # dfrac, and a/b as \frac
        ("\\boxed{2/4}", "1/2", False),  # an unreduced fraction is wrong
        ("\\boxed{5.0}", "5", True),  # a whole float is the integer
        ("\\boxed{5.5}", "5", False),
        ("\\boxed{10\\%}", "10", True),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", True),  # sympy
        ("\\boxed{x^2+2x+2}", "(x+1)^2", False),
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", True),  # LaTeX to text, then sympy
        ("\\boxed{(1, 2)}", "[1, 2]", False),  # an open interval is not a closed one
        ("\\boxed{(2, 1)}", "(1, 2)", False),  # element by element
        ("\\boxed{(1, 2)}", "(1,2)", True),
        ("\\boxed{1,000}", "1000", True),
        ("The answer is 4.", "4", False),  # no box: DeepScaleR's format error
        ("<think>\\boxed{3}</think> so \\boxed{4}", "4", True),  # only after </think>
        ("<think>\\boxed{3}</think> so \\boxed{4}", "3", False),
        ("<think>\\boxed{3}</think> so 3", "3", False),  # the box must follow </think>
        ("\\boxed{7}", "\\boxed{7}", True),  # a boxed label is reduced to its content
        ("\\fbox{7}", "7", False),  # rLLM finds \fbox but takes only a \boxed{} content
        ("\\boxed{a b c d}", "abcd", True),  # mathd drops the spaces
        ("\\boxed{abc+d}", "d+abc", False),  # more than two unknowns: not for sympy
        ("\\boxed{b+a}", "a+b", True),
    ],
)
def test_deepscaler(response: str, label: str, correct: bool) -> None:
    assert deepscaler_correct(response, label) is correct


def test_hendrycks_normalisation_rules() -> None:
    assert normalize_mathd("\\left( 3, 4 \\right)") == "(3,4)"
    assert normalize_mathd("k = 3") == "3"
    assert normalize_mathd(".25") == "0.25"
    assert normalize_mathd(".5") == "\\frac{1}{2}"
    assert normalize_mathd("5 \\text{ cm}") == "5"
    assert normalize_mathd("\\frac1{72}") == "\\frac{1}{72}"
    assert normalize_mathd("\\sqrt") == "\\sqrt"  # a malformed answer is kept as it is


def test_last_boxed_content_balances_braces() -> None:
    assert last_boxed_content("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed_content("\\boxed{unclosed") is None
    assert last_boxed_content("nothing") is None


# ---------------------------------------------------------------------- as built-in rewards


def _sample(response: str, label: object, **metadata: object) -> Sample:
    return Sample(uid="g/0", group_id="g", prompt="Q?", response_text=response, label=label,
                  metadata=metadata)  # fmt: skip


async def test_dapo_reward_on_dapos_scale_and_list_labels() -> None:
    hub = build_reward(RewardConfig(type="dapo", incorrect=-1.0))
    assert await hub(_sample("Answer: 12", "12")) == 1.0
    assert await hub(_sample("Answer: 13", "12")) == -1.0
    assert await hub(_sample("Answer: 13", ["12", "13"])) == 1.0  # any acceptable answer


async def test_deepscaler_by_a_samples_rm_type() -> None:
    hub = build_reward(RewardConfig(type="exact"))
    boxed = _sample("\\boxed{\\frac{1}{2}}", "0.5", rm_type="deepscaler")
    assert await hub(boxed) == 1.0
    assert await hub(_sample("\\boxed{\\frac{1}{2}}", "0.5")) == 0.0  # exact: not equal


def test_an_answer_pattern_with_a_peer_grader_is_refused() -> None:
    with pytest.raises(ValidationError, match="finds the answer by its own rule"):
        RewardConfig(type="dapo", answer_pattern=r"=(\d+)")
