import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunixlike.sampler import SamplingParams, process_logits, sample, sample_with_uniform, unpack_mask

LOGITS = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0, 0.2, -0.5, 1.5, 0.1]], np.float32)


def _np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_greedy_is_argmax_whatever_else_is_set():
  for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_p=0.5, top_k=3)):
    out = sample(jnp.asarray(LOGITS), jax.random.PRNGKey(0), params, return_mask=True)
    assert int(out.tokens_b[0]) == 5
    assert float(out.logprobs_b[0]) == 0.0  # the processed distribution is a point mass
    assert unpack_mask(out.mask_bw, 10)[0].tolist() == [i == 5 for i in range(10)]


def test_temperature_top_k_top_p_by_hand():
  t = 0.5
  x = LOGITS[0] / t
  # top-k 4 keeps ids 5, 0, 8, 1 (logits 3, 2, 1.5, 1).
  keep = np.zeros(10, bool)
  keep[[5, 0, 8, 1]] = True
  expect = _np_log_softmax(np.where(keep, x, -np.inf))
  got = process_logits(jnp.asarray(LOGITS), SamplingParams(temperature=t, top_k=4))
  np.testing.assert_allclose(np.asarray(got)[0][keep], expect[keep], atol=1e-6)
  assert np.all(np.isneginf(np.asarray(got)[0][~keep]))
  # top-p 0.95 at T=0.5: sorted probs over all ids; keep the smallest prefix whose mass reaches 0.8.
  p = np.exp(_np_log_softmax(x))
  order = np.argsort(-p)
  before = np.cumsum(p[order]) - p[order]
  kept = order[before < 0.95]
  keep = np.zeros(10, bool)
  keep[kept] = True
  assert 1 < keep.sum() < 10
  expect = _np_log_softmax(np.where(keep, x, -np.inf))
  got = np.asarray(process_logits(jnp.asarray(LOGITS), SamplingParams(temperature=t, top_p=0.95)))[0]
  np.testing.assert_allclose(got[keep], expect[keep], atol=1e-6)
  assert np.all(np.isneginf(got[~keep]))


def test_inverse_cdf_picks_by_cumulative_mass_and_reports_logprob():
  params = SamplingParams(temperature=1.0, top_k=3)  # ids 5, 0, 8
  logp = np.asarray(process_logits(jnp.asarray(LOGITS), params))[0]
  p = np.exp(logp)
  # In vocabulary order the kept ids are 0, 5, 8; the CDF steps at them.
  for u, expect in ((0.0, 0), (p[0] - 1e-4, 0), (p[0] + 1e-4, 5), (p[0] + p[5] + 1e-4, 8), (0.99999, 8)):
    out = sample_with_uniform(jnp.asarray(LOGITS), jnp.asarray([u], jnp.float32), params)
    assert int(out.tokens_b[0]) == expect, u
    np.testing.assert_allclose(float(out.logprobs_b[0]), logp[expect], atol=1e-6)


def test_empirical_frequencies_match_processed_distribution():
  params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
  n = 20000
  logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, 10))
  out = sample(logits, jax.random.PRNGKey(1), params, return_mask=True)
  p = np.exp(np.asarray(process_logits(jnp.asarray(LOGITS), params))[0])
  freq = np.bincount(np.asarray(out.tokens_b), minlength=10) / n
  np.testing.assert_allclose(freq, p, atol=0.015)
  assert np.all(freq[p == 0] == 0)  # never a truncated token
  mask = unpack_mask(out.mask_bw, 10)
  assert np.array_equal(mask[0], p > 0) and np.all(mask == mask[0])


def test_seeded_and_key_dependent():
  params = SamplingParams(temperature=1.0)
  logits = jnp.zeros((64, 10))
  a = sample(logits, jax.random.PRNGKey(3), params).tokens_b
  b = sample(logits, jax.random.PRNGKey(3), params).tokens_b
  c = sample(logits, jax.random.PRNGKey(4), params).tokens_b
  assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_jittable_and_no_nan_with_extreme_logits():
  params = SamplingParams(temperature=1e-3, top_p=1e-3)
  logits = jnp.asarray([[1e4, -1e4, 0.0], [0.0, 0.0, 0.0]])
  out = jax.jit(lambda l, k: sample(l, k, params))(logits, jax.random.PRNGKey(0))
  assert int(out.tokens_b[0]) == 0
  assert np.all(np.isfinite(np.asarray(out.logprobs_b)))


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_k=1.5), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")])
def test_bad_params_name_the_field(kw, field):
  with pytest.raises(ValueError, match=field):
    SamplingParams(**{"temperature": 1.0, **kw})
