"""A scored group's advantages: shaped rewards -> one advantage per completion -> per-token terms.

This runs in the reward stage (`rl/scoring.py`, on the reward workers), so the learner thread only
pads arrays: `batch.assemble_batch` reads `group.advantages` and computes them with this same
function only for groups that did not go through that stage (tests, benchmarks).

  rewards_g        = clip(rewards_g, *reward_clip)           (algo.reward_clip; counted in reward/clipped)
  shaped_rewards_g = rewards_g + DAPO's overlong penalty (`dapo.overlong_penalty`, when buffer > 0)
  advantages_g     = estimator(shaped_rewards_g)          (`advantages.py`: grpo, dr_grpo, rloo, distill)
  token_advantages = advantages_g + per-token terms       (`token_advantages.py`, when configured)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tunixlike.learner import advantages as advantages_lib
from tunixlike.learner import dapo
from tunixlike.learner import token_advantages as token_adv_lib
from tunixlike.rollout import RolloutGroup
from tunixlike.settings import FromConfig, tree_key


@dataclasses.dataclass(frozen=True)
class AdvantageConfig(FromConfig):
  """`AdvantageConfig.from_config(cfg, token=...)`: the run's algo keys of the reward stage."""

  estimator: str = tree_key("algo.advantage")  # a name of `advantages.get_advantage_fn`
  # DAPO's soft overlong penalty, in completion tokens (buffer 0 = off).
  overlong_max_length: int = tree_key("sampler.max_new_tokens")
  overlong_buffer: int = tree_key("algo.overlong_buffer")
  overlong_penalty: float = tree_key("algo.overlong_penalty")
  reward_clip: tuple[float, float] = tree_key("algo.reward_clip")  # finite: no reward can overflow the advantages
  token: token_adv_lib.TokenAdvantageConfig | None = None  # per-token terms (process rewards, distillation)

  def __post_init__(self):
    advantages_lib.get_advantage_fn(self.estimator)  # an unknown name fails here, not on the first group


def set_advantages(group: RolloutGroup, cfg: AdvantageConfig) -> None:
  """Clips `group.rewards` to `cfg.reward_clip` (the share clipped is `reward_metrics['reward/clipped']`),
  then fills `group.shaped_rewards`, `group.advantages` and (with `cfg.token`) `group.token_advantages`."""
  if group.rewards is not None:
    group.rewards, clipped = clip_rewards(group.rewards, cfg.reward_clip)
    group.reward_metrics["reward/clipped"] = clipped
  group.shaped_rewards, group.advantages, group.token_advantages = compute(group, cfg)


def clip_rewards(rewards_g, bounds: tuple[float, float]) -> tuple[np.ndarray, float]:
  """(rewards clipped to [low, high] as float32, the fraction that was outside). A finite reward too
  large for float32 arrives as +-inf and is clipped like the finite ones; NaN is no reward (kept)."""
  low, high = bounds
  rewards_g = np.asarray(rewards_g, np.float64)
  outside = (rewards_g < low) | (rewards_g > high)
  return np.clip(rewards_g, low, high).astype(np.float32), float(outside.mean()) if len(rewards_g) else 0.0


def compute(group: RolloutGroup, cfg: AdvantageConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
  """(shaped rewards [G], advantages [G], per-token advantages or None) of a group with rewards."""
  if group.rewards is None or len(group.rewards) != group.group_size:
    got = None if group.rewards is None else len(group.rewards)
    raise ValueError(f"RolloutGroup(prompt_id={group.prompt_id!r}).rewards has {got} entries, "
                     f"expected one per completion ({group.group_size})")
  rewards_g = clip_rewards(group.rewards, cfg.reward_clip)[0]
  if cfg.overlong_buffer > 0:
    lengths_g = np.array([c.num_tokens for c in group.completions])
    rewards_g = rewards_g + dapo.overlong_penalty(lengths_g, cfg.overlong_max_length, cfg.overlong_buffer,
                                                  cfg.overlong_penalty)
  advantages_g = advantages_lib.get_advantage_fn(cfg.estimator)(rewards_g[None, :])[0]
  token_advantages = (None if cfg.token is None
                      else token_adv_lib.group_token_advantages(group, advantages_g, cfg.token))
  return rewards_g.astype(np.float32), np.asarray(advantages_g, np.float32), token_advantages
