import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jit_traces import count_traces
from learner_trees import flat_values
from tunixlike.learner import optimizer
from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig
from tunixlike.learner.train_step import Learner
from tunixlike.mesh import LEARNER_RULES
from tunixlike.models import sharding as sharding_lib


def _cfg(micro=1, **algo):
  return LearnerConfig(algo=AlgoConfig(**algo), optim=OptimConfig(learning_rate=1e-3, micro_batches=micro),
                       logprob_chunk_size=8)


@pytest.mark.gpu
@pytest.mark.slow
def test_grad_accumulation_over_4_micro_batches_equals_one_batch(tiny_model, host_batch):
  batch = host_batch(8)
  # token_mean over micro-batches with unequal token counts: a mean of micro-batch means would differ
  counts = batch["loss_mask"].reshape(4, -1).sum(-1)
  assert len(set(counts.tolist())) > 1
  one = Learner(tiny_model(), _cfg(1, aggregation="token_mean", kl_coef=0.1))
  four = Learner(tiny_model(), _cfg(4, aggregation="token_mean", kl_coef=0.1))
  loss1, g1 = one.loss_and_grads(one.state, one.put_batch(batch))
  loss4, g4 = four.loss_and_grads(four.state, four.put_batch(batch))
  np.testing.assert_allclose(loss4, loss1, rtol=1e-5)
  f1, f4 = flat_values(g1), flat_values(g4)
  assert f1.keys() == f4.keys()
  for k in f1:
    np.testing.assert_allclose(f4[k], f1[k], rtol=1e-4, atol=1e-7, err_msg=k)


@pytest.mark.slow
def test_sharded_step_equals_unsharded(tiny_model, host_batch, mesh4):
  batch = host_batch(8)
  plain = Learner(tiny_model(), _cfg(2))
  sharded_model = tiny_model()
  state = nnx.state(sharded_model)
  nnx.update(sharded_model, jax.device_put(state, sharding_lib.state_shardings(state, mesh4, LEARNER_RULES)))
  sharded = Learner(sharded_model, _cfg(2), mesh=mesh4, rules=LEARNER_RULES)
  emb = sharded.state.params["embed_tokens"]["embedding"].get_value()
  assert len(emb.sharding.device_set) == 4 and not emb.sharding.is_fully_replicated
  # optimizer moments live with their parameters
  mu = [x for x in jax.tree.leaves(sharded.state.opt_state) if x.shape == emb.shape]
  assert mu and all(x.sharding.is_equivalent_to(emb.sharding, 2) for x in mu)
  db = sharded.put_batch(batch)
  assert db["tokens"].sharding.spec[1] == "fsdp"
  s1, m1 = plain.train_step(plain.state, plain.put_batch(batch), jax.random.key(0))
  s2, m2 = sharded.train_step(sharded.state, db, jax.random.key(0))
  for k in ("loss", "grad_norm", "entropy", "is_weight"):
    np.testing.assert_allclose(m2[k], m1[k], rtol=2e-5, err_msg=k)
  p1, p2 = flat_values(s1.params), flat_values(s2.params)
  for k in p1:
    np.testing.assert_allclose(p2[k], p1[k], rtol=1e-4, atol=2e-6, err_msg=k)


@pytest.mark.slow
def test_no_recompilation_after_warmup(tiny_model, host_batch):
  compiles = []
  learner = Learner(tiny_model(), _cfg(2))
  state = learner.state
  with count_traces() as traces:
    state, _ = learner.train_step(state, learner.put_batch(host_batch(8, seed=0)), jax.random.key(0))
    listener = lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
      for seed in (1, 2, 3):
        state, metrics = learner.train_step(state, learner.put_batch(host_batch(8, seed=seed)), jax.random.fold_in(
            jax.random.key(0), seed))
      jax.block_until_ready(metrics)
    finally:
      jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == []
  assert traces["_train_step"] == 1
  assert int(state.step) == 4


