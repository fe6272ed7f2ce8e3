import time

import pytest

from tunixlike.rewards.envs import CalculatorEnv, StepResult, ToolEnv, aggregate_rewards, format_tool_call


def _env(**kw):
  env = CalculatorEnv(**kw)
  assert env.reset({"answer": "14", "prompt_id": 0}) == ""
  return env


def test_calculator_episode_tool_call_then_correct_answer():
  env = _env()
  r = env.step("I will compute. " + format_tool_call("calculator", {"expression": "2+3*4"}))
  assert r == StepResult("<tool_response>14</tool_response>", 0.0, False, {"tool_call": 1})
  r = env.step("So the answer is 14.")
  assert r.done and r.reward == 1.0 and r.observation is None
  assert _env().step("The answer is 15").reward == 0.0


@pytest.mark.parametrize("action, fragment", [
    ("<tool_call>{bad json</tool_call>", "invalid JSON"),
    ('<tool_call>{"name": "calculator"', "missing"),
    (format_tool_call("search", {"q": "x"}), "unknown tool 'search'"),
    (format_tool_call("calculator", {"expr": "1"}), '"expression"'),
    (format_tool_call("calculator", {"expression": "__import__('os')"}), "not allowed"),
    (format_tool_call("calculator", {"expression": "1/0"}), "division by zero"),
])
def test_malformed_or_failing_calls_cost_a_penalty_and_the_episode_goes_on(action, fragment):
  env = _env(error_penalty=0.2)
  r = env.step(action)
  assert not r.done and r.reward == -0.2 and r.info == {"tool_error": 1}
  assert r.observation.startswith("<tool_response>error: ") and fragment in r.observation
  assert env.step("The answer is 14").reward == 1.0  # the policy can recover


def test_tool_budget_and_latency():
  env = _env(max_tool_calls=1, latency_s=0.1)
  call = format_tool_call("calculator", {"expression": "1+1"})
  t0 = time.perf_counter()
  assert env.step(call).observation == "<tool_response>2</tool_response>"
  assert time.perf_counter() - t0 >= 0.1
  r = env.step(call)
  assert r.done and r.reward == -0.1 and r.info == {"tool_budget_exceeded": 1}


def test_a_tool_that_raises_is_an_observation():
  def flaky(arguments):
    raise OSError("disk on fire")

  env = ToolEnv({"flaky": flaky}, answer_reward=lambda text, record: 0.5)
  env.reset({})
  r = env.step(format_tool_call("flaky", {}))
  assert "flaky failed: disk on fire" in r.observation and r.reward == -0.1
  assert env.step("done").reward == 0.5


def test_missing_answer_column_names_it():
  env = CalculatorEnv()
  env.reset({"question": "2+2"})
  with pytest.raises(KeyError, match="'answer' column"):
    env.step("4")


def test_aggregate_rewards():
  assert aggregate_rewards([0.25, 0.25, 1.0], "sum") == 1.5
  assert aggregate_rewards([0.25, 1.0], "last") == 1.0
  assert aggregate_rewards([0.5, 1.0], "mean") == 0.75
  assert aggregate_rewards([], "sum") == 0.0
  with pytest.raises(ValueError, match="'max'"):
    aggregate_rewards([1.0], "max")


@pytest.mark.parametrize("kw, fragment", [(dict(reward=float("nan")), "finite"), (dict(done=1), "bool"),
                                          (dict(observation=3), "str or None")])
def test_step_result_validation(kw, fragment):
  args = dict(observation="x", reward=0.0, done=False) | kw
  with pytest.raises((TypeError, ValueError), match=fragment):
    StepResult(**args)
