"""Keep Sampling Mask: the learner scores tokens under the sampler's recorded top-k / top-p set."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunixlike import config as config_lib, models
from tunixlike.learner import batch as batch_lib, logprobs, sampling_mask
from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig
from tunixlike.learner.group_advantages import AdvantageConfig
from tunixlike.learner.train_step import Learner
from tunixlike.rollout import Completion, RolloutGroup
from tunixlike.sampler import PromptRequest, RolloutDriver, SamplerConfig
from tunixlike.sampler.engine import Engine

# Groups no reward stage scored get their advantages in assemble_batch: the run's algo keys at their defaults.
UNSCORED = AdvantageConfig.from_config(config_lib.Config())

VOCAB = 128
CFG = models.tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=8)
TEMPERATURE = 0.7


def test_one_token_by_hand():
  # logits [2, 1, 0, -1] at T = 0.5 -> [4, 2, 0, -2]; the sampler kept {0, 1} (top-p) for the target 1.
  logits = jnp.array([[[2.0, 1.0, 0.0, -1.0]]])
  mask = jnp.asarray(np.packbits(np.array([[[1, 1, 0, 0]]], bool), axis=-1))  # [1, 1, 1] uint8
  target = jnp.array([[1]])
  want = 2.0 - np.log(np.exp(4.0) + np.exp(2.0))  # log e^2 / (e^4 + e^2)
  ident = lambda h: h  # "hidden states" are the logits
  got, ent = logprobs.chunked_token_logprobs(logits, target, ident, temperature=0.5, mask_btw=mask)
  np.testing.assert_allclose(got, [[want]], rtol=1e-6)
  p = np.exp([4.0, 2.0]) / np.exp([4.0, 2.0]).sum()
  np.testing.assert_allclose(ent, [[-(p * np.log(p)).sum()]], rtol=1e-5)
  # Without the mask: the full softmax at T = 0.5.
  full, _ = logprobs.chunked_token_logprobs(logits, target, ident, temperature=0.5)
  np.testing.assert_allclose(full, [[2.0 - np.log(np.exp([4.0, 2.0, 0.0, -2.0]).sum())]], rtol=1e-6)
  # An all-zero row is "nothing recorded": the whole vocabulary, like no mask.
  empty, _ = logprobs.chunked_token_logprobs(logits, target, ident, temperature=0.5,
                                             mask_btw=jnp.zeros_like(mask))
  np.testing.assert_allclose(empty, full, rtol=1e-6)
  # Gradients reach the kept logits only, and are finite.
  g = jax.grad(lambda x: logprobs.chunked_token_logprobs(x, target, ident, temperature=0.5,
                                                         mask_btw=mask)[0].sum())(logits)
  np.testing.assert_allclose(g[0, 0], [-2.0 * p[0], 2.0 * (1 - p[1]), 0.0, 0.0], rtol=1e-5)


def test_chunked_mask_equals_unchunked():
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(2, 16, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(8, 20)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 20, size=(2, 16)), jnp.int32)
  keep = rng.random((2, 16, 20)) < 0.5
  keep[np.arange(2)[:, None], np.arange(16)[None], np.asarray(y)] = True
  mask = jnp.asarray(np.packbits(keep, axis=-1))
  one, _ = logprobs.chunked_token_logprobs(h, y, lambda x: x @ w, chunk_size=16, mask_btw=mask)
  four, _ = logprobs.chunked_token_logprobs(h, y, lambda x: x @ w, chunk_size=4, mask_btw=mask)
  np.testing.assert_allclose(four, one, rtol=1e-6)
  logits = np.asarray(h @ w, np.float64)
  logits[~keep] = -np.inf
  want = np.take_along_axis(logits, np.asarray(y)[..., None], -1)[..., 0] - np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(one, want, rtol=1e-5)
  with pytest.raises(ValueError, match="bytes per token"):
    logprobs.chunked_token_logprobs(h, y, lambda x: x @ w, mask_btw=mask[..., :2])


def _rollouts(top_p, top_k, n_prompts=4, group_size=2):
  engine = Engine(models.Transformer(CFG, rngs=nnx.Rngs(0)),
                  SamplerConfig(max_concurrent_decodes=4, max_prefill_length=16, max_new_tokens=12,
                                steps_per_call=4, attend_bucket=16, temperature=TEMPERATURE, top_p=top_p,
                                top_k=top_k, record_sampling_mask=True, group_size=group_size))
  rng = np.random.default_rng(1)
  requests = [PromptRequest(prompt_id=i, token_ids=rng.integers(1, VOCAB, size=3 + i).astype(np.int32))
              for i in range(n_prompts)]
  out = []
  RolloutDriver(engine, engine.load_params(), source=iter(requests), sink=out.append).run(max_wall_s=120)
  for g in out:
    g.rewards = np.arange(g.group_size, dtype=np.float32)
  return sorted(out, key=lambda g: g.prompt_id)


def _learner_vs_sampler(groups, keep: bool):
  """log(pi_learner / mu_sampler) on every completion token, from the learner's proximal logprobs."""
  learner = Learner(models.Transformer(CFG, rngs=nnx.Rngs(0)),
                    LearnerConfig(algo=AlgoConfig(keep_sampling_mask=keep, sampling_temperature=TEMPERATURE),
                                  optim=OptimConfig(learning_rate=1e-3), logprob_chunk_size=8))
  batch = batch_lib.assemble_batch(groups, num_rows=8, seq_buckets=(32,), sampling_mask=True, routing=False,
                                   unscored=UNSCORED)
  placed = learner.put_batch(batch)
  logp = np.asarray(learner.token_logprobs(learner.state, placed))[0]
  m = batch["loss_mask"] > 0
  return (logp - batch["behaviour_logprobs"])[m], learner, placed


