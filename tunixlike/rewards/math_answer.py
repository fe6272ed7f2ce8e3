"""Final-answer extraction and numeric comparison for GSM8K-style math problems.

Models state answers in many ways; we accept, in order of precedence (the last occurrence of
each marker wins, since models often restate intermediate results before concluding):
`#### N`, `\\boxed{N}`, `The answer is N`, a line `A: N` / `Answer: N`, else the last number.
Numbers may carry thousands commas, a currency sign, units, a trailing period, a sign and decimals;
they are compared as exact decimals, so "18.00" equals "18" and "1,000" equals "1000".
"""

from __future__ import annotations

import decimal
import re

# Only the tail is searched: final answers are at the end, and a bounded input bounds the time
# a pathological (e.g. 10 MB) completion can take.
MAX_CHARS = 20_000

_NUMBER = re.compile(
    r"(?P<sign>(?<![\w)\]])-)?\s?[$€£¥]?\s?(?P<sign2>-)?"
    r"(?P<int>\d{1,3}(?:,\d{3})+(?![\d,]\d)|\d+)(?P<frac>\.\d+)?")
_HASHES = re.compile(r"####")
_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_IS = re.compile(r"answer\s+is\b\s*:?", re.IGNORECASE)
_A_LINE = re.compile(r"(?:^|\n)\s*(?:\*\*)?(?:A|Answer|Final Answer)(?:\*\*)?\s*:", re.IGNORECASE)


def _first_number(text: str) -> str | None:
  m = _NUMBER.search(text)
  return _number_text(m) if m else None


def _number_text(m: re.Match) -> str:
  sign = "-" if (m.group("sign") or m.group("sign2")) else ""
  return sign + m.group("int").replace(",", "") + (m.group("frac") or "")


def _boxed_content(text: str, start: int) -> str:
  """The text inside the braces opened just before `start`, honouring nested braces."""
  depth = 1
  for i in range(start, len(text)):
    depth += {"{": 1, "}": -1}.get(text[i], 0)
    if depth == 0:
      return text[start:i]
  return text[start:]


_FRAC = re.compile(r"^\s*(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}\s*$")


def _boxed_number(content: str) -> str | None:
  """A number in \\boxed{...}; \\frac{a}{b} becomes the decimal a/b (so it never reads as `a`)."""
  if m := _FRAC.match(content):
    if int(m.group(3)) == 0:
      return None
    return m.group(1) + str(decimal.Decimal(m.group(2)) / decimal.Decimal(m.group(3)))
  return _first_number(content)


def extract_answer(text: str) -> str | None:
  """The final numeric answer in `text` as a plain decimal string ("-1234.5"), or None."""
  if not isinstance(text, str) or not text:
    return None
  text = text[-MAX_CHARS:]
  hashes = list(_HASHES.finditer(text))
  if hashes:
    rest = text[hashes[-1].end():].split("\n", 1)[0]
    if (n := _first_number(rest)) is not None:
      return n
  boxes = list(_BOXED.finditer(text))
  if boxes:
    if (n := _boxed_number(_boxed_content(text, boxes[-1].end()))) is not None:
      return n
  for marker in (_ANSWER_IS, _A_LINE):
    hits = list(marker.finditer(text))
    if hits:
      rest = text[hits[-1].end():].split("\n", 1)[0]
      if (n := _first_number(rest)) is not None:
        return n
  numbers = list(_NUMBER.finditer(text))
  return _number_text(numbers[-1]) if numbers else None


def has_answer_marker(text: str) -> bool:
  """True if `text` states its answer explicitly (####, \\boxed{}, "the answer is", "A:") with a number."""
  if not isinstance(text, str):
    return False
  text = text[-MAX_CHARS:]
  if (m := list(_HASHES.finditer(text))) and _first_number(text[m[-1].end():].split("\n", 1)[0]):
    return True
  if (m := list(_BOXED.finditer(text))) and _boxed_number(_boxed_content(text, m[-1].end())):
    return True
  for marker in (_ANSWER_IS, _A_LINE):
    if (m := list(marker.finditer(text))) and _first_number(text[m[-1].end():].split("\n", 1)[0]):
      return True
  return False


def to_decimal(number: str) -> decimal.Decimal | None:
  try:
    return decimal.Decimal(number)
  except (decimal.InvalidOperation, TypeError, ValueError):
    return None


def is_correct(completion: str, gold: str) -> bool:
  """Whether the final answer of `completion` equals `gold` (a number, or a solution ending in '#### N')."""
  predicted = extract_answer(completion)
  expected = extract_answer(str(gold))
  if predicted is None or expected is None:
    return False
  p, e = to_decimal(predicted), to_decimal(expected)
  return p is not None and e is not None and p == e
