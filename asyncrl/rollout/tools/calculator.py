"""The built-in calculator tool: exact arithmetic on one expression, nothing else.

The expression is parsed with ``ast`` and only numbers, ``+ - * / // % **``, unary signs
and parentheses are evaluated, so no code runs. Values are exact (``int`` and ``Fraction``:
``0.1`` is 1/10); a result is shown as an integer when whole, else to 12 significant
digits. ``MAX_CHARS``, ``MAX_EXPONENT`` and ``MAX_DIGITS`` keep one call cheap.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from asyncrl.rollout.tools.registry import FunctionTool

MAX_CHARS = 200
MAX_EXPONENT = 64
MAX_DIGITS = 100
_MAX_BITS = math.ceil(MAX_DIGITS * math.log2(10))

Number = int | Fraction

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or breaks a limit; the text says which."""


def evaluate(expression: str) -> Number:
    """The exact value of ``expression`` (see the module docstring for what is allowed)."""
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    return _check(_eval(tree.body))


def format_number(value: Number) -> str:
    """An integer as is; a fraction as a decimal with 12 significant digits."""
    if isinstance(value, Fraction) and value.denominator != 1:
        return f"{float(value):.12g}"
    return str(int(value))


def calculator(expression: str) -> str:
    """The tool body: the value of ``expression`` as text (sync: the registry runs it in a
    worker thread, so even a slow expression never stalls the event loop)."""
    return format_number(evaluate(expression))


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Constant) and type(node.value) is float:
        if not math.isfinite(node.value):
            raise CalculatorError(f"not a finite number: {node.value}")
        return Fraction(repr(node.value))  # "0.1" means 1/10, not the nearest binary float
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        return _binary(node.op, left, right)
    raise CalculatorError(
        f"unsupported element {type(node).__name__}: only numbers and + - * / // % **"
    )


def _binary(op: ast.operator, left: Number, right: Number) -> Number:
    if isinstance(op, ast.Pow):
        _check_power(left, right)
    if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
        raise CalculatorError("division by zero")
    if isinstance(op, ast.Div):
        return _check(Fraction(left) / Fraction(right))
    if isinstance(op, ast.Pow) and right < 0:
        return _check(Fraction(left) ** int(right))
    return _check(_BINARY[type(op)](left, right))


def _check_power(base: Number, exponent: Number) -> None:
    """Refuse a power before computing it if its result could not pass ``_check``."""
    if abs(exponent) > MAX_EXPONENT or Fraction(exponent).denominator != 1:
        raise CalculatorError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
    b = Fraction(base)
    bits = max(abs(b.numerator).bit_length(), b.denominator.bit_length())
    if (bits - 1) * abs(int(exponent)) > _MAX_BITS:
        raise CalculatorError(f"result has more than {MAX_DIGITS} digits")


def _check(value: Number) -> Number:
    """Numerator and denominator both under ``MAX_DIGITS`` digits (so values stay cheap)."""
    v = Fraction(value)
    if max(abs(v.numerator), v.denominator) >= 10**MAX_DIGITS:  # no str() of a huge int
        raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
    if isinstance(value, Fraction) and value.denominator == 1:
        return int(value)
    return value


CALCULATOR_PARAMETERS = {
    "type": "object",
    "properties": {
        "expression": {
            "type": "string",
            "description": "Arithmetic with + - * / // % ** and parentheses, e.g. 123*456+7.",
        }
    },
    "required": ["expression"],
    "additionalProperties": False,
}


def calculator_tool() -> FunctionTool:
    """The calculator as a registry tool named ``calculator``."""
    return FunctionTool(
        "calculator",
        "Evaluate an arithmetic expression exactly and return its value.",
        calculator,
        CALCULATOR_PARAMETERS,
    )
