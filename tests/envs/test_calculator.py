import tracemalloc

import pytest

from tunixlike.rewards.envs import CalculatorError, calculate
from tunixlike.rewards.envs.calculator import format_number


@pytest.mark.parametrize("expr, value", [
    ("2+3*4", 14), ("(2+3)*4", 20), ("2**10", 1024), ("7/2", 3.5), ("7//2", 3), ("-7 % 3", 2),
    ("-(1.5)*2", -3.0), ("2**-1", 0.5), (" 1_000 + 1 ", 1001), ("2**100 * 2**100", 2**200),
])
def test_arithmetic(expr, value):
  assert calculate(expr) == value


@pytest.mark.parametrize("expr, fragment", [
    ("__import__('os').system('true')", "not allowed"), ("open('x')", "not allowed"), ("x + 1", "Name"),
    ("(1).__class__", "not allowed"), ("'a' * 3", "only numbers"), ("True + 1", "only numbers"),
    ("[1, 2]", "not allowed"), ("1 < 2", "not allowed"), ("lambda: 1", "not allowed"), ("1j * 1j", "only numbers"),
    ("1/0", "division by zero"), ("0 ** -1", "division by zero"), ("5 % 0", "division by zero"),
    ("9**9**9", "exponent"), ("7 ** 10 ** 7", "exponent"), ("2**101", "exponent"), ("(10**50)**6", "too large"), ("2**100 * 2**100 * 2**100", "too large"),
    ("1e300 * 1e300", "too large"), ("(-8) ** 0.5", "negative"), ("1 +", "cannot parse"),
    ("1+" * 150 + "1", "characters"), ("+".join(["1"] * 60), "parts"), ("9" * 100, "too large"),
])
def test_refused_inputs_raise_calculator_error_before_computing_anything_large(expr, fragment):
  """Refused before the work: the peak of memory allocated while refusing is the parser's (tens of KB),
  never a huge intermediate such as 9**9**9 (about 150 MB, and minutes to compute)."""
  tracemalloc.start()
  try:
    with pytest.raises(CalculatorError, match=fragment):
      calculate(expr)
    peak_bytes = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak_bytes < 256 * 1024, peak_bytes


def test_format_number():
  assert format_number(14) == "14" and format_number(3.0) == "3" and format_number(1 / 3) == "0.3333333333"
