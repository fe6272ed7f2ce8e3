"""The environment interface for multi-turn episodes (tool use, games, graders that talk back).

An episode is a conversation: the policy writes a turn, the environment answers, and so on.

    env = make_env()                          # one Env per episode (G per prompt)
    text = env.reset(record)                  # record: the prompt's dataset columns + prompt_id / prompt_text
    result = env.step(action_text)            # action_text: the policy's last turn, decoded
    # result.observation: text appended to the conversation (not trained on), or None
    # result.reward: this step's reward; result.done: the episode is over

`reset` and `step` run on worker threads (`EnvRunner`) under a timeout, never on the decode loop,
so they may block (sleep, call a subprocess or a server). Either may also be `async def`: an
awaitable result is run to completion on the worker with `asyncio.run`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

REWARD_AGGREGATIONS = ("sum", "last", "mean")


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What the environment says after one policy turn."""

  observation: str | None  # appended to the conversation (loss_mask 0); None or "" = nothing
  reward: float = 0.0
  done: bool = False
  info: dict[str, Any] = dataclasses.field(default_factory=dict)  # numbers here become episode metrics

  def __post_init__(self):
    if self.observation is not None and not isinstance(self.observation, str):
      raise TypeError(f"StepResult.observation must be str or None, got {type(self.observation).__name__}")
    if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
      raise ValueError(f"StepResult.reward={self.reward!r}: must be a finite number")
    if not isinstance(self.done, bool):
      raise TypeError(f"StepResult.done={self.done!r}: must be a bool")


class Env:
  """Base class (subclass it, or duck-type the two methods). One instance serves one episode."""

  def reset(self, record: dict[str, Any]) -> str:
    """Starts the episode; returns text appended after the prompt ("" = nothing)."""
    return ""

  def step(self, action: str) -> StepResult:
    raise NotImplementedError


def aggregate_rewards(step_rewards: Sequence[float], how: str) -> float:
  """The episode reward from its step rewards: their sum, the last one, or their mean (0 if none)."""
  if how not in REWARD_AGGREGATIONS:
    raise ValueError(f"reward aggregation {how!r}: expected one of {REWARD_AGGREGATIONS}")
  if not step_rewards:
    return 0.0
  if how == "sum":
    return float(sum(step_rewards))
  if how == "last":
    return float(step_rewards[-1])
  return float(sum(step_rewards) / len(step_rewards))
