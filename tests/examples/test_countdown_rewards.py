"""examples/countdown/rewards.py against hand-made completions (no JAX: pure Python rewards)."""

import importlib.util
import json
import pathlib

import pytest

COUNTDOWN = pathlib.Path(__file__).resolve().parents[2] / "examples" / "countdown"


def _load_rewards():
  spec = importlib.util.spec_from_file_location("countdown_rewards", COUNTDOWN / "rewards.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # examples/ is not a package: load the file the config names
  return module


rewards = _load_rewards()

NUMBERS, TARGET = [3, 5, 7], 22


@pytest.mark.parametrize("completion, score", [
    ("3*5=15,15+7=22", 1.0),        # correct, step by step (the solution column's form)
    ("5+7=12,12+3*5", 0.0),         # 12 made, then 5 used a second time
    ("3*5=15, 7+15=22", 1.0),       # spaces, any order inside a step
    ("3*5=15,15+7=23", 0.0),        # a wrong written result
    ("3*5=16,16+7=23", 0.0),        # a wrong step, then right arithmetic on it: still wrong
    ("3*5=15,15+7", 1.0),           # the last result may be left unwritten
    ("3*5=15,15+7=22,22", 1.0),     # a step may just name a number it has
    ("7-5=2,2*3=6,6+15=21", 0.0),   # 15 was never made
    ("3*5=15,15+7=22,15", 0.0),     # 15 was used up by the second step
    ("3+5=8,8*7=56", 0.0),          # right arithmetic, not the target
    ("3*5=15,15+7=", 0.0),          # an empty result
    ("3*5=15;15+7=22", 0.0),        # steps are separated by commas
    ("3*5=15,15+7=22.0", 0.0),      # results are integers
    ("3*5+7", 1.0),                 # a single expression is one step
    (" 7+3*5 \nsome explanation", 1.0),  # only the first line counts, stripped
    ("(3+5)*7", 0.0),               # wrong value (56)
    ("3*5+5+2", 0.0),               # 5 used twice, 2 not given
    ("3*7+1", 0.0),                 # 1 is not a given number (value 22)
    ("3*5+7+0", 0.0),               # 0 is not given either
    ("3+7+5+7", 0.0),               # 7 used twice (value 22)
    ("", 0.0),
    ("the answer is 22", 0.0),      # junk text
    ("22", 0.0),                    # the target itself is not a given number
    ("3*5+7)", 0.0),                # unbalanced
    ("-3+25", 0.0),                 # unary minus is not allowed
    ("0x3*5+7", 0.0),               # only plain decimal literals
    ("3.0*5+7", 0.0),               # no floats
    ("__import__('os').system('true')", 0.0),  # code is not an expression here, and never runs
    ("(lambda: 22)()", 0.0),
    ("[3, 5, 7]", 0.0),
])
def test_correct(completion, score):
  assert rewards.correct([completion], [NUMBERS], [TARGET]) == [score]


def test_correct_division_is_exact():
  assert rewards.correct(["6/(4-1)"], [[6, 4, 1]], [2]) == [1.0]
  assert rewards.correct(["7/2*4"], [[7, 2, 4]], [14]) == [1.0]  # 3.5 * 4: exact, not floor division
  assert rewards.correct(["7/2"], [[7, 2, 4]], [3]) == [0.0]  # 3.5 is not 3
  assert rewards.correct(["9/(3-3)"], [[9, 3, 3]], [1]) == [0.0]  # division by zero scores 0, no error


def test_correct_repeated_numbers_may_each_be_used_once():
  assert rewards.correct(["3*3+1"], [[3, 3, 1]], [10]) == [1.0]
  assert rewards.correct(["3*3*3+1"], [[3, 3, 1]], [28]) == [0.0]


def test_correct_steps_may_divide_exactly():
  assert rewards.correct(["7/2=3,3*4=12"], [[7, 2, 4]], [12]) == [0.0]  # 7/2 is not 3
  assert rewards.correct(["8/2=4,4*3=12"], [[8, 2, 3]], [12]) == [1.0]
  assert rewards.correct(["7/2,7/2*4"], [[7, 2, 4]], [14]) == [0.0]  # 7 and 2 were used by the first step
  assert rewards.correct(["5-5=0,9/0=9"], [[5, 5, 9]], [9]) == [0.0]  # division by zero scores 0, no error


def test_correct_scores_a_batch_in_order():
  completions = ["3*5=15,15+7=22", "junk", "9-1"]
  assert rewards.correct(completions, [NUMBERS, NUMBERS, [9, 1, 2]], [22, 22, 8]) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("completion, score", [
    ("3*5+7", 1.0),
    ("3*5=15,15+7=22", 1.0),
    ("3*5=16,1+1=99", 1.0),  # the form, not the arithmetic
    ("3*5=15,", 0.0),        # an empty step
    ("3*5=x", 0.0),
    ("(1+2)/0", 1.0),  # well formed, though it divides by zero: the form, not the value
    ("99", 1.0),
    ("", 0.0),
    ("abc", 0.0),
    ("2**3", 0.0),     # no powers
    ("3 5 7 to 22:", 0.0),
    ("__import__('os')", 0.0),
    ("1+" * 100 + "1", 0.0),  # over the length bound
])
def test_well_formed(completion, score):
  assert rewards.well_formed([completion]) == [score]


def test_shipped_solutions_are_correct():
  for name in ("train.jsonl", "test.jsonl"):
    rows = [json.loads(line) for line in (COUNTDOWN / name).read_text().splitlines()]
    assert rows and all(len(r["problem"]) + 1 <= 24 for r in rows)  # + <bos>: data.max_prompt_length of the config
    assert all(len(r["solution"]) + 1 <= 20 for r in rows)  # + EOS: sampler.max_new_tokens of the config
    scores = rewards.correct([r["solution"] for r in rows], [r["numbers"] for r in rows], [r["target"] for r in rows])
    assert scores == [1.0] * len(rows), name


@pytest.mark.parametrize("completion, score", [
    ("3*5=15,15+7=22", 1.0),   # the solution's first step
    ("3*5=15,15-7=8", 1.0),    # a right first step, a wrong second: the search was right
    ("3*5=15", 1.0),           # 22 = 15 + 7 is one step away
    ("5*3=15,15+7=23", 1.0),   # any order inside the step
    ("3+5=8,8*7=22", 0.0),     # 22 is not one step from 8 and 7
    ("3*5=16,16+7=22", 0.0),   # a wrong written result
    ("3*3=9,9+13=22", 0.0),    # 3 given once
    ("3*5+7=22", 0.0),         # one expression of three numbers: `correct` scores it
    ("5-5=0,0+22=22", 0.0),    # 5 given once (and 0 is not a positive result)
    ("15+7=22", 0.0),          # 15 is not given
    ("junk", 0.0),
])
def test_good_first_step_checks_reachability_not_closeness(completion, score):
  assert rewards.good_first_step([completion], [NUMBERS], [TARGET]) == [score]
  # 22 = 7*3 + 1 is close to 7*3=21, but 1 cannot be made from the 5 left: no credit
  assert rewards.good_first_step(["7*3=21"], [NUMBERS], [TARGET]) == [0.0]


def test_every_solution_of_the_data_has_a_good_first_step():
  rows = [json.loads(line) for line in (COUNTDOWN / "test.jsonl").read_text().splitlines()]
  got = rewards.good_first_step([r["solution"] for r in rows], [r["numbers"] for r in rows],
                                [r["target"] for r in rows])
  assert got == [1.0] * len(rows)
