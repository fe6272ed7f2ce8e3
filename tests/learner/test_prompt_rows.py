"""Shared-prompt rows (`optim.share_prompts`): a row per group gives the padded layout's loss,
gradients and metrics, and the config refuses what needs a row per sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tunixlike
from tunixlike import config as config_lib, models
from tunixlike.learner import AlgoConfig, Learner, LearnerConfig, OptimConfig, prompt_rows
from tunixlike.learner.batch import assemble_batch
from tunixlike.learner.group_advantages import AdvantageConfig
from tunixlike.rollout import Completion, RolloutGroup
from tunixlike.settings import ConfigError

# Groups no reward stage scored get their advantages in assemble_batch: the run's algo keys at their defaults.
UNSCORED = AdvantageConfig.from_config(config_lib.Config())

V = 32
CFG = models.ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=128)


def _group(rng, i, g=4, token_advantages=False):
  prompt = rng.integers(1, V, size=int(rng.integers(2, 7))).astype(np.int32)
  completions = []
  for ci in range(g):
    n = 0 if ci == 2 and i == 1 else int(rng.integers(1, 7))  # one empty completion in the batch
    mask = None if ci != 1 else (rng.random(n) > 0.3).astype(np.int32)  # environment tokens carry no loss
    completions.append(Completion(rng.integers(1, V, size=n).astype(np.int32),
                                  (rng.normal(size=n) - 3).astype(np.float32),
                                  rng.integers(3, 6, size=n).astype(np.int32), finish_reason="eos", loss_mask=mask))
  group = RolloutGroup(prompt_id=i, prompt_token_ids=prompt, completions=completions)
  group.advantages = rng.normal(size=g).astype(np.float32)
  group.shaped_rewards = rng.normal(size=g).astype(np.float32)
  if token_advantages:
    group.token_advantages = [rng.normal(size=c.num_tokens).astype(np.float32) for c in completions]
  return group


def _learner(attention="auto", **algo):
  model = models.Transformer(CFG.replace(attention=attention), rngs=nnx.Rngs(0))
  return Learner(model, LearnerConfig(algo=AlgoConfig(**algo), optim=OptimConfig(learning_rate=1e-3)))


def test_a_row_holds_the_prompt_once_then_each_answer_at_its_own_positions():
  prompt = np.array([5, 6, 7], np.int32)
  answers = [np.array([8, 9], np.int32), np.array([10, 11, 12], np.int32)]
  group = RolloutGroup(prompt_id=0, prompt_token_ids=prompt, completions=[
      Completion(a, np.zeros(len(a), np.float32), np.full(len(a), 4, np.int32), finish_reason="eos") for a in answers])
  group.advantages = np.array([1.0, -1.0], np.float32)
  b = prompt_rows.assemble([group], num_rows=2, seq_buckets=(8, 16))
  assert b["tokens"].shape == (2, 8)
  np.testing.assert_array_equal(b["tokens"][0], [5, 6, 7, 8, 9, 10, 11, 12])
  np.testing.assert_array_equal(b["positions"][0], [0, 1, 2, 3, 4, 3, 4, 5])
  np.testing.assert_array_equal(b["segments"][0], [0, 0, 0, 1, 1, 2, 2, 2])
  # Each answer's first token is predicted from the prompt's last position, the rest from their own previous one.
  np.testing.assert_array_equal(b["predictor"][0, 3:], [2, 3, 2, 5, 6])
  np.testing.assert_array_equal(b["loss_mask"][0], [0, 0, 0, 1, 1, 1, 1, 1])
  np.testing.assert_array_equal(b["token_advantages"][0], [0, 0, 0, 1, 1, -1, -1, -1])
  np.testing.assert_array_equal(b["versions"][0], [-1, -1, -1, 4, 4, 4, 4, 4])
  assert not b["loss_mask"][1].any() and (b["segments"][1] == -1).all()  # the padding row
  with pytest.raises(ValueError, match="3 rows of groups for num_rows=2"):
    prompt_rows.assemble([group] * 3, num_rows=2, seq_buckets=(8,))


def test_an_answer_sees_the_prompt_and_itself_only():
  """The model's hidden states of each answer in a shared row equal those of its own padded row."""
  rng = np.random.default_rng(1)
  model = models.Transformer(CFG, rngs=nnx.Rngs(0))
  group = _group(rng, 0)
  row = prompt_rows.assemble([group], num_rows=1, seq_buckets=(64,))
  shared = model.hidden_states(jnp.asarray(row["tokens"]), jnp.asarray(row["positions"]),
                               segments_bt=jnp.asarray(row["segments"]))[0]
  p, start = len(group.prompt_token_ids), len(group.prompt_token_ids)
  for c in group.completions:
    alone = model.hidden_states(jnp.asarray(np.concatenate([group.prompt_token_ids, c.token_ids])[None]))[0]
    np.testing.assert_allclose(shared[:p], alone[:p], atol=1e-5)
    np.testing.assert_allclose(shared[start:start + c.num_tokens], alone[p:], atol=1e-5)
    start += c.num_tokens


