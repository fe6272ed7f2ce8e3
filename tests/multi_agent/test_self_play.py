"""The built-in self-play env: problems parsed, answers checked, both rewards verifiable."""

import pytest

from tunixlike.multi_agent.self_play import PROPOSER, SOLVER, ProposeSolveEnv, parse_problem


@pytest.mark.parametrize("text, problem", [("37+48=", (37, 48)), ("3748", (37, 48)), ("x37y48z", (37, 48)),
                                           ("05+10=", None), ("37+4", None), ("a+b=", None)])
def test_a_problem_is_the_first_two_operands_worth_of_digits(text, problem):
  assert parse_problem(text, digits=2) == problem


@pytest.mark.parametrize("answers, proposer_reward", [(["58", "57", "58 2", "1"], 1.0), (["58"] * 4, 0.0),
                                                      (["1"] * 4, 0.0), (["58", "1", "5", "1"], 0.5)])
def test_the_proposer_earns_most_when_the_solver_succeeds_half_the_time(answers, proposer_reward):
  env = ProposeSolveEnv(digits=2, attempts=4)
  first = env.reset({})
  assert (first.agent, first.samples) == (PROPOSER, 1)
  second = env.step(["37+48="])
  assert (second.agent, second.prompt, second.samples) == (SOLVER, "37+48=", 4)
  assert env.step(answers) is None
  solved = [float(a.startswith("58")) for a in answers]  # 85 reversed, at the start of the turn
  assert env.rewards() == [[proposer_reward], solved]


def test_text_that_is_not_a_problem_ends_the_episode_with_no_reward():
  env = ProposeSolveEnv(digits=2)
  env.reset({})
  assert env.step(["hello"]) is None
  assert env.rewards() == [[0.0]]
