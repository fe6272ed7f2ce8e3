"""PPO with a separate critic model (loaded from a Hugging Face directory), its offload, and the
OffloadedLearner wrapper the trainer drives (state stays on the host, checkpoints round-trip)."""

import os

import jax
import numpy as np
import pytest

from tunixlike import checkpoint as checkpoint_lib, models
from tunixlike.learner import offload as offload_lib
from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig
from tunixlike.learner.ppo import PPOLearner
from tunixlike.learner.value import PolicyWithCritic, PolicyWithValue, load_critic


def _cfg(**algo):
  return LearnerConfig(algo=AlgoConfig(**algo), optim=OptimConfig(learning_rate=3e-3, micro_batches=2), logprob_chunk_size=8)


def _kinds(tree):
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _np(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.fixture
def critic_dir(tmp_path, tiny_model):
  """A smaller critic than the policy (hidden 16, one layer) over the same 128-token vocabulary."""
  path = tmp_path / "critic"
  models.save_pretrained(tiny_model(seed=5, hidden_size=16, num_layers=1, intermediate_size=32, num_heads=2,
                                    num_kv_heads=1), path)
  return str(path)


def test_load_critic_errors_name_the_key_path_and_tensor(tmp_path, tiny_model, critic_dir):
  policy = tiny_model()
  critic = load_critic(critic_dir, policy)
  assert critic.cfg.hidden_size == 16 and critic.cfg.vocab_size == policy.cfg.vocab_size
  wrong_vocab = tmp_path / "wrong_vocab"
  models.save_pretrained(tiny_model(vocab_size=96), wrong_vocab)
  with pytest.raises(ValueError, match=rf"model.critic_path='{wrong_vocab}': tensor model.embed_tokens.weight has "
                                       r"shape \(96, 32\) \(vocab 96\), but the policy's vocabulary has 128"):
    load_critic(str(wrong_vocab), policy)
  os.remove(os.path.join(critic_dir, "model.safetensors"))
  with pytest.raises(ValueError, match=rf"model.critic_path='{critic_dir}': .*model.safetensors"):
    load_critic(critic_dir, policy)
  with pytest.raises(ValueError, match="model.critic_path='/nonexistent/critic'.*not a directory"):
    load_critic("/nonexistent/critic", policy)


@pytest.mark.slow
def test_separate_critic_trains_without_touching_the_policy_trunk_values(tiny_model, host_batch, critic_dir):
  policy = tiny_model()
  both = PolicyWithCritic.create(policy, load_critic(critic_dir, policy), seed=0)
  learner = PPOLearner(both, _cfg(vf_coef=1.0))
  state = learner.state
  assert set(state.params) == {"policy", "critic", "value_head"}
  assert state.params["value_head"]["proj"]["kernel"].get_value().shape == (16, 1)  # sized from the critic
  critic0, policy0 = _np(state.params["critic"]), _np(state.params["policy"])
  host = host_batch(8)
  batch, stats = learner.prepare(state, learner.put_batch(host))
  model = learner.model(state)
  want = np.asarray(model.value_head(model.critic.hidden_states(host["tokens"])))
  mask = host["loss_mask"][:, 1:]
  np.testing.assert_allclose(np.asarray(batch["old_values"]).reshape(8, -1)[:, 1:], want[:, :-1] * mask,
                             rtol=1e-5, atol=1e-6)
  state, metrics = learner.train_step(state, batch, jax.random.key(0))
  assert np.isfinite(float(metrics["vf_loss"])) and float(metrics["vf_loss"]) > 0
  assert any(not np.allclose(a, b) for a, b in zip(_np(state.params["critic"]), critic0))
  assert any(not np.allclose(a, b) for a, b in zip(_np(state.params["policy"]), policy0))
  assert learner.policy(state).cfg.hidden_size == 32  # the policy alone, for the sampler


@pytest.mark.slow
def test_offloaded_critic_step_equals_plain_step(tiny_model, host_batch, critic_dir):
  def make():
    policy = tiny_model()
    return PPOLearner(PolicyWithCritic.create(policy, load_critic(critic_dir, policy), seed=0), _cfg())
  plain, other = make(), make()
  off = offload_lib.HostOffload(other, ("critic", "optimizer"))
  s_plain, s_off = plain.state, off.offload(other.state)
  assert _kinds(s_off.params["critic"]) == {"pinned_host"} and _kinds(s_off.params["policy"]) == {"device"}
  assert _kinds(s_off.params["value_head"]) == {"device"}
  for seed in range(2):
    batch = host_batch(8, seed=seed)
    s_plain, m_plain = plain.train_step(s_plain, plain.put_batch(batch), jax.random.key(seed))
    s_off, m_off = off.train_step(s_off, other.put_batch(batch), jax.random.key(seed))
  assert _kinds(s_off.params["critic"]) == {"pinned_host"}
  for k in ("loss", "vf_loss", "value_mean", "grad_norm"):
    np.testing.assert_allclose(m_off[k], m_plain[k], rtol=1e-5, err_msg=k)
  for x, y in zip(_np(s_off.params), _np(s_plain.params)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  sizes = offload_lib.component_bytes(s_plain)
  assert off.bytes_per_step == 2 * (sizes["critic"] + sizes["optimizer"])


@pytest.mark.slow
def test_offloaded_learner_keeps_state_on_host_and_checkpoints_round_trip(tiny_model, host_batch, tmp_path):
  learner = PPOLearner(PolicyWithValue.create(tiny_model(), seed=0), _cfg(kl_reward_coef=0.05))
  wrapped = offload_lib.OffloadedLearner(learner, ("reference", "optimizer"))
  assert learner.state is None  # no device copy left behind
  assert _kinds(wrapped.state.opt_state) == {"pinned_host"} and _kinds(wrapped.state.ref_params) == {"pinned_host"}
  assert wrapped.mesh is learner.mesh and wrapped.policy is not None  # everything else is the learner's
  wrapped.state, m = wrapped.train_step(wrapped.state, wrapped.put_batch(host_batch(8)), jax.random.key(0))
  assert "vf_loss" in m and int(wrapped.state.step) == 1
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "ckpt"),
                                     checkpoint_lib.CheckpointSchedule(keep=1, every_steps=0, every_seconds=0))
  ckpt.save(1, wrapped.state, {"version": 1}, force=True)
  ckpt.wait()
  saved = _np(wrapped.state)
  wrapped.state, _ = wrapped.train_step(wrapped.state, wrapped.put_batch(host_batch(8, seed=1)), jax.random.key(1))
  wrapped.state, meta = ckpt.restore(abstract_state=wrapped.state)
  ckpt.close()
  assert meta["version"] == 1 and int(wrapped.state.step) == 1
  assert _kinds(wrapped.state.opt_state) == {"pinned_host"}  # restored straight into host memory
  for x, y in zip(_np(wrapped.state), saved):  # value head and optimizer moments included
    np.testing.assert_array_equal(x, y)
  on_device = wrapped.host.fetch(wrapped.state)
  assert _kinds(on_device.opt_state) == {"device"}
  wrapped.state = on_device  # assigning a device state offloads it again
  assert _kinds(wrapped.state.opt_state) == {"pinned_host"}
