import jax
import numpy as np
import pytest

from tunixlike.learner import offload as offload_lib
from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig
from tunixlike.learner.train_step import Learner
from tunixlike.mesh import LEARNER_RULES


def _cfg(kl_coef=0.1, **algo):
  return LearnerConfig(algo=AlgoConfig(kl_coef=kl_coef, **algo), optim=OptimConfig(learning_rate=1e-3, micro_batches=2),
                       logprob_chunk_size=8)


def _kinds(tree):
  return {getattr(x, "sharding", None) and x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pinned", "numpy", "pinned_sharded"])
def test_offloaded_step_equals_plain_step(tiny_model, host_batch, mesh4, mode):
  mesh, rules = (mesh4, LEARNER_RULES) if mode == "pinned_sharded" else (None, ())
  plain = Learner(tiny_model(), _cfg(), mesh=mesh, rules=rules)
  other = Learner(tiny_model(), _cfg(), mesh=mesh, rules=rules)
  off = offload_lib.HostOffload(other, ("optimizer", "reference"), force_numpy=(mode == "numpy"))
  assert off.memory_kind == (None if mode == "numpy" else "pinned_host")  # CPU has a pinned_host space
  s_plain, s_off = plain.state, off.offload(other.state)
  if mode == "numpy":
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(s_off.opt_state))
  else:
    assert _kinds(s_off.opt_state) == {"pinned_host"} and _kinds(s_off.ref_params) == {"pinned_host"}
    assert _kinds(s_off.params) == {"device"}
  for seed in range(2):  # the second step reads the moments the first wrote through the host
    batch = host_batch(8, seed=seed)
    s_plain, m_plain = plain.train_step(s_plain, plain.put_batch(batch), jax.random.key(seed))
    s_off, m_off = off.train_step(s_off, other.put_batch(batch), jax.random.key(seed))
  if mode != "numpy":  # still offloaded after the steps, sharded as on the device
    assert _kinds(s_off.opt_state) == {"pinned_host"}
    mu = [x for x in jax.tree.leaves(s_off.opt_state) if x.ndim == 2]
    mu_dev = [x for x in jax.tree.leaves(s_plain.opt_state) if x.ndim == 2]
    assert mu and all(a.sharding.with_memory_kind("device").is_equivalent_to(b.sharding, 2) for a, b in zip(mu, mu_dev))
  for k in ("loss", "grad_norm", "pg_loss"):
    np.testing.assert_allclose(m_off[k], m_plain[k], rtol=1e-5, err_msg=k)
  # kl (~4e-5 here) is made of log-ratios of log-probs near -5, each rounded to float32's 5e-7 there:
  # two programs that round differently (XLA's unoptimised CPU code, the offloaded step's own
  # program) agree to ~1e-9 (3e-5 of it), not to 1e-5 of it. A wrong reference (the policy itself:
  # 0; another one: far away) is still far outside.
  np.testing.assert_allclose(m_off["kl"], m_plain["kl"], rtol=1e-5, atol=1e-8, err_msg="kl")
  assert float(m_plain["kl"]) > 1e-6
  for name, a, b in (("params", s_off.params, s_plain.params), ("opt_state", s_off.opt_state, s_plain.opt_state)):
    la, lb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7, err_msg=name)
  # fetch brings everything back to the learner's own layout, and the plain learner can continue
  back = off.fetch(s_off)
  assert _kinds(back.opt_state) == {"device"}
  assert off.bytes_per_step == 2 * (offload_lib.tree_bytes(back.opt_state) + offload_lib.tree_bytes(back.ref_params))


def test_offload_rejects_unknown_or_missing_components(tiny_model):
  learner = Learner(tiny_model(), _cfg(kl_coef=0.0))  # no reference copy without a KL term
  with pytest.raises(ValueError, match=r"learner.offload=\('gpu',\): 'gpu' is not an offloadable component"):
    offload_lib.HostOffload(learner, ("gpu",))
  with pytest.raises(ValueError, match="'reference' does not exist"):
    offload_lib.HostOffload(learner, ("reference",))
  with pytest.raises(ValueError, match="'critic' does not exist.*model.critic_path"):
    offload_lib.HostOffload(learner, ("critic",))
  assert offload_lib.HostOffload(learner, ("optimizer", "optimizer")).components == ("optimizer",)


def test_memory_helpers():
  assert offload_lib.host_memory_kind(jax.devices()[:2]) in ("pinned_host", None)
  assert offload_lib.tree_bytes({"a": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.int8)}) == 53
  peak = offload_lib.peak_device_memory(jax.devices()[:1])
  assert peak is None or peak > 0


@pytest.mark.slow
def test_offloaded_ppo_step_equals_plain_step(tiny_model, host_batch):
  from tunixlike.learner.ppo import PPOLearner
  from tunixlike.learner.value import PolicyWithValue
  ppo = _cfg(kl_coef=0.0, kl_reward_coef=0.1)  # prepare reads the (offloaded) reference
  plain = PPOLearner(PolicyWithValue.create(tiny_model(), seed=0), ppo)
  other = PPOLearner(PolicyWithValue.create(tiny_model(), seed=0), ppo)
  off = offload_lib.HostOffload(other, ("optimizer", "reference"))
  s_plain, s_off = plain.state, off.offload(other.state)
  for seed in range(2):
    batch = host_batch(8, seed=seed)
    s_plain, m_plain = plain.train_step(s_plain, plain.put_batch(batch), jax.random.key(seed))
    s_off, m_off = off.train_step(s_off, other.put_batch(batch), jax.random.key(seed))
  assert _kinds(s_off.ref_params) == {"pinned_host"}
  for k in ("loss", "vf_loss", "kl_reward", "value_mean"):
    np.testing.assert_allclose(m_off[k], m_plain[k], rtol=1e-5, err_msg=k)
  for x, y in zip(jax.tree.leaves(jax.device_get(s_off.params)), jax.tree.leaves(jax.device_get(s_plain.params))):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
