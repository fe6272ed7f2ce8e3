import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jit_traces import count_traces
from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig
from tunixlike.learner.ppo import PPOLearner
from tunixlike.learner.value import PolicyWithValue, ValueHead
from tunixlike.mesh import LEARNER_RULES


def _cfg(micro=1, lr=1e-3, **algo):
  return LearnerConfig(algo=AlgoConfig(**algo), optim=OptimConfig(learning_rate=lr, micro_batches=micro),
                       logprob_chunk_size=8)


def _leaf(tree, *path):
  for p in path:
    tree = tree[p]
  return np.asarray(jax.device_get(tree.get_value()))


def test_value_head_shapes_and_axes(tiny_model):
  model = PolicyWithValue.create(tiny_model(), seed=0)
  h = model.hidden_states(jnp.ones((2, 5), jnp.int32))
  v = model.values(h)
  assert v.shape == (2, 5) and v.dtype == jnp.float32
  assert model.value_head.proj.kernel.get_metadata()["out_sharding"] == ("embed", None)
  assert np.abs(np.asarray(model.value_head.proj.kernel.get_value())).max() > 0  # non-zero: trunk gets gradient
  with pytest.raises(ValueError, match="hidden_size"):
    ValueHead(0, rngs=nnx.Rngs(0), param_dtype="float32")


def test_ppo_settings_are_the_algo_sections_and_bad_values_are_refused(tiny_model):
  with pytest.raises(ValueError, match="algo.gamma=1.2"):
    AlgoConfig(gamma=1.2)
  with pytest.raises(ValueError, match="algo.gae_lambda=-0.5"):
    AlgoConfig(gae_lambda=-0.5)
  with pytest.raises(ValueError, match="algo.vf_clip=-0.1"):
    AlgoConfig(vf_clip=-0.1)
  with pytest.raises(ValueError, match="algo.loss='gspo'"):
    PPOLearner(PolicyWithValue.create(tiny_model(), seed=0), _cfg(loss="gspo"))
  with pytest.raises(ValueError, match="PolicyWithValue"):
    PPOLearner(tiny_model(), _cfg())


