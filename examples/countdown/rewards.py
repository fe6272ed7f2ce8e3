"""Countdown rewards: does the completion's arithmetic reach the target with the given numbers?

A completion's answer is its text before the first newline, stripped, e.g. "3*5+7". It must be an
expression of integer literals, + - * / and parentheses; each literal must be one of the given
numbers, each given number used at most once. The expression is parsed with `ast` and only a
whitelist of nodes is evaluated (exactly, with `fractions.Fraction`): no `eval`, no names, no
calls, no attributes, so text such as `__import__('os')` is simply not an expression here.

Pure Python: tunixlike calls these by keyword with the dataset columns they name.
"""

from __future__ import annotations

import ast
import collections
from fractions import Fraction

MAX_CHARS = 64  # longer answers are wrong: bounds parsing work (the longest solution has 7 characters)

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


def uses_only(literals: list[int], numbers) -> bool:
  """Every literal is a given number, and no given number is used more often than it is given."""
  available = collections.Counter(int(n) for n in numbers)
  return not collections.Counter(literals) - available


def is_correct(completion: str, numbers, target) -> bool:
  parsed = parse(answer(completion))
  if parsed is None:
    return False
  tree, literals = parsed
  return uses_only(literals, numbers) and evaluate(tree) == int(target)


def correct(completions: list[str], numbers: list[list[int]], target: list[int]) -> list[float]:
  """1.0 if the answer reaches the target using only the given numbers (each at most once), else 0.0."""
  return [float(is_correct(c, n, t)) for c, n, t in zip(completions, numbers, target, strict=True)]


def well_formed(completions: list[str]) -> list[float]:
  """1.0 if the answer is an arithmetic expression of integers, + - * / and parentheses, else 0.0.

  A small shaping term: it does not look at the numbers or the target.
  """
  return [float(parse(answer(c)) is not None) for c in completions]
