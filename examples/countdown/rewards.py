"""Countdown rewards: do the completion's steps reach the target with the given numbers?

A completion's answer is its text before the first newline, stripped: steps separated by commas,
each an arithmetic expression and the integer it makes, e.g. "3*5=15,15+7=22". The numbers a step
may use are the given ones and the results of earlier steps, each at most once; each written result
must be the exact value of its expression, and the last result is the answer. A step without
"=result" stands for its value, so a single expression such as "3*5+7" is an answer too.

An expression is integer literals, + - * / and parentheses. It is parsed with `ast` and only a
whitelist of nodes is evaluated (exactly, with `fractions.Fraction`): no `eval`, no names, no
calls, no attributes, so text such as `__import__('os')` is simply not an expression here.

Pure Python: tunixlike calls these by keyword with the dataset columns they name.
"""

from __future__ import annotations

import ast
import collections
import threading
from fractions import Fraction

MAX_CHARS = 64  # longer answers are wrong: bounds parsing work (the longest solution has 14 characters)
# CPython 3.11's ast.parse from several threads at once can raise SystemError ("AST constructor
# recursion depth mismatch") and the reward workers are threads: one parse at a time.
_PARSE_LOCK = threading.Lock()

_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,  # Fractions: exact; a zero divisor raises ZeroDivisionError
}


def answer(completion: str) -> str:
  """The part of a completion that is graded: the text before the first newline, stripped."""
  return completion.split("\n", 1)[0].strip()


def parse(text: str) -> tuple[ast.expr, list[int]] | None:
  """The expression tree and the integer literals it uses, or None if `text` is not such an expression."""
  if not text or len(text) > MAX_CHARS:
    return None
  try:
    with _PARSE_LOCK:
      tree = ast.parse(text, mode="eval").body
  except (SyntaxError, ValueError, MemoryError, RecursionError):
    return None
  literals = []
  for node in ast.walk(tree):
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      continue
    if isinstance(node, tuple(_OPS)):  # the operator nodes themselves
      continue
    if (isinstance(node, ast.Constant) and type(node.value) is int
        and (ast.get_source_segment(text, node) or "").isdigit()):  # plain decimal: no 0x3, 3_0
      literals.append(node.value)
      continue
    return None  # a name, call, attribute, unary minus, float, string, power, comparison ...
  return tree, literals


def evaluate(tree: ast.expr) -> Fraction | None:
  """The exact value of a parsed expression, or None on division by zero."""
  def value(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant):
      return Fraction(node.value)
    return _OPS[type(node.op)](value(node.left), value(node.right))
  try:
    return value(tree)
  except ZeroDivisionError:
    return None


def parse_steps(text: str) -> list[tuple[ast.expr, list[int], int | None]] | None:
  """Each step's (tree, literals, written result or None), or None if `text` is not a line of steps."""
  if not text or len(text) > MAX_CHARS:
    return None
  steps = []
  for step in text.split(","):
    expression, equals, result = step.partition("=")
    parsed = parse(expression.strip())
    result = result.strip()
    if parsed is None or (equals and not result.isdigit()):  # a result is a plain decimal integer
      return None
    steps.append((*parsed, int(result) if equals else None))
  return steps


def final_value(text: str, numbers) -> Fraction | None:
  """The value the steps reach, or None if a step uses a number it does not have or writes a wrong result."""
  steps = parse_steps(text)
  if steps is None:
    return None
  available = collections.Counter(int(n) for n in numbers)
  value = None
  for tree, literals, result in steps:
    used = collections.Counter(literals)
    if used - available:  # a number not given, not made by an earlier step, or already used
      return None
    available -= used
    value = evaluate(tree)
    if value is None or (result is not None and value != result):
      return None
    if value.denominator == 1:  # only an integer can be written as a later step's number
      available[int(value)] += 1
  return value


def is_correct(completion: str, numbers, target) -> bool:
  return final_value(answer(completion), numbers) == int(target)


def correct(completions: list[str], numbers: list[list[int]], target: list[int]) -> list[float]:
  """1.0 if the steps reach the target using only the given numbers (each at most once), else 0.0."""
  return [float(is_correct(c, n, t)) for c, n, t in zip(completions, numbers, target, strict=True)]


def one_step_results(a: int, b: int) -> set[int]:
  """The positive integers one step makes from a and b (+ - * /, either order): the game's rule."""
  out = {a + b, a * b, abs(a - b)} - {0}
  out |= {x // y for x, y in ((a, b), (b, a)) if x % y == 0}
  return out


def good_first_step(completions: list[str], numbers: list[list[int]], target: list[int]) -> list[float]:
  """1.0 if the answer's first step is a right one toward the target, else 0.0: it combines two of
  the given numbers with one operator into a positive integer, writes that value, and the target is
  one step from it and the remaining number (whatever the steps after it are).

  Partial credit for the search, the part of a solution the model has to guess: the step is
  checked for reachability, not closeness to the target, so a first step that cannot lead there
  earns nothing, and every right solution's first step earns it (a one-expression answer has no
  first step of two numbers and earns it only through `correct`).
  """
  def good(completion: str, given, goal) -> bool:
    steps = parse_steps(answer(completion))
    if not steps:
      return False
    tree, literals, result = steps[0]
    rest = collections.Counter(int(n) for n in given)
    if len(literals) != 2 or collections.Counter(literals) - rest:  # two given numbers, each at most once
      return False
    value = evaluate(tree)
    if value is None or value.denominator != 1 or value <= 0 or (result is not None and value != result):
      return False
    (remaining,) = list((rest - collections.Counter(literals)).elements())
    return int(goal) in one_step_results(int(value), remaining)
  return [float(good(c, n, t)) for c, n, t in zip(completions, numbers, target, strict=True)]


def well_formed(completions: list[str]) -> list[float]:
  """1.0 if the answer is a line of steps (expressions of integers, + - * / and parentheses, each with
  an optional "=integer"), else 0.0.

  A small shaping term: it does not look at the numbers, the target or whether a result is right.
  """
  return [float(parse_steps(answer(c)) is not None) for c in completions]