def test_prepare_matches_gae_by_hand(tiny_model, host_batch):
  learner = PPOLearner(PolicyWithValue.create(tiny_model(), seed=0), _cfg(micro=2, gamma=0.9, gae_lambda=0.8,
                                                                          whiten_advantages=False))
  host = host_batch(8)
  batch, stats = learner.prepare(learner.state, learner.put_batch(host))
  model = learner.model(learner.state)
  values = np.asarray(model.values(model.hidden_states(jnp.asarray(host["tokens"]))))  # index t -> token t+1
  mask = host["loss_mask"]
  want_adv = np.zeros_like(mask)
  for b in range(8):  # token t's decision is made at position t-1; reward on the last completion token
    idx = np.flatnonzero(mask[b])
    a, v_next = 0.0, 0.0
    for t in idx[::-1]:
      r = host["rewards"][b] if t == idx[-1] else 0.0
      a = r + 0.9 * v_next - values[b, t - 1] + 0.72 * a
      v_next = values[b, t - 1]
      want_adv[b, t] = a
  got = np.asarray(batch["token_advantages"]).reshape(8, -1)
  np.testing.assert_allclose(got, want_adv, rtol=1e-4, atol=1e-5)
  ret = np.asarray(batch["returns"]).reshape(8, -1)
  old = np.asarray(batch["old_values"]).reshape(8, -1)
  np.testing.assert_allclose(ret, (want_adv + old) * mask, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(stats["return_mean"], ret.sum() / mask.sum(), rtol=1e-5)


@pytest.mark.slow
def test_policy_and_value_train_together_without_recompiling(tiny_model, host_batch):
  learner = PPOLearner(PolicyWithValue.create(tiny_model(), seed=0), _cfg(micro=2, lr=3e-3, gamma=1.0, gae_lambda=1.0,
                                                                          kl_reward_coef=0.05))
  state = learner.state
  head0 = _leaf(state.params, "value_head", "proj", "kernel")
  emb0 = _leaf(state.params, "policy", "embed_tokens", "embedding")
  batch, _ = learner.prepare(state, learner.put_batch(host_batch(8, seed=0)))
  compiles = []
  with count_traces() as traces:
    state, m0 = learner.train_step(state, batch, jax.random.key(0))
    listener = lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
      for seed in (1, 2, 3):
        batch, stats = learner.prepare(state, learner.put_batch(host_batch(8, seed=seed)))
        state, metrics = learner.train_step(state, batch, jax.random.fold_in(jax.random.key(0), seed))
      jax.block_until_ready(metrics)
    finally:
      jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == []
  assert traces["_train_step"] == 1
  assert int(state.step) == 4
  for k in ("loss", "pg_loss", "vf_loss", "vf_clip_frac", "entropy", "token_advantage_abs"):
    assert np.isfinite(float(metrics[k])), k
  assert float(stats["kl_reward"]) != 0.0  # the policy moved away from the reference
  assert not np.allclose(_leaf(state.params, "value_head", "proj", "kernel"), head0)
  assert not np.allclose(_leaf(state.params, "policy", "embed_tokens", "embedding"), emb0)
  assert learner.policy(state) is not None


@pytest.mark.slow
def test_value_loss_falls_on_a_fixed_batch(tiny_model, host_batch):
  # gamma = lambda = 1: the value targets are Monte-Carlo returns, fixed whatever the critic says;
  # vf_coef large and lr high so that a handful of steps must reduce the critic's error.
  learner = PPOLearner(PolicyWithValue.create(tiny_model(), seed=0), _cfg(lr=1e-2, gamma=1.0, gae_lambda=1.0,
                                                                          vf_coef=1.0, vf_clip=0.0))
  placed = learner.put_batch(host_batch(8, seed=3))
  state, vf = learner.state, []
  for i in range(12):
    batch, _ = learner.prepare(state, placed)
    state, metrics = learner.train_step(state, batch, jax.random.key(i))
    vf.append(float(metrics["vf_loss"]))
  assert vf[-1] < 0.5 * vf[0], vf
  assert all(np.isfinite(vf))


@pytest.mark.slow
def test_ppo_on_a_sharded_mesh(tiny_model, host_batch, mesh4):
  host = host_batch(8)
  plain = PPOLearner(PolicyWithValue.create(tiny_model(), seed=0), _cfg(micro=2))
  sharded = PPOLearner(PolicyWithValue.create(tiny_model(), seed=0), _cfg(micro=2), mesh=mesh4, rules=LEARNER_RULES)
  kern = sharded.state.params["value_head"]["proj"]["kernel"].get_value()
  assert kern.sharding.spec[0] == "fsdp"  # ('embed', None) under the learner rules
  b1, _ = plain.prepare(plain.state, plain.put_batch(host))
  b2, _ = sharded.prepare(sharded.state, sharded.put_batch(host))
  assert b2["rewards"].sharding.spec[1] == "fsdp"
  for k in ("old_values", "returns", "token_advantages"):
    assert b2[k].sharding.spec[1] == "fsdp", k
    np.testing.assert_allclose(b2[k], b1[k], rtol=1e-4, atol=1e-5, err_msg=k)
  s2, m2 = sharded.train_step(sharded.state, b2, jax.random.key(0))
  assert np.isfinite(float(m2["loss"])) and float(m2["vf_loss"]) > 0
  assert s2.params["value_head"]["proj"]["kernel"].get_value().sharding.is_equivalent_to(kern.sharding, 2)


def test_train_step_prepares_an_unprepared_batch(tiny_model, host_batch):
  learner = PPOLearner(PolicyWithValue.create(tiny_model(), seed=0), _cfg())
  assert learner.model(learner.state).cfg is learner.policy(learner.state).cfg
  host = host_batch(8)
  placed = learner.put_batch(host)
  twin = jax.tree.map(jnp.copy, learner.state)
  prepared, stats = learner.prepare(twin, placed)
  with count_traces() as traces:
    s1, m1 = learner.train_step(learner.state, placed, jax.random.key(0))  # prepares inside
    s2, m2 = learner.train_step(twin, prepared, jax.random.key(0))
  assert traces["_train_step"] == 1
  np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)
  np.testing.assert_allclose(m1["value_mean"], stats["value_mean"], rtol=1e-6)
  assert "value_mean" not in m2
  with pytest.raises(ValueError, match="not all of"):
    learner.train_step(s2, {**placed, "returns": prepared["returns"]}, jax.random.key(0))
  del host["rewards"]
  with pytest.raises(ValueError, match="'rewards'"):
    learner.put_batch(host)


def test_several_updates_per_batch_keep_the_targets_of_the_batch_start(tiny_model, host_batch):
  # optim.updates_per_batch: GAE targets and proximal logprobs come from the batch's first state, so
  # the later updates move the ratio (the clip binds) and the whole batch is one step.
  cfg = LearnerConfig(algo=AlgoConfig(estimator="ppo", eps_low=0.02, eps_high=0.02),
                      optim=OptimConfig(learning_rate=3e-2, updates_per_batch=3), logprob_chunk_size=8)
  learner = PPOLearner(PolicyWithValue.create(tiny_model(), seed=0), cfg)
  state, metrics = learner.train_step(learner.state, learner.put_batch(host_batch(8)), jax.random.key(0))
  assert int(state.step) == 1 and float(metrics["updates_taken"]) == 3
  assert float(metrics["clip_frac"]) > 0.02 and np.isfinite(float(metrics["vf_loss"]))
