r"""DAPO's and DeepScaleR's math answer checks: the built-in rewards ``dapo`` and ``deepscaler``.

A recipe moved from verl (DAPO: ``math_dapo.compute_score``) or rLLM (DeepScaleR:
``RewardMathFn``) should get the same verdict on the same response, so each check follows
its peer's rules, written here from them. The scorer runs both in a worker thread under
the reward's ``timeout_s`` (sympy can be slow; rLLM's SIGALRM timeout needs the main thread).
"""

from __future__ import annotations

import re

DAPO_WINDOW = 300  # characters of the response's end that DAPO reads
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_INVALID = "[INVALID]"
_THINK_END = "</think>"

_DAPO_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)  # fmt: skip
_DAPO_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
_DAPO_REWRITES = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),
)


# ------------------------------------------------------------------------------- DAPO


def normalize_dapo(answer: str) -> str:
    r"""Minerva's normalisation of a final answer, as DAPO applies it: what follows the last
    ``=``; fixed substitutions (articles, spaces, ``\$``, ``mbox``) and removals (units such
    as ``feet`` or ``degrees``, ``\text{}``, ``^\circ``); ``$x$``, ``\text{x}``,
    ``\textbf{x}``, ``\overline{x}`` and ``\boxed{x}`` keep ``x``; ``\fracab`` becomes
    ``\frac{a}{b}`` and ``\sqrta`` ``\sqrt{a}``; a number loses its thousands commas."""
    answer = answer.split("=")[-1]
    for before, after in _DAPO_SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _DAPO_REMOVED:
        answer = answer.replace(expr, "")
    for pattern, replacement in _DAPO_REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_correct(response: str, label: str) -> bool:
    """DAPO's verdict: the last "Answer:" in the last 300 characters, normalised, equals
    the normalised label (DAPO's prompt asks for a last line "Answer: ..."). DAPO scores
    +1 and -1: set ``incorrect: -1`` for its scale."""
    found = _DAPO_ANSWER.findall(response[-DAPO_WINDOW:])
    answer = found[-1] if found else _INVALID
    return normalize_dapo(answer) == normalize_dapo(label)


# -------------------------------------------------------------------------- DeepScaleR


