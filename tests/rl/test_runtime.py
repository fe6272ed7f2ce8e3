"""The async runtime end to end on the 4 + 4 CPU submeshes (real engine, learner, threads, rewards)."""

import json
import os
import pathlib

import jax
import numpy as np
import pytest

from jit_traces import count_traces, engine_counts
from tunixlike import config as config_lib, rewards, trace
from tunixlike.rl import build
from tunixlike.rl.collapse import stop_on_collapse
from tunixlike.rl.prompts import PromptStream
from tunixlike.sampler import params as params_lib

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def tiny_config(**rl):
  cfg = config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_grpo.py", "size=tiny"))
  return config_lib.replace(cfg, data=dict(digits=2, num_eval_examples=16),
                            warm_start=dict(max_steps=0), log=dict(progress_bar=False, tensorboard=False),
                            sampler=dict(max_concurrent_decodes=16), rl=dict(num_steps=3, prompts_per_step=4, **rl))


def with_layout(cfg, layout):
  """`cfg` in mesh.layout `layout`; colocated, the learner has 8 devices, more than the 4 shared-prompt
  rows of 4 prompts, so it trains a row per completion (both row layouts run through the runtime)."""
  return config_lib.replace(cfg, mesh=dict(layout=layout), optim=dict(share_prompts=layout == "split"))


def run_steps(cfg, threaded, before=lambda setup, rl: None, reward=None, workdir=None):
  setup = build.build(cfg, None if workdir is None else os.path.join(workdir, "trace.json"))
  rl = build.build_rl(setup, reward=reward)
  before(setup, rl)
  records = []
  runtime = build.make_runtime(setup, rl, PromptStream(iter(setup.train_pipe)))
  runtime.hooks.add(lambda info: records.append((info.step, info.metrics)))
  runtime.run(threaded=threaded)
  setup.tracer.close()
  return records, setup, rl


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["split", "colocated"])
def test_async_at_staleness_zero_equals_the_synchronous_loop(layout):
  cfg = with_layout(tiny_config(max_staleness=0), layout)
  sync, *_ = run_steps(cfg, threaded=False)
  async_, *_ = run_steps(cfg, threaded=True)
  assert [s for s, _ in sync] == [s for s, _ in async_] == [0, 1, 2]
  for (_, a), (_, b) in zip(sync, async_):
    for key in ("loss", "reward/mean", "reward/std", "grad_norm", "entropy", "num_tokens"):
      assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key
    assert a["staleness/max"] == b["staleness/max"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["split", "colocated"])
def test_staleness_bound_holds_and_weights_reach_the_sampler(tmp_path, layout):
  cfg = with_layout(config_lib.replace(tiny_config(max_staleness=1), log=dict(trace=True)), layout)
  initial = {}

  def before(setup, rl):
    initial["w"] = jax.device_get(rl.policy.full_params())

  # A random model never adds correctly; reward stopping (a real registered reward) so that
  # groups have variance and the weights move.
  records, setup, rl = run_steps(cfg, threaded=True, before=before,
                                 reward=rewards.CombinedReward(["stopped"], timeout_s=cfg.rl.reward_timeout_s),
                                 workdir=str(tmp_path))
  assert all(m["staleness/max"] <= 1 for _, m in records)
  # The trace has a span of every kind, each on the track of the thread that ran it.
  events = json.load(open(tmp_path / "trace.json"))["traceEvents"]
  spans = {(e["cat"], e["name"]) for e in events if e["ph"] == "X"}
  assert {("sampler", "generate"), ("sampler", "prefill"), ("learner", "train_step"), ("sync", "weight_sync"),
          ("reward", "reward")} <= spans
  busy = trace.busy_fractions(str(tmp_path / "trace.json"))
  assert len(busy) >= 3 and all(0 < f <= 1 for f in busy.values())
  assert all(m["sync/ms"] > 0 for _, m in records)
  assert rl.policy.version == 3
  # The synced copy equals the learner's latest weights, lives on the sampler devices, and differs
  # from the initial weights (a sync that silently sent stale weights would not).
  rl.policy.sync_weights()
  # A small model travels as one buffer packed by the train step, kept packed on the sampler.
  assert isinstance(rl.policy.weight_sync.last.params, params_lib.Packed)
  synced = rl.policy.synced_params
  sampler_devices = set(setup.meshes.sampler.devices.flat)
  assert setup.meshes.colocated == (layout == "colocated")
  assert len(sampler_devices) == (8 if layout == "colocated" else 4)
  changed = 0
  for a, b, c in zip(jax.tree.leaves(synced), jax.tree.leaves(rl.policy.full_params()),
                     jax.tree.leaves(initial["w"])):
    assert set(a.devices()) <= sampler_devices
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    changed += not np.array_equal(np.asarray(a), c)
  assert changed > 0


