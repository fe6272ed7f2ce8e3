"""Writes the Countdown data: train.jsonl and test.jsonl beside this file, the same on every run.

Run: python examples/countdown/make_data.py

Each row is one problem: three numbers from 1..9 and a target that two steps reach, each step
combining two numbers with + - * / into a positive integer (the game's rule), the second step using
the first one's result and the third number, e.g.

  {"problem": "3 5 7 to 22:", "numbers": [3, 5, 7], "target": 22, "solution": "3*5=15,15+7=22"}

`problem` is the prompt (short: the example's model reads one character per token); `solution` is
one way there, written step by step so that every step is a small arithmetic fact. Every such problem
(numbers as a multiset, targets 1..99 other than a given number) is used once: 200 in test.jsonl,
the rest in train.jsonl, so no test problem is seen in training.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random

import rewards  # this directory's rewards.py: every solution is checked with the reward itself

MAX_TARGET = 99  # two-digit targets keep prompts short


def _steps(a: int, b: int):
  """(result, text) of each way to combine a and b into a positive integer; the larger number first
  where the order does not matter, so that one fact has one spelling."""
  big, small = max(a, b), min(a, b)
  yield big + small, f"{big}+{small}"
  yield big * small, f"{big}*{small}"
  if a > b:
    yield a - b, f"{a}-{b}"
  if a % b == 0:
    yield a // b, f"{a}/{b}"


def solutions(numbers: tuple[int, ...]) -> dict[int, str]:
  """Each target in 1..MAX_TARGET (other than a given number) two steps reach -> its shortest solution."""
  out = {}
  for x, y, z in set(itertools.permutations(numbers)):
    for first, first_text in _steps(x, y):
      for second in set(itertools.permutations((first, z))):
        for target, second_text in _steps(*second):
          if not 1 <= target <= MAX_TARGET or target in numbers:
            continue
          text = f"{first_text}={first},{second_text}={target}"
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
  pool = problems()
  assert all(rewards.correct([s], [list(n)], [t]) == [1.0] for n, t, s in pool)  # the reward agrees
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