@pytest.mark.gpu
@pytest.mark.slow
def test_every_weight_gets_a_gradient_logprobs_are_exact_and_training_follows_advantage(tiny_model, host_batch):
  batch = host_batch(8)
  model = tiny_model()
  full_logits = model(jnp.asarray(batch["tokens"]))
  learner = Learner(model, _cfg(1, is_mode="none"))
  db = learner.put_batch(batch)
  _, grads = learner.loss_and_grads(learner.state, db)
  for k, g in flat_values(grads).items():
    assert np.abs(g).max() > 0, f"no gradient for {k}"
  # the chunked per-token logprobs equal log-softmax of the full logits at the next token
  logp0 = np.asarray(learner.token_logprobs(learner.state, db)).reshape(8, -1)
  want = np.take_along_axis(np.asarray(jax.nn.log_softmax(full_logits, -1))[:, :-1], batch["tokens"][:, 1:, None],
                            -1)[..., 0]
  np.testing.assert_allclose(logp0[:, 1:], want, rtol=1e-5, atol=1e-5)
  # a few steps raise the log-likelihood of positive-advantage completions relative to negative ones
  state = learner.state
  for _ in range(5):
    state, metrics = learner.train_step(state, db, jax.random.key(0))
  logp1 = np.asarray(learner.token_logprobs(state, db)).reshape(8, -1)
  mask = batch["loss_mask"]
  delta = ((logp1 - logp0) * mask).sum(-1)
  adv = batch["advantages"]
  assert delta[adv > 0].mean() > 0 > delta[adv < 0].mean()
  assert float(metrics["nonfinite"]) == 0.0


@pytest.mark.slow
def test_proximal_logprobs_make_the_ratio_bite(tiny_model, host_batch):
  # With the proximal policy given and far below the current one (ratio e > 1 + eps), exactly the
  # tokens of positive-advantage rows are clipped.
  learner = Learner(tiny_model(), _cfg(1, is_mode="none"))
  batch = host_batch(8)
  db = learner.put_batch(batch)
  db["proximal_logprobs"] = learner.token_logprobs(learner.state, db) - 1.0
  _, metrics = learner.train_step(learner.state, db, jax.random.key(0))
  mask = batch["loss_mask"]
  want = (mask * (batch["advantages"] > 0)[:, None]).sum() / mask.sum()
  assert 0.0 < want < 1.0
  assert float(metrics["clip_frac"]) == pytest.approx(want, abs=1e-6)


def test_bad_batches_name_the_key(tiny_model, host_batch, mesh4):
  learner = Learner(tiny_model(), _cfg(3))
  with pytest.raises(ValueError, match="8 rows does not divide into optim.micro_batches=3"):
    learner.put_batch(host_batch(8))
  sharded = Learner(tiny_model(), _cfg(4), mesh=mesh4, rules=LEARNER_RULES)
  assert sharded.put_batch(host_batch(8))["tokens"].shape == (4, 2, 16)  # 2 rows per micro-batch: fine
  with pytest.raises(ValueError, match="micro-batch of 3 rows.*2 devices of learner mesh axis 'fsdp'"):
    sharded.put_batch(host_batch(12))
  b = host_batch(8)
  del b["advantages"]
  with pytest.raises(ValueError, match="missing 'advantages'"):
    learner.put_batch(b)


def test_config_errors_name_the_key():
  with pytest.raises(ValueError, match="algo.loss='ppo'"):
    AlgoConfig(loss="ppo")
  with pytest.raises(ValueError, match="algo.advantage='gae'"):
    AlgoConfig(advantage="gae")
  with pytest.raises(ValueError, match="algo.kl_estimator='k5'"):
    AlgoConfig(kl_estimator="k5")
  with pytest.raises(ValueError, match="algo.norm_length"):
    AlgoConfig(aggregation="seq_mean_token_sum_norm")
  with pytest.raises(ValueError, match="algo.is_mode='tis'"):
    AlgoConfig(decoupled=False)
  with pytest.raises(ValueError, match="optim.micro_batches=0"):
    OptimConfig(micro_batches=0)
  with pytest.raises(ValueError, match="rl.num_steps"):  # a run value: checked once the schedule is built
    optimizer.make_schedule(OptimConfig(learning_rate=1e-3, schedule="cosine"))
  assert AlgoConfig(loss="dapo").eps_high_value == 0.28
  assert AlgoConfig(loss="dapo", eps_high=0.3).eps_high_value == 0.3


@pytest.mark.gpu
@pytest.mark.slow
def test_bf16_compute_with_fp32_master_weights_and_remat(tiny_model, host_batch):
  learner = Learner(tiny_model(dtype="bfloat16", remat=True), _cfg(2))
  state, metrics = learner.train_step(learner.state, learner.put_batch(host_batch(8)), jax.random.key(0))
  assert float(metrics["nonfinite"]) == 0.0 and np.isfinite(float(metrics["loss"]))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.opt_state) if x.ndim)


