"""Keep Routing: the sampler records its MoE experts, the learner replays them.

The end-to-end test samples with the real Engine + RolloutDriver, then gives the learner a router
whose top-k flips for some tokens (an expert the sampler never used at any replayed position gets
a router column 5x another expert's). Without replay the learner runs other experts and its
log-probs move; with replay they equal the sampler's in fp32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jit_traces import count_traces
from tunixlike import config as config_lib, models
from tunixlike.learner import batch as batch_lib, routing as routing_lib
from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig
from tunixlike.learner.group_advantages import AdvantageConfig
from tunixlike.learner.train_step import Learner
from tunixlike.rollout import Completion, RolloutGroup
from tunixlike.sampler import PromptRequest, RolloutDriver, SamplerConfig
from tunixlike.sampler.engine import Engine

# Groups no reward stage scored get their advantages in assemble_batch: the run's algo keys at their defaults.
UNSCORED = AdvantageConfig.from_config(config_lib.Config())

VOCAB = 128
# 32 experts, top-2: a few dozen routed positions leave some experts unused in every layer.
CFG = models.tiny_moe_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=8, num_experts=32,
                             num_experts_per_tok=2, moe_intermediate_size=16)
ROWS, SEQ = 4, 16


def _rollouts():
  engine = Engine(models.Transformer(CFG, rngs=nnx.Rngs(0)),
                  SamplerConfig(max_concurrent_decodes=4, max_prefill_length=8, max_new_tokens=6, steps_per_call=4,
                                attend_bucket=16, min_prefill_bucket=8, record_routing=True, group_size=2))
  rng = np.random.default_rng(1)
  requests = [PromptRequest(prompt_id=i, token_ids=rng.integers(1, VOCAB, size=3 + i).astype(np.int32))
              for i in range(2)]
  out = []
  RolloutDriver(engine, engine.load_params(), source=iter(requests), sink=out.append).run(max_wall_s=120)
  for g in out:
    g.rewards = np.arange(g.group_size, dtype=np.float32)
  return sorted(out, key=lambda g: g.prompt_id)


def _flip_unused_experts(model, routing_btlk):
  """Points the router of every expert no replayed position used at another expert's direction
  (x5): it wins the top-k of tokens that chose that expert, yet a replayed forward never reads its
  logit (gates are a softmax over the chosen logits), so replay must undo the flip exactly."""
  for layer in range(CFG.num_layers):
    used = routing_btlk[..., layer, :]
    used = used[used >= 0]
    unused = sorted(set(range(CFG.num_experts)) - set(used.tolist()))
    assert unused, f"layer {layer}: every expert is used; the test needs a spare one"
    kernel = model.layers[layer].mlp.gate.kernel
    top1 = routing_btlk[0, 0, layer, 0]
    kernel[...] = kernel[...].at[:, unused[0]].set(5.0 * kernel[...][:, top1])
  return model


def _learner(keep: bool, perturb_with=None):
  model = models.Transformer(CFG, rngs=nnx.Rngs(0))
  if perturb_with is not None:
    _flip_unused_experts(model, perturb_with)
  return Learner(model, LearnerConfig(algo=AlgoConfig(keep_routing=keep), optim=OptimConfig(learning_rate=1e-3),
                                      logprob_chunk_size=8))


@pytest.fixture(scope="module")
def rollouts():
  groups = _rollouts()
  batch = batch_lib.assemble_batch(groups, num_rows=ROWS, seq_buckets=(SEQ,), sampling_mask=False, routing=True,
                                   unscored=UNSCORED)
  return groups, batch


def test_sampler_routing_lands_aligned_with_tokens(rollouts):
  groups, batch = rollouts
  assert batch["routing"].shape == (ROWS, SEQ, CFG.num_layers, 2) and batch["routing"].dtype == np.int32
  # The sampler's recorded experts are the ones a full forward over prompt + completion routes to.
  model = models.Transformer(CFG, rngs=nnx.Rngs(0))
  _, aux = model(jnp.asarray(batch["tokens"]), return_aux=True)
  full = np.sort(np.asarray(aux.routing_btlk), axis=-1)
  rec = batch["routing"]
  row = 0
  for g in groups:
    p = len(g.prompt_token_ids)
    for c in g.completions:
      n = c.num_tokens
      assert c.prompt_routing.shape == (p - 1, CFG.num_layers, 2) and c.expert_routing.shape == (n, CFG.num_layers, 2)
      np.testing.assert_array_equal(rec[row, :p - 1], c.prompt_routing)
      np.testing.assert_array_equal(rec[row, p - 1:p - 1 + n], c.expert_routing)
      assert (rec[row, p - 1 + n:] == -1).all()  # the last token feeds no trained log-prob
      np.testing.assert_array_equal(np.sort(rec[row, :p - 1 + n], axis=-1), full[row, :p - 1 + n])
      row += 1
  assert (rec[row:] == -1).all()


def test_replay_restores_sampler_logprobs_when_the_router_flips(rollouts):
  _, batch = rollouts
  m = batch["loss_mask"] > 0

  def log_ratio(learner):
    logp = np.asarray(learner.token_logprobs(learner.state, learner.put_batch(batch)))[0]
    return (logp - batch["behaviour_logprobs"])[m]

  # Same weights: sampler and learner agree with or without replay (fp32 rounding only).
  assert np.abs(log_ratio(_learner(False))).max() < 1e-5
  flipped_off = _learner(False, perturb_with=batch["routing"])
  flipped_on = _learner(True, perturb_with=batch["routing"])
  off, on = log_ratio(flipped_off), log_ratio(flipped_on)
  assert np.abs(off).max() > 1e-3  # the learner ran other experts
  assert np.abs(on).max() < 1e-5  # replay: the sampler's experts, the sampler's log-probs

  # The train step reports how often the routers disagree, with and without replay.
  metrics = {}
  for name, learner in (("off", flipped_off), ("on", flipped_on), ("same", _learner(False))):
    _, mt = learner.train_step(learner.state, learner.put_batch(batch), jax.random.PRNGKey(0))
    metrics[name] = jax.device_get(mt)
  assert metrics["same"]["routing_disagreement"] == 0 and metrics["same"]["routing_token_disagreement"] == 0
  for name in ("off", "on"):
    d, tok = metrics[name]["routing_disagreement"], metrics[name]["routing_token_disagreement"]
    assert 0 < d <= tok <= 1, (name, d, tok)
  assert metrics["on"]["mismatch_kl"] < 1e-9 < metrics["off"]["mismatch_kl"]
  assert abs(metrics["on"]["is_weight"] - 1.0) < 1e-5


def test_keep_routing_compiles_once(rollouts):
  _, batch = rollouts
  learner = _learner(True)
  state = learner.state
  with count_traces() as traces:
    for _ in range(2):
      state, metrics = learner.train_step(state, learner.put_batch(batch), jax.random.PRNGKey(0))
  assert traces["_train_step"] == 1 and jax.device_get(metrics)["nonfinite"] == 0


def test_disagreement_by_hand():
  recorded = jnp.array([[[[0, 1], [2, 3]], [[1, 0], [2, 3]], [[-1, -1], [-1, -1]]]])  # [1, 3, L=2, k=2]
  logits = np.zeros((1, 3, 2, 4), np.float32)
  logits[0, 0, 0] = [3, 2, 0, 0]  # {0, 1}: agrees
  logits[0, 0, 1] = [0, 0, 1, 3]  # {3, 2}: agrees (order does not matter)
  logits[0, 1, 0] = [3, 0, 2, 0]  # {0, 2} vs recorded {1, 0}: differs
  logits[0, 1, 1] = [0, 0, 2, 3]  # agrees
  logits[0, 2] = [0, 1, 2, 3]  # unrecorded position: never counted
  frac, any_ = routing_lib.disagreement(jnp.asarray(logits), recorded)
  np.testing.assert_array_equal(frac, [[0.0, 0.5, 0.0]])
  np.testing.assert_array_equal(any_, [[0.0, 1.0, 0.0]])


def _comp(n, routing=True, layers=2):
  r = np.arange(n * layers * 2, dtype=np.int32).reshape(n, layers, 2) if routing else None
  return Completion(np.arange(1, n + 1, dtype=np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32), "eos",
                    expert_routing=r, prompt_routing=np.full((2, layers, 2), 7, np.int32) if routing else None)


def _group(*comps):
  return RolloutGroup(prompt_id="p", prompt_token_ids=np.array([1, 2, 3], np.int32), completions=list(comps),
                      rewards=np.arange(len(comps), dtype=np.float32))


def test_batch_checks_routing():
  b = batch_lib.assemble_batch([_group(_comp(2), _comp(1))], num_rows=2, seq_buckets=(8,), sampling_mask=False,
                               routing=True, unscored=UNSCORED)
  assert b["routing"].shape == (2, 8, 2, 2)
  assert (b["routing"][0, :2] == 7).all() and (b["routing"][0, 4:] == -1).all()
  np.testing.assert_array_equal(b["routing"][0, 2:4], _comp(2).expert_routing)
  assert "routing" not in batch_lib.assemble_batch([_group(_comp(2), _comp(1))], num_rows=2, seq_buckets=(8,),
                                                   sampling_mask=False, routing=False, unscored=UNSCORED)
  with pytest.raises(ValueError, match=r"completions\[1\].expert_routing is None.*record_routing"):
    batch_lib.assemble_batch([_group(_comp(2), _comp(2, routing=False))], num_rows=2, seq_buckets=(8,),
                             sampling_mask=False, routing=True, unscored=UNSCORED)
  with pytest.raises(ValueError, match=r"\[L, k\] = \(3, 2\), other completions have \(2, 2\)"):
    batch_lib.assemble_batch([_group(_comp(2), _comp(2, layers=3))], num_rows=2, seq_buckets=(8,), sampling_mask=False,
                             routing=True, unscored=UNSCORED)
  short = _comp(2)
  short.prompt_routing = short.prompt_routing[:1]
  with pytest.raises(ValueError, match=r"prompt_routing has shape \(1, 2, 2\).*expected integer \[2, L, k\]"):
    batch_lib.assemble_batch([_group(_comp(1), short)], num_rows=2, seq_buckets=(8,), sampling_mask=False, routing=True,
                             unscored=UNSCORED)
  with pytest.raises(ValueError, match="expert_routing has shape"):
    Completion(np.arange(2, dtype=np.int32), np.zeros(2, np.float32), np.zeros(2, np.int32), "eos",
               expert_routing=np.zeros((2, 2), np.int32))


def test_learner_needs_routing_when_asked(host_batch):
  learner = Learner(models.Transformer(CFG, rngs=nnx.Rngs(0)),
                    LearnerConfig(algo=AlgoConfig(keep_routing=True), optim=OptimConfig(learning_rate=1e-3),
                                  logprob_chunk_size=8))
  with pytest.raises(ValueError, match="keep_routing=True but the batch has no 'routing'"):
    learner.token_logprobs(learner.state, learner.put_batch(host_batch(8)))
  with pytest.raises(ValueError, match="algo.keep_routing"):
    AlgoConfig(keep_routing=1)


def test_dense_sampler_refuses_to_record_routing():
  dense = models.Transformer(models.tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=8),
                             rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="record_routing=True needs a mixture-of-experts model"):
    Engine(dense, SamplerConfig(max_concurrent_decodes=2, max_new_tokens=8, record_routing=True))


def test_config_keys():
  from tunixlike import config

  c = config.default_config_dict()
  c.algo.keep_routing = True
  with pytest.raises(ValueError, match="algo.keep_routing=True: needs sampler.record_routing=True"):
    config.from_config_dict(c)
  c.sampler.record_routing = True
  assert config.from_config_dict(c).algo.keep_routing
  c.rl.env = "calculator"
  with pytest.raises(ValueError, match="sampler.record_routing=True: is supported for single-turn"):
    config.from_config_dict(c)
