"""Weight sync lands every array, unchanged, on its sampler sharding (full and packed LoRA paths);
adapters kept packed on the sampler decode exactly like unpacked ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunixlike import config as config_lib
from tunixlike import mesh as mesh_lib, models
from tunixlike.models import lora as lora_lib
from tunixlike.rl import weight_sync
from tunixlike.sampler import Engine, SamplerConfig, params as params_lib

RUN = config_lib.Config()  # the lora section at its defaults


def _check(synced, source, targets):
  for a, b, t in zip(jax.tree.leaves(synced), jax.tree.leaves(source), jax.tree.leaves(targets)):
    assert a.sharding == t
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _model_with_adapters(sampler_tensor: int):
  """(meshes, a tiny LoRA model on the learner mesh, its adapters with every entry distinct)."""
  meshes = mesh_lib.make_meshes(4, 4, sampler_tensor, 1, layout="split")
  model = models.create_sharded(models.tiny_config(), meshes.learner, mesh_lib.LEARNER_RULES, seed=0)
  lora_lib.apply_lora(model, lora_lib.LoRAConfig.from_config(RUN, rank=4), seed=0, mesh=meshes.learner,
                      rules=mesh_lib.LEARNER_RULES)
  # Make B non-zero so a wrong slice of the packed buffer could not pass unnoticed.
  adapters = jax.tree.map(lambda x: x + np.arange(x.size, dtype=x.dtype).reshape(x.shape) / x.size,
                          lora_lib.adapter_params(model))
  return meshes, model, adapters


def test_full_and_lora_sync_from_learner_to_sampler_shardings():
  meshes, model, adapters = _model_with_adapters(sampler_tensor=2)
  full = nnx.state(model)
  full_targets = models.state_shardings(full, meshes.sampler, mesh_lib.SAMPLER_RULES)
  synced, ms = weight_sync.sync(full, full_targets)
  _check(synced, full, full_targets)
  assert ms > 0
  lora_targets = models.state_shardings(adapters, meshes.sampler, mesh_lib.SAMPLER_RULES)
  # The packed path is the one under test.
  assert weight_sync._packable(jax.tree.leaves(adapters), jax.tree.leaves(lora_targets))
  synced, _ = weight_sync.sync(adapters, lora_targets)
  _check(synced, adapters, lora_targets)
  cast, _ = weight_sync.sync(adapters, lora_targets, dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(cast)} == {np.dtype("bfloat16")}
  # Sharded sources (not how the learner keeps adapters) move array by array, not packed.
  fsdp = jax.sharding.NamedSharding(meshes.learner, jax.sharding.PartitionSpec("fsdp"))
  sharded = jax.tree.map(lambda x: jax.device_put(x, fsdp), adapters)
  assert not weight_sync._packable(jax.tree.leaves(sharded), jax.tree.leaves(lora_targets))
  assert weight_sync.pack(sharded, lora_targets) is None
  synced, _ = weight_sync.sync(sharded, lora_targets)
  _check(synced, adapters, lora_targets)


def _greedy(engine, params, prompts):
  state = engine.init_decode_state()
  for i, p in enumerate(prompts):
    state = engine.insert(engine.prefill(params, p), state, i)
  toks, lps = [], []
  for _ in range(3):
    state, res = engine.generate(params, state)
    toks.append(np.asarray(res.tokens_ks))
    lps.append(np.asarray(res.logprobs_ks))
  return np.concatenate(toks), np.concatenate(lps)


def test_lora_adapters_kept_packed_decode_like_unpacked():
  meshes = mesh_lib.make_meshes(4, 4, 2, 1, layout="split")
  model = models.create_sharded(models.tiny_config(), meshes.learner, mesh_lib.LEARNER_RULES, seed=0)
  lora_lib.apply_lora(model, lora_lib.LoRAConfig.from_config(RUN, rank=4), seed=0, mesh=meshes.learner,
                      rules=mesh_lib.LEARNER_RULES)
  adapters = lora_lib.adapter_params(model)
  # Replicated on the learner, so packing for sync needs no gather.
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(adapters))
  adapters = jax.tree.map(lambda x: x + jax.numpy.asarray(np.random.default_rng(x.size).normal(size=x.shape) * 0.3,
                                                          x.dtype), adapters)  # B non-zero: the adapters matter
  engine = Engine(model, SamplerConfig(max_prefill_length=8, max_new_tokens=9, max_concurrent_decodes=4,
                                       steps_per_call=3, temperature=0.0), meshes.sampler)
  base = engine.load_params()
  shardings = weight_sync.subtree_like(engine.param_shardings, adapters)
  packed, _ = weight_sync.sync(adapters, shardings, keep_packed=True)
  assert isinstance(packed, params_lib.Packed) and packed.flat.sharding.mesh == meshes.sampler
  jax.tree.map(np.testing.assert_array_equal, packed.unpack(), adapters)
  with_packed = weight_sync.replace_leaves(base, packed)
  assert isinstance(with_packed, params_lib.WithAdapters)
  unpacked, _ = weight_sync.sync(adapters, shardings)
  plain = weight_sync.replace_leaves(base, unpacked)
  prompts = [np.array([1, 2, 3, 4, 5]), np.array([7, 8, 9]), np.array([3, 1, 4, 1, 5, 9]), np.array([2, 7])]
  toks, lps = _greedy(engine, with_packed, prompts)
  want_toks, want_lps = _greedy(engine, plain, prompts)
  base_toks, _ = _greedy(engine, base, prompts)
  np.testing.assert_array_equal(toks, want_toks)
  np.testing.assert_allclose(lps, want_lps, atol=1e-6)
  assert (toks != base_toks).any()  # the synced adapters changed what the sampler decodes
  # A second packed sync replaces the first (its base is kept, not nested).
  again = weight_sync.replace_leaves(with_packed, packed)
  assert again.base is base


def test_pack_then_sync_equals_sync():
  """`pack` (queued behind the train step by the learner) and then `sync` lands what `sync` alone does."""
  meshes, _, adapters = _model_with_adapters(sampler_tensor=1)
  targets = models.state_shardings(adapters, meshes.sampler, mesh_lib.SAMPLER_RULES)
  packed = weight_sync.pack(adapters, targets, dtype="bfloat16")
  assert isinstance(packed, params_lib.Packed) and set(packed.flat.devices()) <= set(meshes.learner.devices.flat)
  sent, ms = weight_sync.sync(packed, targets, keep_packed=True)
  assert ms > 0 and sent.flat.sharding.mesh == meshes.sampler and sent.flat.dtype == np.dtype("bfloat16")
  direct, _ = weight_sync.sync(adapters, targets, dtype="bfloat16", keep_packed=True)
  np.testing.assert_array_equal(np.asarray(sent.flat), np.asarray(direct.flat))
  _check(weight_sync.sync(weight_sync.pack(adapters, targets), targets)[0], adapters, targets)  # unpacked there
  few = jax.tree.leaves(adapters)[:2]  # too few arrays to be worth packing: sync moves them as they are
  assert weight_sync.pack(few, jax.tree.leaves(targets)[:2]) is None


def _donate_all(tree):
  """The learner's next step: every source buffer donated at once, as the runtime does."""
  return jax.block_until_ready(jax.jit(lambda t: jax.tree.map(lambda x: x * 2, t), donate_argnums=0)(tree))