# Each loss once, and both kinds of advantage (a group's, broadcast over its tokens, and per-token
# ones): the row layout places advantages the same way whatever the loss does with them.
@pytest.mark.parametrize("algo, token_advantages", [
    (dict(loss="ppo_clip", aggregation="seq_mean_token_mean", is_mode="tis", kl_coef=0.1), False),
    (dict(loss="ppo_clip", aggregation="token_mean", is_mode="mis"), True),
    (dict(loss="dapo", aggregation="seq_mean_token_sum_norm", norm_length=8), True),
], ids=["seq_mean_kl_tis-group_adv", "token_mean_mis-token_adv", "dapo_sum_norm-token_adv"])
def test_shared_rows_train_as_a_row_per_answer(algo, token_advantages):
  rng = np.random.default_rng(0)
  groups = [_group(rng, i, token_advantages=token_advantages) for i in range(3)]
  padded = assemble_batch(groups, num_rows=12, seq_buckets=(16,), sampling_mask=False, routing=False, unscored=UNSCORED)
  shared = prompt_rows.assemble(groups, num_rows=4, seq_buckets=(40,))
  assert shared["tokens"].size < padded["tokens"].size
  results = []
  for batch in (padded, shared):
    learner = _learner(**algo)
    loss, grads = learner.loss_and_grads(learner.state, learner.put_batch(batch))
    _, metrics = learner.train_step(learner.state, learner.put_batch(batch), jax.random.key(0))
    results.append((float(loss), grads, jax.device_get(metrics)))
  (loss_p, grads_p, metrics_p), (loss_s, grads_s, metrics_s) = results
  assert loss_s == pytest.approx(loss_p, rel=1e-5, abs=1e-7)
  for a, b in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_s)):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads_p)) > 1e-4  # the comparison means something
  # advantage_abs_mean is a row mean in both layouts: a group's mean differs when one answer is empty.
  for k in set(metrics_p) - {"advantage_abs_mean"}:
    assert float(metrics_s[k]) == pytest.approx(float(metrics_p[k]), rel=1e-4, abs=1e-6), k


def _tiny_group(i, prompt, answers, adv):
  g = RolloutGroup(prompt_id=i, prompt_token_ids=np.array(prompt, np.int32), completions=[
      Completion(np.array(a, np.int32), np.zeros(len(a), np.float32), np.full(len(a), 4, np.int32),
                 finish_reason="eos") for a in answers])
  g.advantages = np.array(adv, np.float32)
  return g


def test_packed_rows_hold_whole_groups_each_with_its_own_prompt():
  a = _tiny_group(0, [5, 6], [[7], [8, 9]], [1.0, -1.0])
  b = _tiny_group(1, [10, 11, 12], [[13, 14]], [2.0])
  c = _tiny_group(2, [1] * 6, [[2] * 4], [0.5])  # 10 tokens: a row of its own with a budget of 12
  rows = prompt_rows.pack([a, b, c], 12)
  assert sorted(map(sorted, rows)) == [[0, 1], [2]]
  batch = prompt_rows.assemble([a, b, c], num_rows=2, seq_buckets=(12,), rows=[[0, 1], [2]])
  np.testing.assert_array_equal(batch["tokens"][0], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 0, 0])
  np.testing.assert_array_equal(batch["segments"][0], [0, 0, 1, 2, 2, 3, 3, 3, 4, 4, -1, -1])
  np.testing.assert_array_equal(batch["prefix"][0], [0, 0, 0, 0, 0, 3, 3, 3, 3, 3, -1, -1])
  np.testing.assert_array_equal(batch["positions"][0, :10], [0, 1, 2, 2, 3, 0, 1, 2, 3, 4])
  np.testing.assert_array_equal(batch["predictor"][0, [2, 3, 4, 8, 9]], [1, 1, 3, 7, 8])
  assert batch["advantages"][0] == pytest.approx(4 / 3)  # mean |advantage| over the row's answers
  with pytest.raises(ValueError, match="holds 10 tokens, more than optim.pack_tokens=8"):
    prompt_rows.pack([c], 8)


