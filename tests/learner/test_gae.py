import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunixlike.learner import gae as gae_lib
from tunixlike.learner import losses


def test_gae_hardcoded():
  # row 0: prompt token masked; row 1: a masked hole (tool output) and right padding.
  rewards = jnp.array([[5.0, 0.0, 0.1, 1.0], [0.5, 9.0, 1.0, 4.0]])
  values = jnp.array([[9.0, 0.5, 0.2, 0.8], [0.4, 7.0, 0.6, 3.0]])
  mask = jnp.array([[0, 1, 1, 1], [1, 0, 1, 0]], jnp.float32)
  adv, ret = gae_lib.gae(rewards, values, mask, gamma=0.9, gae_lambda=0.8)
  # by hand, right to left (gamma * lambda = 0.72):
  # row 0: d3 = 1 - .8 = .2; d2 = .1 + .9*.8 - .2 = .62, A2 = .62 + .72*.2 = .764;
  #        d1 = 0 + .9*.2 - .5 = -.32, A1 = -.32 + .72*.764 = .23008
  # row 1: t=3 padding, t=1 hole skipped: d2 = 1 - .6 = .4; d0 = .5 + .9*.6 - .4 = .64, A0 = .64 + .72*.4 = .928
  np.testing.assert_allclose(adv, [[0.0, 0.23008, 0.764, 0.2], [0.928, 0.0, 0.4, 0.0]], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(ret, [[0.0, 0.73008, 0.964, 1.0], [1.328, 0.0, 1.0, 0.0]], rtol=1e-6, atol=1e-7)


def test_gae_bootstrap_value():
  adv, ret = gae_lib.gae(jnp.array([[0.0, 1.0]]), jnp.array([[0.5, 0.5]]), jnp.ones((1, 2)),
                         gamma=0.5, gae_lambda=1.0, bootstrap_b=jnp.array([2.0]))
  # d1 = 1 + .5*2 - .5 = 1.5; d0 = 0 + .5*.5 - .5 = -.25, A0 = -.25 + .5*1.5 = .5
  np.testing.assert_allclose(adv, [[0.5, 1.5]], rtol=1e-6)
  np.testing.assert_allclose(ret, [[1.0, 2.0]], rtol=1e-6)


def _loop_gae(r, v, m, gamma, lam):
  """Reference: compress each row to its loss tokens, then the textbook recursion."""
  out = np.zeros_like(r)
  for b in range(r.shape[0]):
    idx = np.flatnonzero(m[b])
    a_next, v_next = 0.0, 0.0
    for t in idx[::-1]:
      a_next = r[b, t] + gamma * v_next - v[b, t] + gamma * lam * a_next
      v_next = v[b, t]
      out[b, t] = a_next
  return out


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.0)])
def test_gae_matches_loop_and_limits(gamma, lam):
  rng = np.random.default_rng(0)
  r = rng.normal(size=(3, 7)).astype(np.float32)
  v = rng.normal(size=(3, 7)).astype(np.float32)
  m = (rng.random((3, 7)) > 0.3).astype(np.float32)
  adv, ret = jax.jit(lambda r, v, m: gae_lib.gae(r, v, m, gamma=gamma, gae_lambda=lam))(r, v, m)
  np.testing.assert_allclose(adv, _loop_gae(r, v, m, gamma, lam), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret, (np.asarray(adv) + v) * m, rtol=1e-5, atol=1e-5)
  if gamma == 1.0 and lam == 1.0:  # Monte-Carlo: return-to-go over loss tokens minus V_t
    togo = np.cumsum((r * m)[:, ::-1], axis=1)[:, ::-1]
    np.testing.assert_allclose(ret, togo * m, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw,key", [(dict(gamma=1.01, gae_lambda=0.9), "algo.gamma"),
                                    (dict(gamma=-0.1, gae_lambda=0.9), "algo.gamma"),
                                    (dict(gamma=0.9, gae_lambda=1.5), "algo.gae_lambda"),
                                    (dict(gamma=0.9, gae_lambda=-1e-3), "algo.gae_lambda")])
def test_gae_rejects_discounts_outside_unit_interval(kw, key):
  x = jnp.zeros((1, 3))
  with pytest.raises(ValueError, match=key):
    gae_lib.gae(x, x, x, **kw)


