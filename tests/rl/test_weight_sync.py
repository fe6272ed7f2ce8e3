"""Weight sync lands every array, unchanged, on its sampler sharding (full and packed LoRA paths)."""

import jax
import numpy as np
from flax import nnx

from tunixlike import mesh as mesh_lib, models
from tunixlike.models import lora as lora_lib
from tunixlike.rl import weight_sync


def _check(synced, source, targets):
  for a, b, t in zip(jax.tree.leaves(synced), jax.tree.leaves(source), jax.tree.leaves(targets)):
    assert a.sharding == t
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_full_and_lora_sync_from_learner_to_sampler_shardings():
  meshes = mesh_lib.make_meshes(sampler_devices=4, learner_devices=4, sampler_tensor=2)
  model = models.create_sharded(models.tiny_config(), meshes.learner, mesh_lib.LEARNER_RULES, seed=0)
  lora_lib.apply_lora(model, lora_lib.LoRAConfig(rank=4), seed=0, mesh=meshes.learner,
                      rules=mesh_lib.LEARNER_RULES)
  # Make B non-zero so a wrong slice of the packed buffer could not pass unnoticed.
  adapters = jax.tree.map(lambda x: x + np.arange(x.size, dtype=x.dtype).reshape(x.shape) / x.size,
                          lora_lib.adapter_params(model))
  full = nnx.state(model)
  full_targets = models.state_shardings(full, meshes.sampler, mesh_lib.SAMPLER_RULES)
  synced, ms = weight_sync.sync(full, full_targets)
  _check(synced, full, full_targets)
  assert ms > 0
  lora_targets = models.state_shardings(adapters, meshes.sampler, mesh_lib.SAMPLER_RULES)
  assert weight_sync._packable(adapters, lora_targets)  # the packed path is the one under test
  synced, _ = weight_sync.sync(adapters, lora_targets)
  _check(synced, adapters, lora_targets)
  cast, _ = weight_sync.sync(adapters, lora_targets, dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(cast)} == {np.dtype("bfloat16")}
