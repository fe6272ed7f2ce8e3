import numpy as np
import pytest

from tunixlike.learner import dapo
from tunixlike.rollout import Completion, RolloutGroup


def _group(pid, rewards):
  comps = [Completion(np.array([5, 1], np.int32), np.zeros(2, np.float32), np.zeros(2, np.int32), "eos")
           for _ in rewards]
  return RolloutGroup(prompt_id=pid, prompt_token_ids=np.array([3], np.int32), completions=comps,
                      rewards=np.asarray(rewards, np.float32))


def test_dynamic_sampling_drops_zero_variance_groups():
  groups = [_group(0, [1, 1, 1]), _group(1, [0, 1, 0]), _group(2, [0, 0, 0]), _group(3, [0.5, 0.25, 0.5])]
  kept, dropped = dapo.keep_informative_groups(groups)
  assert [g.prompt_id for g in kept] == [1, 3]
  assert dropped == 2


def test_dynamic_sampling_needs_rewards():
  g = _group(7, [1, 0])
  g.rewards = None
  with pytest.raises(ValueError, match="prompt_id=7"):
    dapo.keep_informative_groups([g])


def test_overlong_penalty_hand_computed():
  # L_max 10, buffer 4: no penalty up to 6, then (6 - |y|) / 4, -1 beyond 10
  out = dapo.overlong_penalty(np.array([5, 6, 7, 10, 11]), max_length=10, buffer_length=4)
  np.testing.assert_allclose(out, [0.0, 0.0, -0.25, -1.0, -1.0])
  with pytest.raises(ValueError, match="buffer_length"):
    dapo.overlong_penalty(np.array([1]), max_length=10, buffer_length=0)
