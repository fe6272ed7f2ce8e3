"""Multi-turn environments: the Env interface, the tool-call format, tools and the step runner.

The episode loop that interleaves decoding with environment steps is `tunixlike.sampler.episodes`.
"""

from tunixlike.rewards.envs.base import REWARD_AGGREGATIONS, Env, StepResult, aggregate_rewards
from tunixlike.rewards.envs.calculator import CalculatorError, calculate
from tunixlike.rewards.envs.runner import EnvRunner, EnvTimeout
from tunixlike.rewards.envs.tool_calls import ToolCall, format_tool_call, format_tool_response, parse_tool_call
from tunixlike.rewards.envs.tool_env import (CALCULATOR_INSTRUCTIONS, CalculatorEnv, ToolEnv, answer_is_correct,
                                             calculator_tool)

__all__ = [
    "CALCULATOR_INSTRUCTIONS", "CalculatorEnv", "CalculatorError", "Env", "EnvRunner", "EnvTimeout",
    "REWARD_AGGREGATIONS", "StepResult", "ToolCall", "ToolEnv", "aggregate_rewards", "answer_is_correct",
    "calculate", "calculator_tool", "format_tool_call", "format_tool_response", "parse_tool_call",
]
