"""A safe arithmetic calculator: parsed with `ast`, never `eval`ed.

Accepts numbers, + - * / // % ** and parentheses. Everything else (names, calls, attributes,
strings, comparisons...) is refused before any arithmetic happens. Sizes are bounded so that no
input can take long or use much memory: the expression length, the number of AST nodes, the
exponent, and the magnitude of every intermediate result (Python ints are unbounded, so
`9**9**9` would otherwise run for minutes).
"""

from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 200
MAX_NODES = 100
MAX_EXPONENT = 100
MAX_BITS = 256  # integers beyond 2**256 are refused
MAX_ABS_FLOAT = 1e77  # about 2**256

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
  """The expression is not allowed or cannot be evaluated; the message is shown to the policy."""


def calculate(expression: str) -> int | float:
  """Evaluates an arithmetic expression, or raises CalculatorError with a short reason."""
  if not isinstance(expression, str):
    raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
  if len(expression) > MAX_CHARS:
    raise CalculatorError(f"expression has {len(expression)} characters > {MAX_CHARS}")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    raise CalculatorError(f"cannot parse {expression!r}") from None
  if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
    raise CalculatorError(f"expression has more than {MAX_NODES} parts")
  return _eval(tree.body)


def format_number(value: int | float) -> str:
  """Integers exactly; floats that are whole as integers, others to 10 significant digits."""
  if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
    return str(int(value))
  if isinstance(value, float):
    return f"{value:.10g}"
  return str(value)


def _eval(node: ast.AST) -> int | float:
  if isinstance(node, ast.Constant):
    if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
      raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
    return _check(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _check(_UNARY[type(node.op)](_eval(node.operand)))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _eval(node.left), _eval(node.right)
    if isinstance(node.op, ast.Pow):
      _check_power(left, right)
    try:
      return _check(_BINARY[type(node.op)](left, right))
    except ZeroDivisionError:
      raise CalculatorError("division by zero") from None
    except OverflowError:
      raise CalculatorError("result too large") from None
  raise CalculatorError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def _check_power(base, exponent) -> None:
  if abs(exponent) > MAX_EXPONENT:
    raise CalculatorError(f"exponent {exponent} outside [-{MAX_EXPONENT}, {MAX_EXPONENT}]")
  if base == 0 and exponent < 0:
    raise CalculatorError("division by zero")
  if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
    if (abs(base).bit_length() - 1) * exponent > MAX_BITS:  # a lower bound of the result's bits
      raise CalculatorError("result too large")
  if base < 0 and not float(exponent).is_integer():
    raise CalculatorError("fractional power of a negative number")


def _check(value):
  if isinstance(value, complex):
    raise CalculatorError("complex result")
  if isinstance(value, int) and value.bit_length() > MAX_BITS:
    raise CalculatorError("result too large")
  if isinstance(value, float) and (not math.isfinite(value) or abs(value) > MAX_ABS_FLOAT):
    raise CalculatorError("result too large or not finite")
  return value