@pytest.mark.slow
def test_an_error_in_the_reward_thread_surfaces_with_its_original_type():
  def before(setup, rl):
    rl.scorer.reward = None  # scoring now raises AttributeError ('NoneType' ... 'score') in the reward pool

  with pytest.raises(AttributeError, match="score"):
    run_steps(tiny_config(max_staleness=1), threaded=True, before=before)


@pytest.mark.slow
def test_multi_turn_calculator_episodes_train_through_the_runtime():
  cfg = tiny_config(max_staleness=1, env="calculator", env_max_turns=2)
  cfg = config_lib.replace(cfg, rl=dict(num_steps=2), data=dict(max_prompt_length=16),
                           sampler=dict(max_prefill_length=512, max_concurrent_decodes=16))
  records, *_ = run_steps(cfg, threaded=True)
  assert [s for s, _ in records] == [0, 1]
  assert all(np.isfinite(m["loss"]) and 0.0 <= m["reward/mean"] <= 1.0 for _, m in records)


@pytest.mark.slow
def test_keep_sampling_mask_makes_the_is_ratio_one_at_staleness_zero():
  cfg = tiny_config(max_staleness=0)
  cfg = config_lib.replace(cfg, sampler=dict(top_p=0.8, record_sampling_mask=True),
                           algo=dict(keep_sampling_mask=True), rl=dict(num_steps=2),
                           optim=dict(share_prompts=False))  # the masks need a row per completion
  records, *_ = run_steps(cfg, threaded=True)
  for _, m in records:
    assert m["mismatch_kl"] < 1e-6 and m["is_weight"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
def test_lora_run_with_sampler_warmup_compiles_nothing_and_syncs_prepacked_adapters():
  """LoRA: every sync after the first sends the adapters packed right behind the train step; with
  sampler.warmup the engine's programs (plain params and packed adapters) are all compiled before."""
  cfg = config_lib.replace(tiny_config(max_staleness=1), lora=dict(rank=4), sampler=dict(max_concurrent_decodes=16,
                                                                                          warmup=True))
  setup = build.build(cfg)
  rl = build.build_rl(setup)
  batches = []
  runtime = build.make_runtime(setup, rl, PromptStream(iter(setup.train_pipe)))
  runtime.hooks.add(lambda info: batches.append(info.trained))
  with count_traces() as traces:  # make_runtime compiled every decode program (sampler.warmup)
    runtime.run(threaded=True)
  assert not any(engine_counts(traces).values()) and rl.policy.version == 3, traces
  policy = rl.policy
  policy.train(batches[-1])  # one more step: its adapters are packed before the host waits for it
  packed_for, packed = policy.weight_sync._pending
  adapters = policy.state.params
  assert policy.weight_sync.mode == "lora" and packed_for is policy.state and isinstance(packed, params_lib.Packed)
  synced = policy.sync_weights().params
  assert policy.weight_sync._pending is None and isinstance(synced, params_lib.WithAdapters)
  assert set(synced.adapters.flat.devices()) == set(setup.meshes.sampler.devices.flat)
  for a, b in zip(jax.tree.leaves(synced.adapters.unpack()), jax.tree.leaves(adapters)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(synced.adapters.unpack()))


@pytest.mark.slow
def test_non_finite_steps_stop_the_run_at_any_staleness():
  """Skipped steps give their admissions back, so the guard counts to rl.max_nonfinite_steps instead of
  the sampler running out of admissions and the learner timing out on an empty queue. (Rewards cannot
  make a step non-finite: they are saturated and clipped. A weight that is NaN does, at every step.)"""
  from flax import nnx
  from tunixlike.rl.runtime import NonFiniteLoss
  cfg = config_lib.replace(tiny_config(max_staleness=1, max_nonfinite_steps=3, wait_timeout_s=60.0),
                           rl=dict(num_steps=6))
  records = []
  setup = build.build(cfg)
  params = nnx.state(setup.model, nnx.Param)
  leaf = jax.tree.leaves(params)[0]
  nnx.update(setup.model, jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(np.nan) if x is leaf else x, params))
  rl = build.build_rl(setup)
  runtime = build.make_runtime(setup, rl, PromptStream(iter(setup.train_pipe)))
  runtime.hooks.add(lambda info: records.append((info.step, info.metrics)))
  with pytest.raises(NonFiniteLoss, match="3 in a row"):
    runtime.run(threaded=True)
  assert rl.policy.version == 0 and [m["skipped"] for _, m in records] == [1.0, 1.0]