@pytest.mark.slow
def test_ratio_is_one_with_the_mask_and_not_without():
  groups = _rollouts(top_p=0.8, top_k=40)
  kept = np.concatenate([sampling_mask.unpack(jnp.asarray(c.sampling_mask), VOCAB).sum(-1)
                         for g in groups for c in g.completions])
  assert kept.min() >= 1 and kept.max() < VOCAB  # top-k / top-p truncated every distribution
  log_ratio, learner, placed = _learner_vs_sampler(groups, keep=True)
  assert log_ratio.size == sum(g.num_tokens for g in groups) == 4 * 2 * 12
  assert np.abs(np.expm1(log_ratio)).max() < 1e-4
  off, _, _ = _learner_vs_sampler(groups, keep=False)
  # Without the mask the learner's full softmax gives every token less mass than the sampler did.
  assert np.mean(np.abs(off)) > 1e-3 and np.all(off < 1e-5)

  # The train step uses the same logprobs: at staleness 0 the behaviour -> proximal weights are 1.
  _, metrics = learner.train_step(learner.state, placed, jax.random.PRNGKey(0))
  metrics = jax.device_get(metrics)
  assert metrics["nonfinite"] == 0
  assert abs(metrics["is_weight"] - 1.0) < 1e-4 and metrics["is_raw_weight_max"] < 1 + 1e-4
  assert metrics["mismatch_kl"] < 1e-8


def test_batch_checks_masks():
  mask = np.packbits(np.eye(16, dtype=bool)[[3, 5]], axis=-1)  # tokens 3 and 5 kept, one each

  def comp(ids, **kw):
    return Completion(np.array(ids, np.int32), np.zeros(len(ids), np.float32), np.zeros(len(ids), np.int32),
                      "eos", **kw)

  def group(*comps):
    return RolloutGroup(prompt_id="p", prompt_token_ids=np.array([1], np.int32), completions=list(comps),
                        rewards=np.arange(len(comps), dtype=np.float32))

  g = group(comp([3, 5], sampling_mask=mask), comp([3], sampling_mask=mask[:1]))
  b = batch_lib.assemble_batch([g], num_rows=4, seq_buckets=(4,), sampling_mask=True, routing=False, unscored=UNSCORED)
  assert b["sampling_mask"].shape == (4, 4, 2) and b["sampling_mask"].dtype == np.uint8
  np.testing.assert_array_equal(b["sampling_mask"][0, 1:3], mask)
  np.testing.assert_array_equal(b["sampling_mask"][1, 1:2], mask[:1])
  assert not b["sampling_mask"][:, 0].any() and not b["sampling_mask"][1, 2:].any() and not b["sampling_mask"][2:].any()
  assert "sampling_mask" not in batch_lib.assemble_batch([g], num_rows=4, seq_buckets=(4,), sampling_mask=False,
                                                         routing=False, unscored=UNSCORED)

  swapped = comp([5, 3], sampling_mask=mask)
  with pytest.raises(ValueError, match=r"prompt_id='p'.*completions\[1\].sampling_mask: token 0 \(id 5\)"):
    batch_lib.assemble_batch([group(comp([3], sampling_mask=mask[:1]), swapped)], num_rows=4, seq_buckets=(4,),
                             sampling_mask=True, routing=False, unscored=UNSCORED)
  swapped.loss_mask = np.zeros(2, np.int32)  # environment tokens: not checked
  batch_lib.assemble_batch([group(swapped, swapped)], num_rows=4, seq_buckets=(4,), sampling_mask=True, routing=False,
                           unscored=UNSCORED)
  with pytest.raises(ValueError, match=r"completions\[0\].sampling_mask is None.*record_sampling_mask"):
    batch_lib.assemble_batch([group(comp([3]), swapped)], num_rows=4, seq_buckets=(4,), sampling_mask=True,
                             routing=False, unscored=UNSCORED)
  with pytest.raises(ValueError, match="bytes per token, other completions have 2"):
    batch_lib.assemble_batch([group(swapped, comp([3], sampling_mask=np.zeros((1, 3), np.uint8)))], num_rows=4,
                             seq_buckets=(4,), sampling_mask=True, routing=False, unscored=UNSCORED)


def test_learner_needs_the_mask_when_asked(host_batch):
  learner = Learner(models.Transformer(CFG, rngs=nnx.Rngs(0)),
                    LearnerConfig(algo=AlgoConfig(keep_sampling_mask=True), optim=OptimConfig(learning_rate=1e-3),
                                  logprob_chunk_size=8))
  with pytest.raises(ValueError, match="keep_sampling_mask=True but the batch has no 'sampling_mask'"):
    learner.token_logprobs(learner.state, learner.put_batch(host_batch(8)))
  bad = dict(host_batch(8), sampling_mask=np.zeros((8, 16), np.uint8))
  with pytest.raises(ValueError, match=r"batch\['sampling_mask'\] has shape \(8, 16\)"):
    learner.put_batch(bad)
  for value in (0.0, -1.0, float("inf")):
    with pytest.raises(ValueError, match="AlgoConfig.sampling_temperature"):
      AlgoConfig(sampling_temperature=value)
