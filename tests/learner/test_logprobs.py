import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunixlike.learner import logprobs


def test_entropy_hand_computed():
  # uniform over 4 -> log 4; one-hot-ish -> ~0
  np.testing.assert_allclose(logprobs.entropy_from_logits(jnp.zeros((1, 1, 4))), [[np.log(4)]], rtol=1e-6)
  assert float(logprobs.entropy_from_logits(jnp.array([[[100.0, 0.0, 0.0]]]))[0, 0]) < 1e-6


def test_token_logprobs_hand_computed():
  logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25]]]))
  np.testing.assert_allclose(logprobs.token_logprobs_from_logits(logits, jnp.array([[1]])), [[np.log(0.25)]], rtol=1e-6)


@pytest.mark.parametrize("t,chunk", [(6, 3), (7, 4)])
def test_chunked_equals_full(t, chunk):
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(2, t, 5)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(5, 11)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 11, size=(2, t)))

  def full(h, w):
    logits = h @ w
    return logprobs.token_logprobs_from_logits(logits, y), logprobs.entropy_from_logits(logits)

  def chunked(h, w):
    return logprobs.chunked_token_logprobs(h, y, lambda x: x @ w, chunk_size=chunk)

  (lp_f, ent_f), (lp_c, ent_c) = jax.jit(full)(h, w), jax.jit(chunked)(h, w)
  np.testing.assert_allclose(lp_c, lp_f, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ent_c, ent_f, rtol=1e-5, atol=1e-6)
  g_f = jax.jit(jax.grad(lambda h, w: full(h, w)[0].sum(), argnums=(0, 1)))(h, w)
  g_c = jax.jit(jax.grad(lambda h, w: chunked(h, w)[0].sum(), argnums=(0, 1)))(h, w)
  for a, b in zip(g_c, g_f):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
