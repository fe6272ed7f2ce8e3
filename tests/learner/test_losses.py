import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunixlike.learner import kl, losses


def _ratios(r):
  return jnp.log(jnp.asarray(r, jnp.float32)), jnp.zeros(len(r), jnp.float32)


def test_ppo_clip_hand_computed():
  # one token per row: (ratio, A) = (1.5, 1), (0.5, 1), (0.5, -1), (1.5, -1); eps 0.2
  logp, old = _ratios([1.5, 0.5, 0.5, 1.5])
  adv = jnp.array([1.0, 1.0, -1.0, -1.0])
  loss, stats = losses.ppo_clip(logp[:, None], old[:, None], adv, jnp.ones((4, 1)), eps_low=0.2, eps_high=0.2)
  np.testing.assert_allclose(loss[:, 0], [-1.2, -0.5, 0.8, 1.5], rtol=1e-6)
  np.testing.assert_array_equal(stats["clip_frac"][:, 0], [1.0, 0.0, 1.0, 0.0])


def test_dapo_clip_higher():
  logp, old = _ratios([1.5, 0.5])
  loss, _ = losses.dapo(logp[:, None], old[:, None], jnp.array([1.0, -1.0]), jnp.ones((2, 1)),
                        eps_low=0.2, eps_high=0.28)
  np.testing.assert_allclose(loss[:, 0], [-1.28, 0.8], rtol=1e-6)
  assert losses.get_policy_loss("dapo").eps_high == 0.28
  assert losses.get_policy_loss("dapo").aggregation == "token_mean"


def test_is_weights_scale_the_loss():
  logp, old = _ratios([1.0, 1.0])
  loss, _ = losses.ppo_clip(logp[:, None], old[:, None], jnp.array([2.0, 2.0]), jnp.ones((2, 1)),
                            eps_low=0.2, eps_high=0.2, is_weights_bt=jnp.array([[0.5], [0.0]]))
  np.testing.assert_allclose(loss[:, 0], [-1.0, 0.0])


def _logp(params_btv, targets_bt):
  return jnp.take_along_axis(jax.nn.log_softmax(params_btv), targets_bt[..., None], -1)[..., 0]


# GSPO's ratio is per sequence: at ratio 1 its gradient is the per-sequence mean of grad logp,
# i.e. the plain policy gradient under sequence-mean aggregation (the one it is defined with).
@pytest.mark.parametrize("name,mode", [(n, m) for n in ("ppo_clip", "dapo") for m in losses.AGGREGATIONS]
                         + [("gspo", "seq_mean_token_mean")])
def test_clip_at_ratio_one_is_policy_gradient(name, mode):
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(3, 5, 7)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 7, size=(3, 5)))
  adv = jnp.array([1.5, -0.5, 0.25])
  mask = jnp.array([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 0, 0, 0]], jnp.float32)
  fn = losses.get_policy_loss(name).fn

  def clip_obj(lg):
    logp = _logp(lg, targets)
    loss_bt, _ = fn(logp, jax.lax.stop_gradient(logp), adv, mask, eps_low=0.2, eps_high=0.2)
    return losses.aggregate(loss_bt, mask, mode, norm_length=5)

  def plain_pg(lg):  # -A log pi, whose gradient is the REINFORCE estimator
    return losses.aggregate(-adv[:, None] * _logp(lg, targets), mask, mode, norm_length=5)

  g_clip, g_pg = jax.grad(clip_obj)(logits), jax.grad(plain_pg)(logits)
  assert float(jnp.abs(g_pg).max()) > 1e-3
  np.testing.assert_allclose(g_clip, g_pg, rtol=1e-5, atol=1e-7)


def test_gspo_sequence_ratio_hand_computed():
  # token ratios 1.1 and 1.3 -> s = sqrt(1.43) = 1.195826 on both tokens; A = 1
  logp = jnp.log(jnp.array([[1.1, 1.3, 1.0]]))
  old = jnp.zeros((1, 3))
  mask = jnp.array([[1.0, 1.0, 0.0]])
  loss, _ = losses.gspo(logp, old, jnp.array([1.0]), mask, eps_low=0.5, eps_high=0.5)
  np.testing.assert_allclose(loss[0, :2], [-1.195826, -1.195826], rtol=1e-5)
  loss, stats = losses.gspo(logp, old, jnp.array([1.0]), mask, eps_low=3e-4, eps_high=4e-4)
  np.testing.assert_allclose(loss[0, :2], [-1.0004, -1.0004], rtol=1e-6)
  np.testing.assert_array_equal(stats["clip_frac"][0, :2], [1.0, 1.0])
  # unclipped gradient: d/dlogp_t of mean_t(-A s) = -A s / |y|
  g = jax.grad(lambda lp: losses.aggregate(
      losses.gspo(lp, old, jnp.array([1.0]), mask, eps_low=0.5, eps_high=0.5)[0], mask, "seq_mean_token_mean"))(logp)
  np.testing.assert_allclose(g[0, :2], [-1.195826 / 2] * 2, rtol=1e-5)


def test_aggregations_hand_computed():
  loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
  mask = jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # third row is batch padding
  assert float(losses.aggregate(loss, mask, "token_mean")) == pytest.approx(2.5)  # 10 / 4
  assert float(losses.aggregate(loss, mask, "seq_mean_token_mean")) == pytest.approx(3.0)  # (2 + 4) / 2
  assert float(losses.aggregate(loss, mask, "seq_mean_token_sum_norm", norm_length=4)) == pytest.approx(1.25)


def test_bad_names_and_norm_length():
  with pytest.raises(ValueError, match=r"algo.loss='ppo'"):
    losses.get_policy_loss("ppo")
  with pytest.raises(ValueError, match=r"algo.aggregation='mean'"):
    losses.aggregate(jnp.ones((1, 2)), jnp.ones((1, 2)), "mean")
  with pytest.raises(ValueError, match="norm_length"):
    losses.aggregate(jnp.ones((1, 2)), jnp.ones((1, 2)), "seq_mean_token_sum_norm")
  with pytest.raises(ValueError, match=r"algo.kl_estimator='k4'"):
    kl.get_kl_fn("k4")


def test_kl_estimators_hand_computed():
  logp, ref = jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25]))  # log r = log 0.5
  np.testing.assert_allclose(kl.k1(logp, ref), [0.693147], rtol=1e-5)
  np.testing.assert_allclose(kl.k2(logp, ref), [0.240227], rtol=1e-5)
  np.testing.assert_allclose(kl.k3(logp, ref), [0.193147], rtol=1e-5)  # 0.5 - 1 + 0.693147
  for fn in (kl.k1, kl.k2, kl.k3):
    assert float(fn(logp, logp)[0]) == 0.0


def test_k3_keeps_precision_of_small_log_ratios():
  # Near the reference policy k3 ~ log_r^2 / 2; exp(r) - 1 - r in fp32 rounds it to 0 or noise there.
  logp = jnp.zeros((3,), jnp.float32)
  log_r = np.array([1e-2, 1e-3, -1e-4])
  series = log_r**2 / 2 + log_r**3 / 6
  np.testing.assert_allclose(kl.k3(logp, jnp.asarray(log_r, jnp.float32)), series, rtol=1e-3)


def test_k3_is_unbiased_for_true_kl():
  p = np.array([0.6, 0.3, 0.1])
  q = np.array([0.2, 0.5, 0.3])
  exact = float((p * np.log(p / q)).sum())
  expected_k3 = float((p * kl.k3(jnp.log(p), jnp.log(q))).sum())  # E_{y~p} k3
  assert expected_k3 == pytest.approx(exact, rel=1e-5)
