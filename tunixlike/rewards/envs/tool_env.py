"""A tool-use environment: the policy calls tools until it gives a final answer, which is graded.

Each policy turn is one of
  * a tool call (`tool_calls.py` format): the tool runs (after `latency_s`, to simulate a remote
    tool) and its result comes back as `<tool_response>...</tool_response>`, reward 0;
  * a malformed call, an unknown tool, bad arguments or a tool that raises: the error text comes
    back as the tool response, reward `-error_penalty`; the episode goes on (the policy can fix it);
  * no call: the final answer, graded by `answer_reward(text, record)`; the episode ends.
More than `max_tool_calls` calls end the episode with reward `-error_penalty`.
`CalculatorEnv` is the built-in instance: one `calculator` tool, answers checked against the
record's `answer` column.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from tunixlike.rewards import math_answer
from tunixlike.rewards.envs import calculator, tool_calls
from tunixlike.rewards.envs.base import Env, StepResult

Tool = Callable[[dict[str, Any]], str]  # arguments -> result text; raise to report an error

CALCULATOR_INSTRUCTIONS = (
    "You can use a calculator. To call it, write "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3*4"}}</tool_call> '
    "and wait for the <tool_response>. When you know the answer, write it without a tool call.")


def answer_is_correct(text: str, record: dict[str, Any]) -> float:
  """1.0 if the final number in `text` equals the record's `answer` (GSM8K rules), else 0.0."""
  if "answer" not in record:
    raise KeyError(f"answer_is_correct: the prompt record has no 'answer' column (columns: {sorted(record)})")
  return 1.0 if math_answer.is_correct(text, str(record["answer"])) else 0.0


class ToolEnv(Env):
  """See the module docstring. One instance per episode."""

  def __init__(self, tools: dict[str, Tool], *, answer_reward: Callable[[str, dict], float] = answer_is_correct,
               max_tool_calls: int = 4, error_penalty: float = 0.1, latency_s: float = 0.0):
    if not tools:
      raise ValueError("ToolEnv.tools is empty")
    if not isinstance(max_tool_calls, int) or max_tool_calls < 0:
      raise ValueError(f"ToolEnv.max_tool_calls={max_tool_calls!r}: must be an int >= 0")
    if not error_penalty >= 0:
      raise ValueError(f"ToolEnv.error_penalty={error_penalty!r}: must be >= 0 (it is subtracted)")
    if not latency_s >= 0:
      raise ValueError(f"ToolEnv.latency_s={latency_s!r}: must be >= 0")
    self.tools, self.answer_reward = dict(tools), answer_reward
    self.max_tool_calls, self.error_penalty, self.latency_s = max_tool_calls, float(error_penalty), latency_s
    self.record: dict[str, Any] = {}
    self.tool_calls = 0

  def reset(self, record: dict[str, Any]) -> str:
    self.record, self.tool_calls = dict(record), 0
    return ""

  def step(self, action: str) -> StepResult:
    call = tool_calls.parse_tool_call(action)
    if call is None:
      return StepResult(None, float(self.answer_reward(action, self.record)), True, {"final_answer": 1})
    self.tool_calls += 1
    if self.tool_calls > self.max_tool_calls:
      return StepResult(None, -self.error_penalty, True, {"tool_budget_exceeded": 1})
    if call.error is None and call.name not in self.tools:
      call = tool_calls.ToolCall(call.name, call.arguments, f"unknown tool {call.name!r}; tools: {sorted(self.tools)}")
    if call.error is not None:
      return self._error(call.error)
    if self.latency_s:
      time.sleep(self.latency_s)
    try:
      result = self.tools[call.name](call.arguments)
    except Exception as e:  # tools are user code: their failure is an observation, not a crash
      return self._error(f"{call.name} failed: {e}")
    return StepResult(tool_calls.format_tool_response(str(result)), 0.0, False, {"tool_call": 1})

  def _error(self, message: str) -> StepResult:
    return StepResult(tool_calls.format_tool_response(f"error: {message}"), -self.error_penalty, False,
                      {"tool_error": 1})


def calculator_tool(arguments: dict[str, Any]) -> str:
  """The `calculator` tool: {"expression": "2+3*4"} -> "14"."""
  expression = arguments.get("expression")
  if not isinstance(expression, str):
    raise calculator.CalculatorError('arguments need "expression": a string such as "2+3*4"')
  return calculator.format_number(calculator.calculate(expression))


class CalculatorEnv(ToolEnv):
  """ToolEnv with the safe calculator as its only tool; answers graded against `record["answer"]`."""

  def __init__(self, **kwargs):
    super().__init__({"calculator": calculator_tool}, **kwargs)
