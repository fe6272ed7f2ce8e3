"""Context parallelism on 4 CPU devices: the row split along T gives the single-device attention and gradients."""

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


@pytest.mark.parametrize("with_segments, window", [(False, None), (True, None), (True, 50)])
def test_sharded_row_equals_one_device(mesh, with_segments, window):
  q, k, v, seg = _inputs(256)
  seg = seg if with_segments else None
  w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
  one = lambda q, k, v: (attention.reference(q, k, v, seg, None, window) * w).sum()
  split = lambda q, k, v: (context_parallel.attend(q, k, v, mesh, "context", segments_bt=seg, window=window,
                                                   block=16) * w).sum()
  sharded = NamedSharding(mesh, P(None, "context"))
  qs, ks, vs = (jax.device_put(x, sharded) for x in (q, k, v))
  out = jax.jit(lambda q, k, v: context_parallel.attend(q, k, v, mesh, "context", segments_bt=seg, window=window,
                                                        block=16))(qs, ks, vs)
  assert out.sharding.spec == P(None, "context")
  np.testing.assert_allclose(out, attention.reference(q, k, v, seg, None, window), atol=1e-5)
  g_one = jax.jit(jax.grad(one, argnums=(0, 1, 2)))(q, k, v)
  g_split = jax.jit(jax.grad(split, argnums=(0, 1, 2)))(qs, ks, vs)
  for name, a, b in zip("qkv", g_one, g_split):
    np.testing.assert_allclose(b, a, atol=1e-5, err_msg=f"d{name}")


def test_a_row_that_does_not_split_into_whole_blocks_is_padded(mesh):
  """200 tokens over 4 devices in 32-token blocks: padded to 256 at the end, the same attention."""
  q, k, v, seg = _inputs(200)
  out = jax.jit(lambda q, k, v: context_parallel.attend(q, k, v, mesh, "context", segments_bt=seg, block=32))(q, k, v)
  np.testing.assert_allclose(out, attention.reference(q, k, v, seg), atol=1e-5)
