import json
import os
import tracemalloc

import pytest

from tunixlike.data import tasks
from tunixlike.rewards import math_answer

GSM8K_TEST = os.path.join(tasks.GSM8K_DIR, "test.jsonl")  # shipped with the package


@pytest.mark.parametrize("text, expected", [
    ("#### 72", "72"),
    ("48/2 = 24 clips.\n#### 1,234", "1234"),
    ("#### 10\nThe answer is 99", "10"),  # #### outranks the other markers
    ("The answer is $1,000.", "1000"),
    ("So the answer is: -5 apples.", "-5"),
    ("the answer is 3.75 hours", "3.75"),
    (r"Thus the total is \boxed{\$18.00}.", "18.00"),
    (r"\boxed{1,250} people, not 7", "1250"),
    (r"\boxed{\frac{3}{4}}", "0.75"),
    (r"\boxed{-\dfrac{1}{2}}", "-0.5"),
    ("A: 42", "42"),
    ("Reasoning...\nAnswer: 3.5 hours", "3.5"),
    ("**Final Answer**: 17 dollars", "17"),
    ("We get 3, then 7, then 12.", "12"),  # no marker: last number, trailing period dropped
    ("She owes -3 dollars", "-3"),
    ("It costs -$4.50.", "-4.50"),
    ("It costs €7 in total", "7"),
    ("5-3=2", "2"),  # subtraction is not a negative sign
    ("x is 12% of y", "12"),
    ("1,000,000 people", "1000000"),
    ("####\nThe answer is 8", "8"),  # an empty marker falls through to the next one
    ("no number here", None),
    ("", None),
    (None, None),
])
def test_extract_answer(text, expected):
  assert math_answer.extract_answer(text) == expected


@pytest.mark.parametrize("completion, gold, correct", [
    ("#### 18", "18", True),
    ("The answer is 18.00", "18", True),
    ("The answer is $1,000", "1000", True),
    ("The answer is 1000", "1,000", True),
    ("#### -7", "-7", True),
    ("#### 7", "-7", False),
    ("#### 18.5", "18", False),
    ("#### 180", "18", False),
    ("blah", "18", False),
    ("The answer is 18", "Janet ... #### 18", True),  # gold given as a full solution
])
def test_is_correct(completion, gold, correct):
  assert math_answer.is_correct(completion, gold) is correct


def test_markers():
  assert math_answer.has_answer_marker("so #### 5")
  assert math_answer.has_answer_marker(r"\boxed{5}")
  assert math_answer.has_answer_marker("The answer is 5")
  assert not math_answer.has_answer_marker("it is 5")
  assert not math_answer.has_answer_marker("#### none")
  assert not math_answer.has_answer_marker(None)


def test_every_gsm8k_gold_solution_is_correct_and_perturbed_answers_are_not():
  with open(GSM8K_TEST) as f:
    rows = [json.loads(line) for line in f]
  assert len(rows) == 1319
  for row in rows:
    gold = row["answer"].rsplit("####", 1)[1].strip()
    assert math_answer.is_correct(row["answer"], gold), row["answer"]
    assert math_answer.is_correct(f"The answer is {gold}.", gold)
    assert math_answer.is_correct(f"\\boxed{{{gold}}}", gold)
    value = int(gold.replace(",", ""))
    for wrong in (value + 1, value - 1, value * 10):
      assert not math_answer.is_correct(f"#### {wrong}", gold), (gold, wrong)


def test_huge_completion_is_bounded():
  """Only the last MAX_CHARS characters are searched, which bounds the work (and the memory, here a
  list of 2 million matches otherwise) that a pathological completion can cost."""
  text, parens = "1 " * 2_000_000 + "#### 5", "(" * 1_000_000  # 4 MB, 1 MB
  tracemalloc.start()
  try:
    assert math_answer.extract_answer(text) == "5"
    assert math_answer.extract_answer(parens) is None
    peak_bytes = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak_bytes < 50 * math_answer.MAX_CHARS, peak_bytes
  assert math_answer.extract_answer("#### 7" + " " * math_answer.MAX_CHARS) is None  # out of reach
