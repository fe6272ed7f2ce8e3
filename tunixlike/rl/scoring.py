"""The reward stage: everything that scores a finished group, in one place, on the reward workers.

    rewards (the config's reward functions) -> process rewards (waits for this group's PRM calls)
    -> teacher log-probs (on-policy distillation) -> shaped rewards and advantages

`AsyncRuntime` runs `GroupScorer` on its reward pool while the sampler keeps decoding and the
learner trains, so the learner thread receives groups ready to pad into a batch.
"""

from __future__ import annotations

from typing import Any

from tunixlike import rewards as rewards_lib, trace as trace_lib
from tunixlike.learner import group_advantages, token_advantages as token_adv_lib
from tunixlike.rl import distill as distill_lib
from tunixlike.rewards import process as process_lib
from tunixlike.rollout import RolloutGroup


def advantage_config(cfg) -> group_advantages.AdvantageConfig:
  """The run config's advantage settings (`algo`, and `sampler.max_new_tokens` for DAPO's penalty)."""
  a = cfg.algo
  process_coef = a.process_reward_coef if a.process_reward is not None else 0.0
  distill_coef = 1.0 if a.advantage == "distill" else 0.0
  token = (token_adv_lib.TokenAdvantageConfig(process_coef=process_coef, distill_coef=distill_coef)
           if process_coef or distill_coef else None)
  return group_advantages.AdvantageConfig.from_config(cfg, token=token)


class GroupScorer:
  """`scorer(group)` fills `group.rewards`, `reward_metrics` and the advantages, in place.

  `primary` names the reward whose mean is also logged as `accuracy`. Groups that arrive with
  rewards (multi-turn episodes carry their environment's) keep them.
  """

  def __init__(self, reward: rewards_lib.CombinedReward, *, tokenizer: Any,
               advantages: group_advantages.AdvantageConfig, primary: str | None = None,
               process: process_lib.ProcessRewardScorer | None = None, teacher: distill_lib.Teacher | None = None,
               tracer: trace_lib.Tracer = trace_lib.NULL_TRACER):
    self.reward, self.tokenizer, self.advantages = reward, tokenizer, advantages
    self.primary = None if primary is None else f"rewards/{primary}"
    self.process, self.teacher, self.tracer = process, teacher, tracer

  def __call__(self, group: RolloutGroup) -> None:
    if group.rewards is None:
      self._score(group)
    group_advantages.set_advantages(group, self.advantages)

  def _score(self, group: RolloutGroup) -> None:
    span = lambda name: self.tracer.span(name, cat="reward", prompt=str(group.prompt_id))
    with span("reward"):
      rewards_lib.score_groups(self.reward, [group], tokenizer=self.tokenizer)
      if self.primary in group.reward_metrics:
        group.reward_metrics["accuracy"] = group.reward_metrics[self.primary]
    if self.process is not None:  # waits only for this group's PRM calls still running
      with span("process_reward_wait"):
        self.process.collect(group)
    if self.teacher is not None:
      with span("teacher"):
        self.teacher.score(group)

  def close(self) -> None:
    if self.process is not None:
      self.process.close()
