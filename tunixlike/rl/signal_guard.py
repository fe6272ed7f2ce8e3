"""A warning when RL has had nothing to learn from for a while.

GRPO-family advantages are rewards relative to their group: a group whose completions all got the
same reward (all wrong, most often) has advantage 0 and gives no gradient. When every group of a
step is like that, the step trains nothing (`frac_reward_zero_std` = 1, `grad_norm` = 0); many such
steps in a row mean the run is stuck, and waiting does not help.
"""

from __future__ import annotations

from typing import Callable

from tunixlike.rl.hooks import StepInfo


def advice(steps: int, all_zero_groups: int, groups: int) -> str:
  """What the warning says: what is wrong and what to do about it."""
  what = ("every completion scored 0: the policy never succeeds" if all_zero_groups == groups
          else "every group's completions scored the same")
  return (f"no learning signal for {steps} steps in a row: {what}, so every advantage is 0 and nothing is learned "
          "(frac_reward_zero_std = 1). Start from a model that sometimes succeeds: a supervised warm start on known "
          "answers (warm_start.max_steps with data.answer_field or data.messages_field), a pretrained model "
          "(model.hf_path), or a denser reward (partial credit, a small format term) "
          "(rl.no_signal_warn_steps=0 silences this)")


class NoSignalGuard:
  """A hook: warns once per stretch of `patience` steps in a row with frac_reward_zero_std = 1."""

  def __init__(self, patience: int, say: Callable[[str], None]):
    self.patience, self.say = patience, say
    self.streak = 0

  def __call__(self, info: StepInfo):
    m = info.metrics
    if m.get("frac_reward_zero_std", 0.0) < 1.0:
      self.streak = 0
      return
    self.streak += 1
    if self.streak == self.patience:
      self.say("warning: " + advice(self.streak, int(m.get("groups/all_zero_reward", 0)), len(info.trained)))
