"""A warning when RL has had little to learn from for a while, saying which of three things happened.

GRPO-family advantages are rewards relative to their group: a group whose completions all got the
same reward has advantage 0 and gives no gradient (`frac_reward_zero_std` is the share of such groups
in a step). That happens for three different reasons, with different remedies:
  all failed   every completion scored 0 (`groups/all_zero_reward`): the policy never succeeds;
  all solved   every completion was correct (`groups/all_solved`): the prompts are too easy for it;
  all equal    anything else the reward cannot tell apart (a reward that gives everyone the same score).
The guard looks at a window of steps, not a streak: a run that unlearns its task has steps with a few
signal groups between the empty ones, and a streak rule never fires on it.
"""

from __future__ import annotations

import collections
from typing import Callable

from tunixlike.rl.hooks import StepInfo

SILENCE = "(rl.no_signal_warn_steps=0 silences this)"


def advice(steps: int, groups: int, empty: int, failed: int, solved: int) -> str:
  """What the warning says: of `groups` in the last `steps` steps, `empty` had no reward variance,
  `failed` of them all scored 0 and `solved` were all correct; and what to do about it."""
  head = (f"little learning signal: {empty} of the {groups} groups of the last {steps} steps had no reward variance, "
          "so their advantages are 0 and they teach nothing (frac_reward_zero_std)")
  equal = empty - failed - solved
  if failed >= max(solved, equal):
    return (f"{head}; most failed every time ({failed} of {groups} groups scored 0 throughout): the policy rarely "
            "succeeds. Start from a model that sometimes succeeds: a supervised warm start on known answers "
            "(warm_start.max_steps with data.answer_field or data.messages_field), a pretrained model "
            "(model.hf_path), or a denser reward (partial credit, a small format term); a held-out accuracy that "
            f"falls at the same time means the run is unlearning: lower optim.learning_rate {SILENCE}")
  if solved >= equal:
    return (f"{head}; most were solved every time ({solved} of {groups} groups all correct): the prompts are too "
            "easy for the policy now. Use harder prompts, more samples per prompt (sampler.group_size) or a higher "
            f"sampler.temperature, or stop here: the run has learned what these prompts can teach {SILENCE}")
  return (f"{head}; in most of them every completion got the same nonzero score, neither all correct nor all 0: "
          "the reward cannot tell the completions apart. Check that the reward functions read the completion "
          f"(rewards, data.answer_field), or give partial credit {SILENCE}")


class NoSignalGuard:
  """A hook: warns when at least `share` of the groups of the last `window` steps had no reward
  variance; once per stretch (again only after the share has dropped below it)."""

  def __init__(self, window: int, share: float, say: Callable[[str], None]):
    self.window, self.share, self.say = window, share, say
    self._steps: collections.deque = collections.deque(maxlen=window)  # (groups, no signal, failed, solved)
    self._warned = False

  def __call__(self, info: StepInfo):
    m, groups = info.metrics, len(info.trained)
    if not groups:
      return
    self._steps.append((groups, round(m.get("frac_reward_zero_std", 0.0) * groups),
                        int(m.get("groups/all_zero_reward", 0)), int(m.get("groups/all_solved", 0))))
    total, empty, failed, solved = (sum(column) for column in zip(*self._steps))
    if empty < self.share * total:
      self._warned = False
    elif len(self._steps) == self.window and not self._warned:
      self._warned = True
      self.say("warning: " + advice(self.window, total, empty, failed, solved))
