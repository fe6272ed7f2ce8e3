import dataclasses

import numpy as np
import pytest

from tunixlike import config as config_lib
from tunixlike.learner import batch as batch_lib
from tunixlike.learner.group_advantages import AdvantageConfig
from tunixlike.rollout import Completion, RolloutGroup

# Groups no reward stage scored get their advantages in assemble_batch: the run's algo keys at their defaults.
UNSCORED = AdvantageConfig.from_config(config_lib.Config())


def _completion(tokens, version=3, reason="eos", loss_mask=None):
  n = len(tokens)
  return Completion(np.array(tokens, np.int32), -0.1 * np.arange(1, n + 1, dtype=np.float32),
                    np.full(n, version, np.int32), reason,
                    loss_mask=None if loss_mask is None else np.array(loss_mask, np.int32))


def _groups():
  g0 = RolloutGroup(prompt_id="a", prompt_token_ids=np.array([7, 8], np.int32),
                    completions=[_completion([5, 2]), _completion([6, 6, 2], version=4)],
                    rewards=np.array([1.0, 0.0], np.float32))
  g1 = RolloutGroup(prompt_id="b", prompt_token_ids=np.array([9], np.int32),
                    completions=[_completion([4, 30, 31, 2], loss_mask=[1, 0, 0, 1]),
                                 _completion([3], reason="length")],
                    rewards=np.array([2.0, 4.0], np.float32))
  return [g0, g1]


def test_layout_hand_checked():
  b = batch_lib.assemble_batch(_groups(), num_rows=6, seq_buckets=(4, 8, 16), pad_id=0, sampling_mask=False,
                               routing=False, unscored=dataclasses.replace(UNSCORED, estimator="dr_grpo"))
  assert b["tokens"].shape == (6, 8)  # longest row 1 + 4 = 5 tokens -> bucket 8
  np.testing.assert_array_equal(b["tokens"][0], [7, 8, 5, 2, 0, 0, 0, 0])
  np.testing.assert_array_equal(b["tokens"][2], [9, 4, 30, 31, 2, 0, 0, 0])
  # the stop token (2) is in the loss; environment tokens (30, 31) are not
  np.testing.assert_array_equal(b["loss_mask"][0], [0, 0, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(b["loss_mask"][2], [0, 1, 0, 0, 1, 0, 0, 0])
  np.testing.assert_allclose(b["behaviour_logprobs"][1, 2:5], [-0.1, -0.2, -0.3])
  np.testing.assert_array_equal(b["versions"][1], [-1, -1, 4, 4, 4, -1, -1, -1])
  np.testing.assert_allclose(b["advantages"], [0.5, -0.5, -1.0, 1.0, 0.0, 0.0])
  np.testing.assert_array_equal(b["group_ids"], [0, 0, 1, 1, -1, -1])
  np.testing.assert_array_equal(b["completion_lengths"], [2, 3, 4, 1, 0, 0])
  assert b["loss_mask"][4:].sum() == 0


def test_shapes_are_fixed_by_buckets():
  a = batch_lib.assemble_batch(_groups()[:1], num_rows=6, seq_buckets=(4, 8, 16), sampling_mask=False, routing=False,
                               unscored=UNSCORED)
  b = batch_lib.assemble_batch(_groups(), num_rows=6, seq_buckets=(4, 8, 16), sampling_mask=False, routing=False,
                               unscored=UNSCORED)
  assert a["tokens"].shape == b["tokens"].shape == (6, 8)


def test_bad_input_names_the_problem():
  with pytest.raises(ValueError, match="largest seq_buckets entry 4"):
    batch_lib.assemble_batch(_groups(), num_rows=6, seq_buckets=(4,), sampling_mask=False, routing=False,
                             unscored=UNSCORED)
  with pytest.raises(ValueError, match="more than num_rows=3"):
    batch_lib.assemble_batch(_groups(), num_rows=3, seq_buckets=(8,), sampling_mask=False, routing=False,
                             unscored=UNSCORED)
  with pytest.raises(ValueError, match="algo.advantage='nope'"):
    batch_lib.assemble_batch(_groups(), num_rows=6, seq_buckets=(8,), sampling_mask=False, routing=False,
                             unscored=dataclasses.replace(UNSCORED, estimator="nope"))
  g = _groups()
  g[1].rewards = None
  with pytest.raises(ValueError, match="prompt_id='b'"):
    batch_lib.assemble_batch(g, num_rows=6, seq_buckets=(8,), sampling_mask=False, routing=False, unscored=UNSCORED)


def test_overlong_penalty_enters_rewards_and_advantages():
  # lengths 2, 3 | 4, 1 with L_max 4 and buffer 2: penalties 0, -0.5 | -1.0, 0
  b = batch_lib.assemble_batch(_groups(), num_rows=4, seq_buckets=(8,), sampling_mask=False, routing=False,
                               unscored=dataclasses.replace(UNSCORED, estimator="dr_grpo",
                                                            overlong_max_length=4, overlong_buffer=2))
  np.testing.assert_allclose(b["rewards"], [1.0, -0.5, 1.0, 4.0])
  np.testing.assert_allclose(b["advantages"], [0.75, -0.75, -1.5, 1.5])


def test_advantages_set_by_the_reward_stage_are_the_ones_the_batch_holds():
  """The reward stage (`group_advantages.set_advantages`, on the reward workers) and a batch of
  unscored groups give the same numbers; a batch takes a scored group's advantages as they are."""
  from tunixlike.learner import group_advantages
  run = config_lib.replace(config_lib.Config(), algo=dict(advantage="dr_grpo", overlong_buffer=4),
                           sampler=dict(max_new_tokens=8))
  cfg = group_advantages.AdvantageConfig.from_config(run)
  scored = _groups()
  for g in scored:
    group_advantages.set_advantages(g, cfg)
  a = batch_lib.assemble_batch(scored, num_rows=6, seq_buckets=(16,), sampling_mask=False, routing=False)
  b = batch_lib.assemble_batch(_groups(), num_rows=6, seq_buckets=(16,), sampling_mask=False, routing=False,
                               unscored=dataclasses.replace(UNSCORED, estimator="dr_grpo",
                                                            overlong_max_length=8, overlong_buffer=4))
  for key in ("advantages", "rewards"):
    np.testing.assert_array_equal(a[key], b[key])
  scored[0].advantages = scored[0].advantages + 1.0
  c = batch_lib.assemble_batch(scored, num_rows=6, seq_buckets=(16,), sampling_mask=False, routing=False)
  np.testing.assert_allclose(c["advantages"][:scored[0].group_size], a["advantages"][:scored[0].group_size] + 1.0)
