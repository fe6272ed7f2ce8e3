"""Writes the Countdown data: train.jsonl and test.jsonl beside this file, the same on every run.

Run: python examples/countdown/make_data.py

Each row is one problem: three numbers from 1..9 and a target that some expression using all three
reaches (with + - * / and parentheses), e.g.

  {"problem": "3 5 7 to 22:", "numbers": [3, 5, 7], "target": 22, "solution": "3*5+7"}

`problem` is the prompt (short: the example's model reads one character per token). There are 1925
such problems (numbers as a multiset, targets 1..99 other than a given number); each is used once,
200 in test.jsonl and the rest in train.jsonl, so no test problem is seen in training.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
from fractions import Fraction

import rewards  # this directory's rewards.py: every solution is checked with the reward itself

OPS = "+-*/"
MAX_TARGET = 99  # two-digit targets keep prompts short


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction | None:
  if op == "/":
    return a / b if b else None
  return a + b if op == "+" else a - b if op == "-" else a * b


def _candidates(numbers: tuple[int, ...]):
  """(value, expression) for every expression using all three numbers once, shortest spelling first."""
  for x, y, z in set(itertools.permutations(numbers)):
    for o1, o2 in itertools.product(OPS, repeat=2):
      left = _apply(o1, Fraction(x), Fraction(y))  # (x o1 y) o2 z
      if left is not None and (v := _apply(o2, left, Fraction(z))) is not None:
        yield v, [f"{x}{o1}{y}{o2}{z}", f"({x}{o1}{y}){o2}{z}"]
      right = _apply(o2, Fraction(y), Fraction(z))  # x o1 (y o2 z)
      if right is not None and (v := _apply(o1, Fraction(x), right)) is not None:
        yield v, [f"{x}{o1}{y}{o2}{z}", f"{x}{o1}({y}{o2}{z})"]


def solutions(numbers: tuple[int, ...]) -> dict[int, str]:
  """Each reachable target in 1..MAX_TARGET (other than a given number) -> its shortest expression."""
  out = {}
  for value, spellings in _candidates(numbers):
    if value.denominator != 1 or not 1 <= value <= MAX_TARGET or value in numbers:
      continue
    target = int(value)
    # The unparenthesised spelling only if it still evaluates to the target (operator precedence).
    text = next(s for s in spellings if rewards.correct([s], [list(numbers)], [target]) == [1.0])
    if target not in out or (len(text), text) < (len(out[target]), out[target]):
      out[target] = text
  return out


def problems() -> list[tuple[tuple[int, ...], int, str]]:
  """Every (numbers, target, solution): each multiset of three numbers with each of its targets."""
  return [(numbers, target, text) for numbers in itertools.combinations_with_replacement(range(1, 10), 3)
          for target, text in sorted(solutions(numbers).items())]


def row(numbers: tuple[int, ...], target: int, solution: str, rng: random.Random) -> dict:
  shown = rng.sample(numbers, len(numbers))  # the numbers in a random order, as a player would get them
  return dict(problem=f"{' '.join(map(str, shown))} to {target}:", numbers=shown, target=target, solution=solution)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out_dir", default=os.path.dirname(os.path.abspath(__file__)))
  parser.add_argument("--train_rows", type=int, default=0, help="0 = every problem not in test")
  parser.add_argument("--test_rows", type=int, default=200)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  rng = random.Random(args.seed)
  pool = problems()  # 1925 problems: numbers 1..9 give no more with all three used and targets <= 99
  rng.shuffle(pool)
  test = [row(*p, rng) for p in pool[:args.test_rows]]  # disjoint from train: each problem is used once
  train = [row(*p, rng) for p in pool[args.test_rows:][:args.train_rows or None]]
  for name, rows in (("train.jsonl", train), ("test.jsonl", test)):
    path = os.path.join(args.out_dir, name)
    with open(path, "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
  main()
