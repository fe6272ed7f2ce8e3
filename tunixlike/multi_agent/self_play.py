"""The built-in self-play task: a proposer writes an addition problem, a solver answers it.

    proposer, prompt "Q:"        -> "37+48="      (the turn's first 2 x `digits` digits: 37 and 48,
                                                   each of exactly `digits` digits)
    solver, prompt "37+48=", k samples -> "58", "57", ...   (the sum, least-significant digit first,
                                                            as in the addition task, at the start
                                                            of the turn)

The answer is known (the env computes it), so both rewards are verifiable:
  * solver: 1 for each correct answer, else 0;
  * proposer: 1 - |2p - 1| for a solve rate p of the k answers: 1 when the solver solves the
    problem sometimes (p = 1/2), 0 when always or never; 0 for text that is not a problem (the
    episode then ends after the proposer's turn).
So the proposer is pushed toward problems at the edge of the solver's ability, the usual
self-play curriculum (Absolute Zero, Zhao et al. 2025, arXiv 2505.03335; SPIRAL, Liu et al. 2025).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import numpy as np

from tunixlike.multi_agent.env import MultiAgentEnv, Turn

PROPOSER, SOLVER = "proposer", "solver"
PROPOSER_PROMPT = "Q:"


def parse_problem(text: str, digits: int) -> tuple[int, int] | None:
  """The problem a proposer's turn writes: its first 2 x `digits` digits (other characters skipped),
  `a` the first half and `b` the second, so "37+48=" and "3748" both propose 37+48. None if the
  turn has fewer digits or an operand starts with 0 (operands have exactly `digits` digits, as in
  the addition task)."""
  found = "".join(re.findall(r"\d", text)[:2 * digits])
  a, b = found[:digits], found[digits:]
  if len(b) < digits or (digits > 1 and "0" in (a[0], b[0])):
    return None
  return int(a), int(b)


def solved(text: str, expected: str) -> bool:
  """A solver's turn is correct when it starts with the answer (what follows is not read)."""
  return text.lstrip().startswith(expected)


def solve_rate_reward(p: float) -> float:
  return 1.0 - abs(2.0 * p - 1.0)


class ProposeSolveEnv(MultiAgentEnv):
  """One episode: a proposer turn, then (if it wrote a problem) one solver turn of `attempts` samples."""

  def __init__(self, digits: int, attempts: int = 4,
               turn_tokens: Callable[[np.random.Generator], int] | None = None):
    """`digits`: a run passes data.digits. `turn_tokens(rng)`: each turn's token limit, drawn per episode
    (seeded by the record's "index"); None: the samplers' own limits."""
    if not 1 <= digits <= 9:
      raise ValueError(f"ProposeSolveEnv.digits={digits}: must be in [1, 9]")
    self.digits, self.attempts, self._turn_tokens = digits, attempts, turn_tokens
    self._rng = np.random.default_rng(0)
    self._problem: tuple[int, int] | None = None
    self._answers: list[str] | None = None

  def _limit(self) -> int | None:
    return None if self._turn_tokens is None else int(self._turn_tokens(self._rng))

  def reset(self, record: dict[str, Any]) -> Turn:
    self._rng = np.random.default_rng(int(record.get("index", 0)))
    return Turn(PROPOSER, PROPOSER_PROMPT, samples=1, max_new_tokens=self._limit())

  def step(self, texts: Sequence[str]) -> Turn | None:
    if self._problem is None and self._answers is None:  # the proposer's turn
      self._problem = parse_problem(texts[0], self.digits)
      self._answers = []
      if self._problem is None:
        return None
      a, b = self._problem
      return Turn(SOLVER, f"{a}+{b}=", samples=self.attempts, max_new_tokens=self._limit())
    self._answers = list(texts)
    return None

  def rewards(self) -> list[list[float]]:
    if self._problem is None:
      return [[0.0]]
    if not self._answers:  # the solver's turn did not run (the run truncated the episode)
      return [[0.0]]
    expected = str(sum(self._problem))[::-1]
    correct = [float(solved(a, expected)) for a in self._answers]
    return [[solve_rate_reward(sum(correct) / len(correct))], correct]
