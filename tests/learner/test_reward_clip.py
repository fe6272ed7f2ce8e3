"""algo.reward_clip: no finite reward, however large, makes the advantages (and so the loss) non-finite."""

import numpy as np
import pytest

from tunixlike import config as config_lib
from tunixlike.learner import group_advantages
from tunixlike.learner.config import AlgoConfig
from tunixlike.rewards import CombinedReward
from tunixlike.rollout import Completion, RolloutGroup
from tunixlike.settings import ConfigError


def _advantages(**algo):
  """The reward stage's settings of a run with these algo keys."""
  return group_advantages.AdvantageConfig.from_config(config_lib.replace(config_lib.Config(), algo=algo))


def _group(rewards):
  completions = [Completion(np.array([5, 2], np.int32), np.zeros(2, np.float32), np.zeros(2, np.int32), "eos")
                 for _ in rewards]
  return RolloutGroup(prompt_id=0, prompt_token_ids=np.array([7], np.int32), completions=completions,
                      rewards=np.asarray(rewards, np.float32))


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_huge_finite_rewards_are_clipped_and_counted(estimator):
  # Unclipped, three of these would overflow a float32 sum; the group statistics are taken in float64, so
  # the advantages stay finite (and no overflow warning is raised: pytest.ini makes one an error).
  group = _group([3e38, 3e38, 3e38, 0.0])
  wide = group_advantages.AdvantageConfig.from_config(  # a library caller's own bounds, past the config's limit
      config_lib.replace(config_lib.Config(), algo={"advantage": estimator}), reward_clip=(-4e38, 4e38))
  unclipped = group_advantages.compute(group, wide)
  assert np.isfinite(unclipped[1]).all() and unclipped[1][3] < 0 < unclipped[1][0]
  group_advantages.set_advantages(group, _advantages(advantage=estimator))
  np.testing.assert_array_equal(group.rewards, [1e4, 1e4, 1e4, 0.0])
  assert group.reward_metrics["reward/clipped"] == 0.75
  assert np.isfinite(group.advantages).all() and group.advantages[3] < 0 < group.advantages[0]


def test_a_sum_of_rewards_past_float32_saturates_then_clips():
  big = lambda prompts, completions, **_: [3e38] * len(completions)
  reward = CombinedReward([{"fn": big, "name": "a"}, {"fn": big, "name": "b"}], timeout_s=10.0)
  total, metrics = reward(["p"] * 2, ["x", "y"])
  assert np.isfinite(total).all() and np.isfinite(metrics["rewards/total"])
  group = _group(total)
  group_advantages.set_advantages(group, _advantages())
  np.testing.assert_array_equal(group.rewards, [1e4, 1e4])
  assert group.reward_metrics["reward/clipped"] == 1.0


def test_in_range_rewards_are_untouched():
  group = _group([1.0, 0.0, -2.5])
  group_advantages.set_advantages(group, _advantages())
  np.testing.assert_array_equal(group.rewards, [1.0, 0.0, -2.5])
  assert group.reward_metrics["reward/clipped"] == 0.0


@pytest.mark.parametrize("bad", [(1.0, -1.0), (0.0, float("inf")), (float("nan"), 1.0), (1.0,), "wide"])
def test_the_range_must_be_finite_and_ordered(bad):
  with pytest.raises(ConfigError, match=r"algo.reward_clip=.*two finite numbers"):
    AlgoConfig(reward_clip=bad)


def test_weighted_terms_of_opposite_huge_scores_neither_overflow_nor_cancel_into_nan():
  # weight 10 * 1e308 is inf even in float64; inf - inf was a NaN reward that stopped the run
  up = lambda prompts, completions, **_: [1e308] * len(completions)
  down = lambda prompts, completions, **_: [-1e308] * len(completions)
  reward = CombinedReward([{"fn": up, "weight": 10.0, "name": "up"}, {"fn": down, "weight": 10.0, "name": "down"},
                           {"fn": up, "weight": 1e308, "name": "heavy"}], timeout_s=10.0)
  total, terms, metrics = reward.score(["p"] * 2, ["x", "y"])
  f32 = float(np.finfo(np.float32).max)
  np.testing.assert_array_equal(total, [f32, f32])  # saturated, then algo.reward_clip clips it
  assert np.isfinite(terms["up"]).all() and np.isfinite(terms["down"]).all()
  assert all(np.isfinite(v) for v in metrics.values()), metrics  # no inf reaches metrics.jsonl
  assert metrics["rewards/up"] == f32 and metrics["rewards/down"] == -f32
  balanced = CombinedReward([{"fn": up, "weight": 10.0, "name": "up"}, {"fn": down, "weight": 10.0, "name": "down"}],
                            timeout_s=10.0)
  np.testing.assert_array_equal(balanced(["p"], ["x"])[0], [0.0])
  group = _group(total)
  group_advantages.set_advantages(group, _advantages())
  np.testing.assert_array_equal(group.rewards, [1e4, 1e4])


@pytest.mark.parametrize("bad", [(-1e308, 1e308), (-3e38, 3e38), (0.0, 1e16)])
def test_bounds_whose_squares_and_sums_overflow_float32_are_refused(bad):
  with pytest.raises(ConfigError, match=r"algo.reward_clip=.*within \+-1e\+15: .*overflow float32"):
    AlgoConfig(reward_clip=bad)


def test_the_widest_bounds_allowed_keep_a_batch_of_squares_finite_in_float32():
  AlgoConfig(reward_clip=(-1e15, 1e15))
  width = np.float32(2e15)  # a dr_grpo advantage can span the whole range
  squares = np.full(10_000_000, width * width, np.float32)
  assert np.isfinite(squares.sum(dtype=np.float32))