def test_step_with_output_returns_the_step_and_fn_of_its_new_state(tiny_model, host_batch):
  """The fused step (weight sync's packing) is a second compiled step whose extra output is returned,
  not left in an attribute: its state and metrics are `train_step`'s, its third output fn(new state)."""
  batch = host_batch(8)
  plain, fused = Learner(tiny_model(), _cfg(1)), Learner(tiny_model(), _cfg(1))
  total = lambda state: sum(jnp.sum(x) for x in jax.tree.leaves(state.params))
  step = fused.step_with_output(total, None)
  s1, m1 = plain.train_step(plain.state, plain.put_batch(batch), jax.random.key(0))
  s2, m2, out = step(fused.state, fused.put_batch(batch), jax.random.key(0))
  np.testing.assert_allclose(float(out), float(total(s2)), rtol=1e-6)
  np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not hasattr(fused, "fused_output")
  s3, m3 = fused.train_step(s2, fused.put_batch(batch), jax.random.key(0))  # the plain step is unchanged
  assert set(m3) == set(m1)


def test_several_updates_per_batch_are_k_clipped_updates_in_one_compiled_step(tiny_model, host_batch):
  # optim.updates_per_batch=2 equals two K=1 steps that are given the batch-start logprobs as the
  # proximal ones: the second update's ratio moves, so the clip binds (clip_frac > 0); one RL step.
  cfg = lambda k: LearnerConfig(algo=AlgoConfig(eps_low=0.02, eps_high=0.02),
                                optim=OptimConfig(learning_rate=3e-2, updates_per_batch=k), logprob_chunk_size=8)
  batch = host_batch(8)
  twice, once = Learner(tiny_model(), cfg(2)), Learner(tiny_model(), cfg(1))
  with count_traces() as traces:
    state2, m2 = twice.train_step(twice.state, twice.put_batch(batch), jax.random.key(0))
    p2 = flat_values(state2.params)
    state2, _ = twice.train_step(state2, twice.put_batch(host_batch(8, seed=1)), jax.random.key(1))
  assert traces["_train_step"] == 1 and int(state2.step) == 2  # one compile; a batch's K updates are one step
  assert float(m2["updates_taken"]) == 2 and float(m2["nonfinite"]) == 0
  manual = once.put_batch(batch)
  manual["proximal_logprobs"] = once.token_logprobs(once.state, manual)
  state1, first = once.train_step(once.state, manual, jax.random.key(0))
  p1 = flat_values(state1.params)
  assert float(first["clip_frac"]) == 0.0  # the first update is the K = 1 step: ratio 1
  state1, second = once.train_step(state1, manual, jax.random.key(0))
  assert float(second["clip_frac"]) > 0.05
  for k in ("clip_frac", "loss", "grad_norm"):  # the step reports the mean over its updates
    np.testing.assert_allclose(float(m2[k]), (float(first[k]) + float(second[k])) / 2, rtol=1e-4, err_msg=k)
  manual2 = flat_values(state1.params)
  assert max(np.abs(p2[k] - p1[k]).max() for k in p1) > 1e-3  # not the one-update step ...
  for k in p2:  # ... but the two updates
    np.testing.assert_allclose(p2[k], manual2[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_several_updates_per_batch_resume_exactly(tiny_model, host_batch, tmp_path):
  # A checkpoint between two K=2 steps holds what the next step needs (optax's count of 2 updates per
  # step, read at count // K by the warm-up + cosine schedule): the resumed step equals the straight one.
  from tunixlike import checkpoint as ckpt_lib
  cfg = LearnerConfig(optim=OptimConfig(learning_rate=1e-2, updates_per_batch=2, schedule="cosine", warmup_steps=1,
                                        total_steps=3), logprob_chunk_size=8)
  straight = Learner(tiny_model(), cfg)
  batches = [straight.put_batch(host_batch(8, seed=s)) for s in (0, 1)]
  state, _ = straight.train_step(straight.state, batches[0], jax.random.key(0))
  ck = ckpt_lib.Checkpointer(str(tmp_path / "ck"), ckpt_lib.CheckpointSchedule(keep=1, every_steps=0, every_seconds=0))
  ck.save(1, state, {"version": 1}, force=True)
  ck.wait()
  state, last = straight.train_step(state, batches[1], jax.random.key(1))
  resumed = Learner(tiny_model(seed=1), cfg)  # other initial weights: the checkpoint replaces them
  restored, _ = ck.restore(1, abstract_state=ckpt_lib.abstract_like(resumed.state))
  ck.close()
  again, again_metrics = resumed.train_step(restored, resumed.put_batch(host_batch(8, seed=1)), jax.random.key(1))
  assert int(again.step) == 2 and float(last["learning_rate"]) == float(again_metrics["learning_rate"]) > 0
  a, b = flat_values(state.params), flat_values(again.params)
  for k in a:
    np.testing.assert_array_equal(b[k], a[k], err_msg=k)