@pytest.mark.gpu
def test_colocated_sync_reshards_in_new_buffers_and_a_queued_copy_survives_donation():
  n = len(jax.devices())  # every device, one included (a single GPU: mesh.sampler_devices=1, learner_devices=0)
  meshes = mesh_lib.make_meshes(n, 0, 1, 1, layout="colocated")
  model = models.create_sharded(models.tiny_config(), meshes.learner, mesh_lib.LEARNER_RULES, seed=0)
  full = nnx.state(model)
  # Read from copies: on one CPU device a fetched array can share its buffer with numpy, which
  # would (rightly) stop JAX from donating it below.
  expected = jax.device_get(jax.tree.map(jnp.copy, full))
  targets = models.state_shardings(full, meshes.sampler, mesh_lib.SAMPLER_RULES)
  assert weight_sync._on_same_devices(jax.tree.leaves(full), jax.tree.leaves(targets))
  synced, _ = weight_sync.sync(full, targets, block=False)  # not waited for, then the source is donated
  _donate_all(full)
  assert any(x.is_deleted() for x in jax.tree.leaves(full))  # its buffers went to the step
  _check(synced, expected, targets)


def test_split_sync_queued_copy_survives_donation():
  """The split layout's queued copy is the same: donating the source does not change what arrives."""
  split = mesh_lib.make_meshes(4, 4, 1, 1, layout="split")
  model = models.create_sharded(models.tiny_config(), split.learner, mesh_lib.LEARNER_RULES, seed=1)
  full = nnx.state(model)
  expected = jax.device_get(full)
  targets = models.state_shardings(full, split.sampler, mesh_lib.SAMPLER_RULES)
  synced, _ = weight_sync.sync(full, targets, block=False)
  _donate_all(full)
  _check(synced, expected, targets)


