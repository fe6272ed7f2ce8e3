"""Context parallelism on 4 CPU devices: the row split along T gives the single-device attention and
gradients, by the ring and by the all-gather; the ring holds only its own share of the keys and values."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunixlike.models import attention, context_parallel


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()[:4]), ("context",))


def _inputs(t, seed=0):
  r = np.random.RandomState(seed)
  q, k, v = (jnp.asarray(r.randn(2, t, n, 16), jnp.float32) for n in (4, 2, 2))
  seg = np.zeros((2, t), np.int32)
  seg[:, 40:100], seg[:, 100:200], seg[:, 200:] = 1, 2, -1  # a shared prompt, two answers, padding
  return q, k, v, jnp.asarray(seg)


def _packed(t):
  """Packed groups: group A's prompt (1) and answers (2, 3), group B's prompt (4) and answer (5), each
  answer attending its own group's prompt (prefix), then padding; the groups straddle the devices."""
  seg, pre = np.full((2, t), -1, np.int32), np.full((2, t), -1, np.int32)
  for row, bounds in enumerate([(30, 70, 90, 150, 230), (10, 100, 120, 130, 250)]):
    lo = 0
    for s, p, hi in zip((1, 2, 3, 4, 5), (1, 1, 1, 4, 4), bounds):
      seg[row, lo:hi], pre[row, lo:hi] = s, p
      lo = hi
  return jnp.asarray(seg), jnp.asarray(pre)


@pytest.mark.parametrize("layout", context_parallel.LAYOUTS)
@pytest.mark.parametrize("scheme", context_parallel.SCHEMES)
@pytest.mark.parametrize("masks, window", [("causal", None), ("shared_prompt", None), ("shared_prompt", 50),
                                           ("packed", None)])
def test_sharded_row_equals_one_device(mesh, scheme, layout, masks, window):
  q, k, v, seg = _inputs(256)
  seg, pre = {"causal": (None, None), "shared_prompt": (seg, None), "packed": _packed(256)}[masks]
  w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
  to, back = (functools.partial(f, mesh=mesh, axis="context", layout=layout)
              for f in (context_parallel.to_layout, context_parallel.from_layout))

  def split_attend(q, k, v):  # the row in the layout's order (zigzag: reordered), and back
    q, k, v, s, p = to((q, k, v, seg, pre))
    return back(context_parallel.attend(q, k, v, mesh, "context", segments_bt=s, prefix_bt=p, window=window,
                                        block=16, scheme=scheme, layout=layout))

  one = lambda q, k, v: (attention.reference(q, k, v, seg, pre, window) * w).sum()
  split = lambda q, k, v: (split_attend(q, k, v) * w).sum()
  sharded = NamedSharding(mesh, P(None, "context"))
  qs, ks, vs = (jax.device_put(x, sharded) for x in (q, k, v))
  out = jax.jit(split_attend)(qs, ks, vs)
  assert out.sharding.spec == P(None, "context")
  np.testing.assert_allclose(out, attention.reference(q, k, v, seg, pre, window), atol=1e-5)
  g_one = jax.jit(jax.grad(one, argnums=(0, 1, 2)))(q, k, v)
  g_split = jax.jit(jax.grad(split, argnums=(0, 1, 2)))(qs, ks, vs)
  for name, a, b in zip("qkv", g_one, g_split):
    np.testing.assert_allclose(b, a, atol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("scheme", context_parallel.SCHEMES)
def test_a_row_that_does_not_split_into_whole_blocks_is_padded(mesh, scheme):
  """200 tokens over 4 devices in 32-token blocks: padded to 256 at the end, the same attention."""
  q, k, v, seg = _inputs(200)
  out = jax.jit(lambda q, k, v: context_parallel.attend(q, k, v, mesh, "context", segments_bt=seg, block=32,
                                                        scheme=scheme))(q, k, v)
  np.testing.assert_allclose(out, attention.reference(q, k, v, seg), atol=1e-5)


def test_zigzag_reorders_half_chunks_and_back(mesh):
  """Device i holds runs i and 7-i of 8 (Megatron-LM's layout); from_layout undoes it."""
  row = jnp.arange(2 * 64).reshape(2, 64)
  zig = jax.jit(lambda x: context_parallel.to_layout(x, mesh, "context", "zigzag"))(row)
  runs = np.asarray(zig[0]).reshape(8, 8)[:, 0] // 8  # the run of each place of the reordered row
  np.testing.assert_array_equal(runs, [0, 7, 1, 6, 2, 5, 3, 4])
  np.testing.assert_array_equal(context_parallel.from_layout(zig, mesh, "context", "zigzag"), row)


def test_zigzag_balances_the_causal_work():
  """(Query block, key block) pairs per device over a causal row of 32 blocks: contiguous
  36:100:164:228, zigzag 132 each."""
  contiguous = context_parallel.causal_block_pairs("contiguous", 4, 8)  # 4 chunks of 8 blocks
  zigzag = context_parallel.causal_block_pairs("zigzag", 4, 4)  # 8 runs of 4 blocks
  assert sum(contiguous) == sum(zigzag) == 32 * 33 // 2
  assert max(contiguous) / min(contiguous) > 6 and max(zigzag) == min(zigzag)


@pytest.mark.parametrize("scheme", context_parallel.SCHEMES)
def test_a_zigzag_row_must_be_padded_first(mesh, scheme):
  q, k, v, _ = _inputs(200)
  with pytest.raises(ValueError, match="must be padded to 256"):
    context_parallel.attend(q, k, v, mesh, "context", block=32, scheme=scheme, layout="zigzag")


def _grad_temp_bytes(n, scheme, t=16384):
  """Per-device temporary memory of the compiled gradient of a T-token row split over n devices (not run)."""
  mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
  sharded = NamedSharding(mesh, P(None, "context"))
  q, k, v = (jax.ShapeDtypeStruct((1, t, 4, 64), jnp.float32, sharding=sharded) for _ in range(3))
  f = jax.jit(jax.grad(lambda q, k, v: context_parallel.attend(q, k, v, mesh, "context", scheme=scheme).sum(),
                       argnums=(0, 1, 2)))
  return f.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes


def test_the_ring_holds_its_own_share_of_keys_and_values():
  """A 16K-token row with as many KV heads as query heads, so that its K/V weigh: the ring's
  per-device memory is O(T/N), halving from 4 to 8 devices; the all-gather keeps the row's K/V (and
  their fp32 gradients) on every device whatever N."""
  kv_row = 2 * 16384 * 4 * 64 * 4  # K and V of the row, fp32
  ring = {n: _grad_temp_bytes(n, "ring") for n in (4, 8)}
  gather = {n: _grad_temp_bytes(n, "all_gather") for n in (4, 8)}
  assert ring[8] < 0.6 * ring[4], ring
  assert gather[8] > kv_row and gather[4] > kv_row, gather
  assert ring[8] < gather[8] / 2 and ring[4] < gather[4], (ring, gather)