def test_a_packed_answer_sees_its_own_prompt_and_itself_only():
  rng = np.random.default_rng(3)
  model = models.Transformer(CFG.replace(attention="blockwise"), rngs=nnx.Rngs(0))
  groups = [_group(rng, i) for i in range(3)]
  batch = prompt_rows.assemble(groups, num_rows=1, seq_buckets=(128,), rows=[[0, 1, 2]])
  packed = model.hidden_states(*(jnp.asarray(batch[k]) for k in ("tokens", "positions")),
                               segments_bt=jnp.asarray(batch["segments"]), prefix_bt=jnp.asarray(batch["prefix"]))[0]
  start = 0
  for g in groups:
    p = len(g.prompt_token_ids)
    for ci, c in enumerate(g.completions):
      alone = model.hidden_states(jnp.asarray(np.concatenate([g.prompt_token_ids, c.token_ids])[None]))[0]
      np.testing.assert_allclose(packed[start:start + p], alone[:p], atol=1e-5)
      at = np.nonzero(batch["segments"][0] == batch["segments"][0, start] + 1 + ci)[0]
      np.testing.assert_allclose(packed[at], alone[p:], atol=1e-5)
    start += prompt_rows.row_length(g)


@pytest.mark.parametrize("algo, attention", [
    (dict(loss="ppo_clip", aggregation="seq_mean_token_mean", is_mode="tis", kl_coef=0.1), "auto"),
    (dict(loss="ppo_clip", aggregation="token_mean", is_mode="mis"), "blockwise"),
    (dict(loss="dapo", aggregation="seq_mean_token_sum_norm", norm_length=8), "auto"),
], ids=["seq_mean_kl_tis", "token_mean_mis_blockwise", "dapo_sum_norm"])
def test_packed_rows_train_as_a_row_per_answer(algo, attention):
  """Several groups per row: the loss, gradients and every metric of a row per answer."""
  rng = np.random.default_rng(5)
  groups = [_group(rng, i) for i in range(5)]
  padded = assemble_batch(groups, num_rows=20, seq_buckets=(16,), sampling_mask=False, routing=False, unscored=UNSCORED)
  rows = prompt_rows.pack(groups, 64)
  assert len(rows) < len(groups) and max(map(len, rows)) > 1
  packed = prompt_rows.assemble(groups, num_rows=len(rows), seq_buckets=(64,), rows=rows)
  results = []
  for batch in (padded, packed):
    learner = _learner(attention, **algo)
    loss, grads = learner.loss_and_grads(learner.state, learner.put_batch(batch))
    _, metrics = learner.train_step(learner.state, learner.put_batch(batch), jax.random.key(0))
    results.append((float(loss), grads, jax.device_get(metrics)))
  (loss_p, grads_p, metrics_p), (loss_k, grads_k, metrics_k) = results
  assert loss_k == pytest.approx(loss_p, rel=1e-5, abs=1e-7)
  for a, b in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_k)):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7)
  for k in set(metrics_p) - {"advantage_abs_mean"}:  # a row mean (see above)
    assert float(metrics_k[k]) == pytest.approx(float(metrics_p[k]), rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("overrides, match", [
    ({"algo.loss": "gspo"}, "algo.loss='gspo'"),
    ({"algo.is_level": "sequence"}, "algo.is_level='sequence'"),
    ({"optim.micro_batches": 2, "optim.group_by_length": 2}, "optim.group_by_length"),
    ({"rl.prompts_per_step": 6}, "rl.prompts_per_step=6: prompts_per_step .optim.share_prompts: a row per group"),
])
def test_the_config_refuses_what_needs_a_row_per_sequence(overrides, match):
  with pytest.raises(ConfigError, match=match):
    tunixlike.load_config("configs/addition_grpo.py", {"optim.share_prompts": True, **overrides})
  assert tunixlike.load_config("configs/addition_grpo.py", {"optim.share_prompts": False, **overrides})


def test_packing_needs_shared_prompt_rows():
  with pytest.raises(ConfigError, match="optim.pack_tokens=64: packs shared-prompt rows"):
    tunixlike.load_config("configs/addition_grpo.py", {"optim.share_prompts": False, "optim.pack_tokens": 64})
  assert tunixlike.load_config("configs/addition_grpo.py", {"optim.share_prompts": True, "optim.pack_tokens": 64})
