"""Two policies trained in one run on the 4 + 4 CPU submeshes (real learners, engines, syncs, threads)."""

import pathlib

import jax
import numpy as np
import pytest

from relay import Relay
from tunixlike import config as config_lib
from tunixlike.multi_agent import build as ma_build
from tunixlike.rl import build

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def setup_for_test():
  cfg = config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_grpo.py", "size=tiny"))
  cfg = config_lib.replace(cfg, warm_start=dict(max_steps=0), log=dict(progress_bar=False, tensorboard=False),
                           data=dict(num_eval_examples=16), sampler=dict(max_prefill_length=48, max_concurrent_decodes=8),
                           optim=dict(learning_rate=3e-3))
  return build.build(cfg)


@pytest.mark.slow
def test_each_policy_trains_on_its_own_turns_within_its_staleness_bound_and_reaches_its_sampler():
  setup = setup_for_test()
  policies, engines = ma_build.build_policies(setup, {"a": 1, "b": 2}, batch_episodes=4, turns_per_episode={"a": 2})
  before = {p: jax.device_get(pol.full_params()) for p, pol in policies.items()}
  runtime = ma_build.build_runtime(setup, policies, engines, Relay, batch_episodes=4, max_staleness=1, max_turns=8)
  steps = []
  out = runtime.run(3, on_step=lambda step, m: steps.append(m))
  assert len(steps) == 3 and out["episodes_per_s"] > 0
  assert runtime.versions() == {"a": 3, "b": 3}
  for m in steps:
    assert m["a/staleness_max"] <= 1 and m["b/staleness_max"] <= 1
    assert m["episodes/finished_done"] == 1.0
  for name, policy in policies.items():
    learned = jax.device_get(policy.full_params())
    synced = jax.device_get(policy.synced_params)  # what the sampler decodes with now
    for x, y, z in zip(jax.tree.leaves(learned), jax.tree.leaves(synced), jax.tree.leaves(before[name])):
      np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, z) for x, z in zip(jax.tree.leaves(learned), jax.tree.leaves(before[name])))
  # The two policies started equal and trained on different turns: their weights differ now.
  a, b = (jax.tree.leaves(jax.device_get(policies[p].full_params())) for p in ("a", "b"))
  assert any(not np.array_equal(x, y) for x, y in zip(a, b))
  # Both drivers' sampler copies live on the sampler submesh.
  sampler_devices = set(setup.meshes.sampler.devices.flat)
  for policy in policies.values():
    assert all(set(x.devices()) <= sampler_devices for x in jax.tree.leaves(policy.synced_params))


@pytest.mark.slow
def test_at_staleness_zero_the_threaded_run_equals_the_synchronous_loop():
  """Sampling noise is keyed by (episode, turn), not by the order turns reach a driver, so the
  threaded runtime at staleness 0 trains on the same episodes as the loop without threads."""
  runs = []
  for threaded in (False, True):
    setup = setup_for_test()
    policies, engines = ma_build.build_policies(setup, {"a": 1, "b": 2}, batch_episodes=4, turns_per_episode={"a": 2})
    runtime = ma_build.build_runtime(setup, policies, engines, Relay, batch_episodes=4, max_staleness=0, max_turns=8)
    steps = []
    runtime.run(3, on_step=lambda step, m: steps.append(m), threaded=threaded)
    runs.append(steps)
  sync, threaded = runs
  for a, b in zip(sync, threaded):
    for key in ("a/loss", "a/reward", "b/loss", "b/reward"):
      assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key
    assert a["a/staleness_max"] == b["a/staleness_max"] == 0 == a["b/staleness_max"] == b["b/staleness_max"]