def last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (else ``\\fbox{...}``), braces balanced."""
    for command in ("\\boxed", "\\fbox"):
        start = text.rfind(command)
        if start >= 0:
            break
    else:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                # rLLM keeps "\boxed{...}" only: an "\fbox" or "\boxed x" answer is none.
                whole = text[start : i + 1]
                return whole[len("\\boxed{") : -1] if whole.startswith("\\boxed{") else None
    return None


def deepscaler_correct(response: str, label: str) -> bool:
    r"""DeepScaleR's verdict on ``response`` against one label.

    The answer is the last ``\boxed{...}`` of the text after ``</think>`` (else of the whole
    response); none is wrong (DeepScaleR's format error, also 0). A label holding
    ``\boxed`` is reduced to its content. Correct iff ``normalize_mathd`` makes both equal,
    or, after ``normalize_sympy``, the answer has the label's elements (a tuple or interval:
    the same brackets) and each pair is equal: two fractions as written (an unreduced one
    is wrong), an integer only to an integer, else ``sympy.simplify(a - b) == 0`` unless the
    expression has more than two unknown letters or a power like ``^{`` or ``^12`` (sympy
    can hang on those).
    """
    solution = response.split(_THINK_END)[1] if _THINK_END in response else response
    answer = last_boxed_content(solution)
    if answer is None:
        return False
    gold = last_boxed_content(label) if "\\boxed" in label else label
    if gold is None:
        return False
    return _mathd_equal(answer, gold) or _sympy_equal(answer, gold)


def _mathd_equal(answer: str, gold: str) -> bool:
    return normalize_mathd(gold) == normalize_mathd(answer)


def normalize_mathd(answer: str) -> str:
    r"""Hendrycks' MATH normalisation (``\dfrac`` and ``\tfrac`` to ``\frac``, no
    ``\left``/``\right``, units after ``\text{ `` and ``\%`` dropped, ``\frac12`` to
    ``\frac{1}{2}``, ``0.5`` to ``\frac{1}{2}``, ``a/b`` to ``\frac{a}{b}``, a short ``x =``
    prefix dropped); on any error, the answer as is."""
    answer = answer.strip()
    try:
        if (m := re.search(r"^\\text\{(?P<text>.+?)\}", answer)) is not None:
            answer = m.group("text").strip()
        return _strip_mathd(answer)
    except (AssertionError, IndexError, ValueError):
        return answer


def _strip_mathd(s: str) -> str:
    for before, after in (
        ("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
        ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""),
    ):  # fmt: skip
        s = s.replace(before, after)
    if "\\text{ " in s:  # units on the right
        parts = s.split("\\text{ ")
        assert len(parts) == 2
        s = parts[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    head, *rest = s.split("=")
    if len(rest) == 1 and len(head) <= 2:  # "k = 3"
        s = rest[0]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_slash(s)


def _fix_sqrt(s: str) -> str:
    head, *parts = s.split("\\sqrt")
    return head + "".join(
        "\\sqrt" + p if p.startswith("{") else "\\sqrt{" + p[0] + "}" + p[1:] for p in parts
    )


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``."""
    head, *parts = s.split("\\frac")
    out = head
    for p in parts:
        out += "\\frac"
        if p.startswith("{"):
            out += p
            continue
        if len(p) < 2:
            return s
        a, b, tail = p[0], p[1], p[2:]
        out += "{" + a + "}" + (b + tail if b == "{" else "{" + b + "}" + tail)
    return out


def _fix_slash(s: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` when both sides are integers written plainly."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


# ------------------------------------------------------------------------ sympy grading

_UNITS = (
    "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week",
    "month", "year", "foot", "feet", "inch", "yard",
)  # fmt: skip
_THOUSANDS = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_BAD_SUBSTRINGS = ("^{", "^(")
_BAD_REGEXES = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_BRACKETS = "()[]"


def _sympy_equal(answer: str, gold: str) -> bool:
    truth, given = normalize_sympy(gold), normalize_sympy(answer)
    if truth == given:
        return True
    if not given:
        return False
    truths, givens = _split_tuple(truth), _split_tuple(given)
    if len(truths) > 1 and (truth[0] != given[0] or truth[-1] != given[-1]):
        return False  # (a, b) is not [a, b]
    if len(truths) != len(givens):
        return False
    return all(_element_equal(t, g) for t, g in zip(truths, givens, strict=True))


def _element_equal(truth: str, given: str) -> bool:
    if _is_fraction(truth) and _is_fraction(given):
        return truth == given  # an unreduced fraction is not the answer
    if _is_integer(truth) != _is_integer(given):
        return False
    return _simplifies_to_zero(f"({truth})-({given})")


def normalize_sympy(expr: str) -> str:
    """rLLM's looser normalisation before sympy: LaTeX to text with pylatexenc, unit words
    and ``$``/``%`` dropped, "million" as ``*10^6``, lower case."""
    if (m := re.search(r"^\\text\{(?P<text>.+?)\}", expr)) is not None:
        expr = m.group("text")
    for before, after in (
        ("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
        ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12"),
    ):  # fmt: skip
        expr = expr.replace(before, after)
    for unit in _UNITS:
        expr = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_float(expr) and _is_whole(float(expr)):
        expr = str(round(float(expr)))
    if "\\" in expr:
        expr = _latex_to_text(expr)
    expr = re.sub(r"- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number: 7 3/4 is 7+3/4
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _is_integer(expr):
        expr = str(int(float(_strip_thousands(expr))))
    return expr


def _latex_to_text(expr: str) -> str:
    from pylatexenc.latex2text import LatexNodes2Text

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # a mixed number stays two terms
    try:
        text = LatexNodes2Text().latex_to_text(expr)
    except Exception:  # pylatexenc raises its own types on bad LaTeX
        return expr
    for before, after in (
        ("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"),
    ):  # fmt: skip
        text = text.replace(before, after)
    return text.strip()


def _simplifies_to_zero(expr: str) -> bool:
    """``sympy.simplify(expr) == 0``, for expressions it can be trusted with."""
    if not _sympy_safe(expr):
        return False
    import sympy
    from sympy.parsing import sympy_parser

    transforms = (
        *sympy_parser.standard_transformations,
        sympy_parser.implicit_multiplication_application,
    )
    try:
        parsed = sympy_parser.parse_expr(expr.replace("^", "**"), transformations=transforms)
        return bool(sympy.simplify(parsed) == 0)
    except Exception:  # sympy's parser raises anything on odd input
        return False


def _sympy_safe(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2:
        return False
    if any(bad in expr for bad in _BAD_SUBSTRINGS):
        return False
    return not any(p.search(expr) for p in _BAD_REGEXES)


def _split_tuple(expr: str) -> list[str]:
    expr = _strip_thousands(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    if (
        len(expr) > 2
        and expr[0] in _BRACKETS
        and expr[-1] in _BRACKETS
        and not any(c in inner for c in _BRACKETS)
    ):
        return [e.strip() for e in inner.split(",")]
    return [expr]


def _strip_thousands(expr: str) -> str:
    while (nxt := _THOUSANDS.sub(r"\1\3\4", expr)) != expr:
        expr = nxt
    return expr


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_whole(x: float) -> bool:
    try:
        return abs(x - round(x)) <= 1e-7
    except (OverflowError, ValueError):
        return False


def _is_integer(text: str) -> bool:
    try:
        return _is_whole(float(_strip_thousands(text)))
    except ValueError:
        return False


def _is_fraction(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))