def _learner(meshes, lora_rank: int = 0):
  from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig
  from tunixlike.learner.train_step import Learner
  model = models.create_sharded(models.tiny_config(), meshes.learner, mesh_lib.LEARNER_RULES, seed=0)
  if lora_rank:
    lora_lib.apply_lora(model, lora_lib.LoRAConfig.from_config(RUN, rank=lora_rank), seed=0, mesh=meshes.learner,
                        rules=mesh_lib.LEARNER_RULES)
  cfg = LearnerConfig(algo=AlgoConfig(), optim=OptimConfig(learning_rate=1e-3), logprob_chunk_size=8)
  return Learner(model, cfg, meshes.learner, mesh_lib.LEARNER_RULES), model


def _moved(state):
  """A state as a train step leaves it: every trained array changed (new buffers)."""
  return state.replace(params=jax.tree.map(lambda x: x * 1.5 + 0.25, state.params))


def _check_sampler_has(ws, state, targets, dtype=None):
  want = jax.tree.leaves(ws.sampler_params(state))
  for a, b, t in zip(jax.tree.leaves(ws.synced_params), want, jax.tree.leaves(targets)):
    assert a.sharding.device_set == t.device_set
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(dtype or b.dtype)))


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_weight_sync_object_modes_deliver_the_state_with_its_version(dtype):
  """`for_learner` picks the mode; each mode's sync lands the sampler's params of the state it is
  given, with that version, and a packed result computed for an older state is never sent."""
  meshes = mesh_lib.make_meshes(4, 4, 1, 1, layout="split")
  learner, model = _learner(meshes)
  targets = models.state_shardings(nnx.state(model), meshes.sampler, mesh_lib.SAMPLER_RULES)
  ws = weight_sync.for_learner(learner, targets, dtype=dtype)
  assert ws.mode == "packed" and isinstance(ws.sampler_params, weight_sync.StateLayout)
  state = learner.state
  first = ws.sync(state, 0)  # before any step: packed by a program of its own
  assert first.version == 0 and isinstance(first.params, params_lib.Packed) and first.ms > 0
  _check_sampler_has(ws, state, targets, dtype)
  moved = _moved(state)
  ws.after_step(moved, jax.jit(ws.step_output, out_shardings=ws.step_output_sharding)(moved))  # as the fused step
  second = ws.sync(moved, 1)
  assert second.version == 1 and ws.last is second
  _check_sampler_has(ws, moved, targets, dtype)
  ws.after_step(moved, jax.jit(ws.step_output, out_shardings=ws.step_output_sharding)(moved))
  ws.sync(state, 0)  # e.g. restored since: the pending pack (of `moved`) is not what is sent
  _check_sampler_has(ws, state, targets, dtype)
  # The same learner's full mode (a model too large to pack), built from the same explicit arguments.
  full = weight_sync.WeightSync(targets, ws.sampler_params, mode="full", dtype=dtype)
  assert full.sync(moved, 7).version == 7
  _check_sampler_has(full, moved, targets, dtype)
  with pytest.raises(ValueError, match="mode 'packed' needs"):
    weight_sync.WeightSync(targets, learner.sampler_params, mode="packed")


def test_weight_sync_object_lora_sends_the_base_once_then_adapters_packed_behind_the_step():
  meshes = mesh_lib.make_meshes(4, 4, 1, 1, layout="split")
  learner, model = _learner(meshes, lora_rank=4)
  targets = models.state_shardings(nnx.state(model), meshes.sampler, mesh_lib.SAMPLER_RULES)
  ws = weight_sync.for_learner(learner, targets)
  assert ws.mode == "lora"
  state = learner.state
  ws.after_step(state)  # nothing on the sampler yet: nothing to pack for
  assert ws._pending is None
  assert not isinstance(ws.sync(state, 0).params, params_lib.WithAdapters)  # the whole model first
  moved = _moved(state)
  ws.after_step(moved)
  assert ws._pending[0] is moved and isinstance(ws._pending[1], params_lib.Packed)
  synced = ws.sync(moved, 1)
  assert synced.version == 1 and isinstance(synced.params, params_lib.WithAdapters) and ws._pending is None
  _check_sampler_has(ws, moved, targets)
  assert any(np.abs(np.asarray(a) - np.asarray(b)).max() > 0  # the adapters did change on the sampler
             for a, b in zip(jax.tree.leaves(synced.params.adapters.unpack()), jax.tree.leaves(state.params)))
