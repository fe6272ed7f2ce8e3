import numpy as np
import pytest

from tunixlike.learner import advantages


def test_grpo_hand_computed():
  # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
  a = advantages.grpo(np.array([[1.0, 0.0, 0.0, 1.0]]))
  np.testing.assert_allclose(a, [[0.866025, -0.866025, -0.866025, 0.866025]], atol=1e-5)


def test_grpo_equal_rewards_give_zero():
  np.testing.assert_array_equal(advantages.grpo(np.array([[0.7, 0.7, 0.7]])), np.zeros((1, 3)))


def test_dr_grpo_hand_computed():
  a = advantages.dr_grpo(np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]]))
  np.testing.assert_allclose(a, [[0.5, -0.5, -0.5, 0.5], [-3.0, -1.0, 1.0, 3.0]])


def test_rloo_hand_computed():
  # [3, 1, 2]: baselines (1+2)/2, (3+2)/2, (3+1)/2 = 1.5, 2.5, 2
  np.testing.assert_allclose(advantages.rloo(np.array([[3.0, 1.0, 2.0]])), [[1.5, -1.5, 0.0]])
  np.testing.assert_allclose(advantages.rloo(np.array([1.0, 0.0, 0.0, 1.0])), [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)


def test_unknown_estimator_names_the_key():
  with pytest.raises(ValueError, match=r"algo.advantage='ppo'.*dr_grpo"):
    advantages.get_advantage_fn("ppo")


def test_group_of_one_is_rejected():
  with pytest.raises(ValueError, match="at least 2"):
    advantages.grpo(np.array([[1.0]]))
