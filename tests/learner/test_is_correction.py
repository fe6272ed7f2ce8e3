import jax.numpy as jnp
import numpy as np
import pytest

from tunixlike.learner import is_correction

# proximal / behaviour probabilities 0.5 / 0.1 and 0.2 / 0.4 -> token weights 5 and 0.5
PROX = jnp.log(jnp.array([[0.5, 0.2, 0.3]]))
BEHAV = jnp.log(jnp.array([[0.1, 0.4, 0.9]]))
MASK = jnp.array([[1.0, 1.0, 0.0]])


def test_token_tis():
  w, s = is_correction.importance_weights(PROX, BEHAV, MASK, mode="tis", level="token", cap=2.0)
  np.testing.assert_allclose(w[0], [2.0, 0.5, 0.0], rtol=1e-6)
  np.testing.assert_array_equal(s["is_clipped_frac"][0, :2], [1.0, 0.0])
  np.testing.assert_allclose(s["is_raw_weight_max"][0, :2], [5.0, 0.5], rtol=1e-6)
  np.testing.assert_allclose(s["mismatch_kl"][0, :2], [5 - 1 - np.log(5), 0.5 - 1 - np.log(0.5)], rtol=1e-5)


def test_token_icepop_mask():
  w, s = is_correction.importance_weights(PROX, BEHAV, MASK, mode="mis", level="token", low=0.4, high=2.0)
  np.testing.assert_allclose(w[0], [0.0, 0.5, 0.0], rtol=1e-6)
  np.testing.assert_array_equal(s["is_masked_frac"][0, :2], [1.0, 0.0])


def test_sequence_level():
  # the product of the token weights is 2.5 (the masked third token does not count)
  w, _ = is_correction.importance_weights(PROX, BEHAV, MASK, mode="tis", level="sequence", cap=3.0)
  np.testing.assert_allclose(w[0], [2.5, 2.5, 0.0], rtol=1e-5)
  w, _ = is_correction.importance_weights(PROX, BEHAV, MASK, mode="tis", level="sequence", cap=2.0)
  np.testing.assert_allclose(w[0], [2.0, 2.0, 0.0], rtol=1e-6)
  w, s = is_correction.importance_weights(PROX, BEHAV, MASK, mode="mis", level="sequence", low=0.5, high=2.0)
  np.testing.assert_array_equal(w[0], [0.0, 0.0, 0.0])
  np.testing.assert_array_equal(s["is_masked_frac"][0, :2], [1.0, 1.0])


def test_none_mode_weights_one():
  w, _ = is_correction.importance_weights(PROX, BEHAV, MASK, mode="none", level="token")
  np.testing.assert_array_equal(w[0], [1.0, 1.0, 0.0])


def test_bad_mode_names_the_key():
  with pytest.raises(ValueError, match="algo.is_mode='icepop'"):
    is_correction.importance_weights(PROX, BEHAV, MASK, mode="icepop", level="token")
  with pytest.raises(ValueError, match="algo.is_level='seq'"):
    is_correction.importance_weights(PROX, BEHAV, MASK, mode="tis", level="seq")


def test_version_lag_stats():
  versions = jnp.array([[3, 3, 4, 0], [4, 4, 0, 0]])
  mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
  s = is_correction.version_lag_stats(versions, mask, learner_version=5)
  assert float(s["version_lag_mean"]) == pytest.approx(1.4)  # lags 2 2 1 1 1
  assert float(s["version_lag_max"]) == 2.0
  assert float(s["version_lag_min"]) == 1.0
  assert float(s["stale_token_frac"]) == 1.0
  assert float(s["mixed_version_seq_frac"]) == 0.5  # row 0 spans versions 3 and 4