def test_scores_to_token_rewards_and_kl_penalty():
  mask = jnp.array([[0, 1, 1, 0], [0, 0, 0, 0]], jnp.float32)
  r = gae_lib.scores_to_token_rewards(jnp.array([2.0, 3.0]), mask)
  np.testing.assert_array_equal(r, [[0, 0, 2, 0], [0, 0, 0, 0]])  # empty rows get nothing
  logp = jnp.array([[-1.0, -1.0, -2.0, -9.0], [0.0] * 4])
  ref = jnp.array([[-1.5, -1.5, -1.0, 0.0], [0.0] * 4])
  r2, kl = gae_lib.kl_penalized_rewards(r, logp, ref, mask, kl_coef=0.1)
  # k1 = logp - ref on loss tokens: [0, .5, -1, 0]
  np.testing.assert_allclose(kl, [[0, 0.5, -1.0, 0], [0] * 4], atol=1e-7)
  np.testing.assert_allclose(r2, [[0, -0.05, 2.1, 0], [0] * 4], atol=1e-7)
  with pytest.raises(ValueError, match="algo.kl_reward_coef"):
    gae_lib.kl_penalized_rewards(r, logp, ref, mask, kl_coef=-1.0)


def test_value_loss_clipping_hardcoded():
  v = jnp.array([[1.5, 1.1, 0.5]])
  old = jnp.array([[1.0, 1.0, 1.0]])
  ret = jnp.array([[2.0, 2.0, 0.0]])
  loss, stats = gae_lib.value_loss(v, old, ret, jnp.ones((1, 3)), clip_eps=0.2)
  # t0: (1.5-2)^2=.25 vs (1.2-2)^2=.64 -> .32; t1: inside the clip, .81 -> .405; t2: .25 vs .64 -> .32
  np.testing.assert_allclose(loss, [[0.32, 0.405, 0.32]], rtol=1e-6)
  np.testing.assert_array_equal(stats["vf_clip_frac"], [[1.0, 0.0, 1.0]])
  g = jax.grad(lambda v: gae_lib.value_loss(v, old, ret, None, clip_eps=0.2)[0].sum())(v)
  np.testing.assert_allclose(g, [[0.0, -0.9, 0.0]], atol=1e-6)  # clipped tokens give no gradient
  plain, _ = gae_lib.value_loss(v, old, ret, None, clip_eps=None)
  np.testing.assert_allclose(plain, [[0.125, 0.405, 0.125]], rtol=1e-6)
  with pytest.raises(ValueError, match="algo.vf_clip"):
    gae_lib.value_loss(v, old, ret, None, clip_eps=0.0)


def test_ppo_loss_at_ratio_one_is_the_policy_gradient():
  rng = np.random.default_rng(1)
  logp = jnp.asarray(-rng.random((2, 5)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=(2, 5)), jnp.float32)
  mask = jnp.asarray([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], jnp.float32)
  w = jnp.asarray(0.5 + rng.random((2, 5)), jnp.float32)

  def ppo(lp):
    loss_bt, _ = gae_lib.token_policy_loss("ppo_clip", lp, logp, adv, mask, eps_low=0.2, eps_high=0.2,
                                           is_weights_bt=w)
    return losses.aggregate(loss_bt, mask, "token_mean")

  def pg(lp):
    return losses.aggregate(-w * adv * lp, mask, "token_mean")

  np.testing.assert_allclose(ppo(logp), -(w * adv * mask).sum() / mask.sum(), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(ppo)(logp), jax.grad(pg)(logp), rtol=1e-6, atol=1e-7)
  # and each token's loss is exactly the registered ppo_clip with that token's advantage
  for b in range(2):
    for t in range(5):
      one, _ = losses.ppo_clip(logp[b:b + 1, t:t + 1] + 0.3, logp[b:b + 1, t:t + 1], adv[b:b + 1, t], None,
                               eps_low=0.2, eps_high=0.2)
      full, _ = gae_lib.token_policy_loss("ppo_clip", logp + 0.3, logp, adv, mask, eps_low=0.2, eps_high=0.2)
      np.testing.assert_allclose(full[b, t], one[0, 0], rtol=1e-6)


def test_token_policy_loss_rejects_sequence_level_loss():
  x = jnp.zeros((1, 2))
  with pytest.raises(ValueError, match="algo.loss='gspo'"):
    gae_lib.token_policy_loss("gspo", x, x, x, x, eps_low=0.1, eps_high=0.1)


def test_masked_whiten():
  x = jnp.array([[1.0, 2.0, 100.0], [3.0, -50.0, 4.0]])
  m = jnp.array([[1, 1, 0], [1, 0, 1]], jnp.float32)
  y = np.asarray(gae_lib.masked_whiten(x, m))
  kept = y[np.asarray(m) > 0]
  np.testing.assert_allclose(kept.mean(), 0.0, atol=1e-6)
  np.testing.assert_allclose(kept.std(), 1.0, rtol=1e-4)
  assert y[0, 2] == 0 and y[1, 1] == 0
