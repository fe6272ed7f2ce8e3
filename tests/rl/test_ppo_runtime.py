"""PPO wired through the trainer: a separate critic model, host offload of reference, optimizer and
critic, steps through the real async runtime, the policy alone synced to the sampler, and the
checkpointed state (value head, critic, moments) restored into the offloaded layout."""

import jax
import pathlib
import numpy as np
import pytest
from flax import nnx

from tunixlike import checkpoint as checkpoint_lib, config as config_lib, models, rewards
from tunixlike.data import char_tokenizer
from tunixlike.learner import offload as offload_lib, ppo as ppo_lib
from tunixlike.rl import build
from tunixlike.rl.prompts import PromptStream

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def ppo_config(**changes):
  cfg = config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_ppo.py", "size=tiny"))
  return config_lib.replace(cfg, data=dict(num_eval_examples=16), warm_start=dict(max_steps=0),
                            log=dict(progress_bar=False, tensorboard=False), sampler=dict(max_concurrent_decodes=16),
                            rl=dict(num_steps=2, prompts_per_step=4, max_staleness=0), **changes)


def save_critic(path, vocab_size):
  critic = models.Transformer(models.tiny_config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                                 head_dim=8, num_layers=1), rngs=nnx.Rngs(3))
  models.save_pretrained(critic, path)
  return str(path)


def test_a_critic_checkpoint_that_does_not_match_fails_at_build(tmp_path):
  vocab = char_tokenizer.build().vocab_size
  bad = save_critic(tmp_path / "critic", vocab + 7)
  cfg = ppo_config(model=dict(critic_path=bad))
  with pytest.raises(ValueError, match=rf"model.critic_path='{bad}': tensor model.embed_tokens.weight has shape "
                                       rf"\({vocab + 7}, 32\)"):
    build.build(cfg)


@pytest.mark.slow
def test_ppo_with_critic_and_offload_through_the_runtime(tmp_path):
  critic = save_critic(tmp_path / "critic", char_tokenizer.build().vocab_size)
  cfg = ppo_config(model=dict(critic_path=critic), algo=dict(kl_reward_coef=0.05),
                   learner=dict(offload=("reference", "optimizer", "critic")))
  setup = build.build(cfg)
  # A reward with variance from a random model.
  rl = build.build_rl(setup, reward=rewards.CombinedReward(["stopped"], timeout_s=cfg.rl.reward_timeout_s))
  learner = rl.policy.learner
  assert isinstance(learner, offload_lib.OffloadedLearner) and isinstance(learner.inner, ppo_lib.PPOLearner)
  kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
  assert kinds(learner.state.opt_state) == kinds(learner.state.ref_params) == {"pinned_host"}
  assert kinds(learner.state.params["critic"]) == {"pinned_host"} and kinds(learner.state.params["policy"]) == {"device"}
  # The sampler gets exactly the policy's parameters (no value head, no critic).
  policy_paths = {p for p, _ in nnx.to_flat_state(rl.policy.full_params())}
  engine_paths = {p for p, _ in nnx.to_flat_state(nnx.state(setup.model))}
  assert policy_paths == engine_paths
  before = jax.device_get(rl.policy.full_params())
  records = []
  runtime = build.make_runtime(setup, rl, PromptStream(iter(setup.train_pipe)))
  runtime.hooks.add(lambda info: records.append(info.metrics))
  runtime.run(threaded=False)
  assert rl.policy.version == 2 and len(records) == 2
  for m in records:
    for k in ("vf_loss", "vf_clip_frac", "value_mean", "return_mean", "kl_reward", "token_advantage_abs"):
      assert np.isfinite(m[k]), k
    assert ("learner/peak_bytes" in m) == (offload_lib.peak_device_memory(jax.devices()[:1]) is not None)
  after = jax.device_get(rl.policy.full_params())
  assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
  assert kinds(learner.state.params["critic"]) == {"pinned_host"}  # still offloaded after the steps
  # The run's checkpoint path: save the (offloaded) state, restore it into the same layout.
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "ckpt"),
                                     checkpoint_lib.CheckpointSchedule(keep=1, every_steps=0, every_seconds=0))
  ckpt.save(2, learner.state, {"version": 2}, force=True)
  ckpt.wait()
  saved = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(learner.state))]
  meta = rl.policy.restore(ckpt)
  ckpt.close()
  assert meta["version"] == 2 and kinds(learner.state.opt_state) == {"pinned_host"}
  assert set(learner.state.params) == {"policy", "critic", "value_head"}
  for x, y in zip(jax.tree.leaves(jax.device_get(learner.state)), saved):
    np.testing.assert_array_equal(np.asarray(x), y)
  setup.tracer.close()
