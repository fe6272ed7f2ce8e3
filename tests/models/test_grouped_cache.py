"""Slot groups (GroupedKVCache): each group attends its own window; results equal one shared cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunixlike import models
from tunixlike.models import kv_cache as kv_lib


@pytest.mark.parametrize("groups, block", [(2, 2), (4, 1), (2, 4)])
def test_split_merge_rows_match_group_of_row(groups, block):
  rows = np.arange(8) * 10
  parts = kv_lib.split_rows(rows, groups, block)
  for b in range(8):
    g, r = kv_lib.group_of_row(b, groups, block)
    assert parts[g][r] == rows[b]
  np.testing.assert_array_equal(kv_lib.merge_rows(parts, block), rows)
  with pytest.raises(ValueError, match="not a multiple"):
    kv_lib.split_rows(np.arange(6), 4, 1)


def _grouped(cache, positions, groups, block):
  """The rows of `cache` as slot groups, each cut to the window its own rows need."""
  ks = [kv_lib.split_rows(k, groups, block) for k in cache.k]
  vs = [kv_lib.split_rows(v, groups, block) for v in cache.v]
  need = [int(p.max()) + 1 for p in kv_lib.split_rows(np.asarray(positions), groups, block)]
  return kv_lib.GroupedKVCache(groups=tuple(
      kv_lib.KVCache(k=tuple(k[g][..., :n] for k in ks), v=tuple(v[g][:, :, :n] for v in vs))
      for g, n in enumerate(need)), block=block)


@pytest.mark.parametrize("groups, block", [(2, 2), (4, 1)])
def test_grouped_decode_step_equals_one_cache(groups, block):
  cfg = models.tiny_config(vocab_size=128, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                           intermediate_size=64, num_layers=2)
  model = models.Transformer(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  b, s = 8, 32
  _, cache = model.prefill(jnp.asarray(rng.integers(0, 128, (b, 20)), jnp.int32), model.init_cache(b, s),
                           jnp.full((b,), 20))
  positions = jnp.asarray([19, 3, 10, 6, 0, 7, 15, 12], jnp.int32)  # mixed: group windows differ
  tokens = jnp.asarray(rng.integers(0, 128, b), jnp.int32)
  ref, ref_cache = model.decode_step(tokens, positions, cache, s)
  grouped = _grouped(cache, positions, groups, block)
  assert len(set(grouped.windows)) > 1 and max(grouped.windows) < s
  got, got_cache = jax.jit(lambda t, p, c: model.decode_step(t, p, c, None))(tokens, positions, grouped)
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
  assert got_cache.windows == grouped.windows
  for row in range(b):  # the new K/V landed at each row's position in its group
    g, r = kv_lib.group_of_row(row, groups, block)
    p = int(positions[row])
    for layer in range(cfg.num_layers):
      np.testing.assert_allclose(got_cache.groups[g].k[layer][r, :, :, p], ref_cache.k[layer][row, :, :, p],
                                 atol=1e-6)
      np.testing.assert_allclose(got_cache.groups[g].v[layer][r, :, p], ref_cache.v[layer][row, :, p], atol=1e-6)
  with pytest.raises(ValueError, match="attend_len"):
    model.decode_step(tokens, positions, grouped, 16)