@pytest.mark.slow
def test_a_collapsed_policy_is_flagged_and_stops_the_run():
  """A learning rate far too high makes the policy uniform after one step: flagged at that step. (A
  short warm start first: a fresh model is near uniform already, which is not a collapse.)"""
  from tunixlike.rl.collapse import CollapseConfig, CollapseDetector, PolicyCollapse
  cfg = config_lib.replace(tiny_config(max_staleness=1), rl=dict(num_steps=4), optim=dict(learning_rate=1e6),
                           warm_start=dict(max_steps=20, eval_every=20))
  setup = build.build(cfg)
  build.warm_start(setup)
  # Rewards with variance: weights move.
  rl = build.build_rl(setup, reward=rewards.CombinedReward(["stopped"], timeout_s=cfg.rl.reward_timeout_s))
  records = []
  vocab = rl.policy.model().cfg.vocab_size
  runtime = build.make_runtime(setup, rl, PromptStream(iter(setup.train_pipe)),
                               collapse=CollapseDetector(CollapseConfig.from_config(cfg, vocab_size=vocab)))
  runtime.hooks.add(lambda info: records.append((info.step, info.metrics)))
  runtime.hooks.add(stop_on_collapse)
  with pytest.raises(PolicyCollapse, match=r"policy collapse at step 1: token entropy .* ln V"):
    runtime.run(threaded=True)
  assert [(s, m["collapse"]) for s, m in records] == [(0, 0.0), (1, 1.0)]


@rewards.registry.register("raising_for_tests")
def _raising(prompts, completions, **columns):
  raise RuntimeError("verifier down")


@pytest.mark.slow
def test_eval_counts_the_completions_its_verifier_failed_on():
  """A verifier that always raises is not a policy at 0% accuracy: the eval record says so."""
  setup = build.build(tiny_config())
  rl = build.build_rl(setup, correctness=rewards.CombinedReward(["raising_for_tests"],
                                                                 timeout_s=setup.cfg.rl.reward_timeout_s))
  out = build.evaluate(setup, rl)
  assert out["eval/accuracy"] == 0.0 and out["eval/reward_failures"] == out["eval/num_prompts"] == 16


@pytest.mark.slow
def test_full_sync_sends_the_train_steps_own_pack_and_warmup_covers_it():
  """A small model: every sync after a train step sends the buffer that step packed (no packing
  program of its own); the sampler keeps it packed, and sampler.warmup compiled its programs."""
  cfg = config_lib.replace(tiny_config(max_staleness=1), sampler=dict(max_concurrent_decodes=16, warmup=True))
  setup = build.build(cfg)
  rl = build.build_rl(setup)
  runtime = build.make_runtime(setup, rl, PromptStream(iter(setup.train_pipe)))  # the first sync packs by itself
  packed_apart = []
  assert rl.policy.weight_sync.mode == "packed"
  pack_now = rl.policy.weight_sync._pack_now
  rl.policy.weight_sync._pack_now = lambda state: (packed_apart.append(1), pack_now(state))[1]  # counts, then packs
  with count_traces() as traces:
    runtime.run(threaded=True)
  assert not any(engine_counts(traces).values()) and rl.policy.version == 3, traces
  assert not packed_apart and isinstance(rl.policy.weight_sync.last.params, params_lib.Packed)
  packed = rl.policy.synced_params
  for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(rl.policy.full_params())):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_full_sync_unpacked_for_a_sampler_that_does_not_replicate_arrives_in_its_shardings():
  """The branch a tensor-parallel sampler takes (the tiny task's 83-symbol vocabulary does not split
  over a tensor axis, so it is chosen here by hand): one program splits the pack into the engine's shardings."""
  setup = build.build(tiny_config(max_staleness=1))
  rl = build.build_rl(setup)
  rl.policy.weight_sync.keep_packed = False
  build.make_runtime(setup, rl, PromptStream(iter(setup.train_pipe)), num_steps=1).run(threaded=True)
  synced = rl.policy.sync_weights().params
  assert not isinstance(synced, params_lib.Packed)
  for a, b, want in zip(jax.tree.leaves(synced), jax.tree.leaves(rl.policy.full_params()),
                        jax.tree.leaves(rl.engine.param_shardings)):
    assert a.sharding == want
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_step_packed_sync_applies_the_sync_dtype():
  setup = build.build(config_lib.replace(tiny_config(max_staleness=1), rl=dict(sync_dtype="bfloat16")))
  rl = build.build_rl(setup)
  build.make_runtime(setup, rl, PromptStream(iter(setup.train_pipe)), num_steps=1).run(threaded=True)
  rl.policy.sync_weights()
  assert isinstance(rl.policy.weight_sync.last.params, params_lib.Packed)
  for a, b in zip(jax.tree.leaves(rl.policy.synced_params), jax.tree.leaves(rl.policy.full_params())):
    assert a.dtype == (jax.numpy.bfloat16 if jax.numpy.issubdtype(b.dtype, jax.numpy.floating) else b.dtype)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(a.dtype)))
