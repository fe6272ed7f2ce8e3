"""attention.py: every kernel against the reference, forward and gradients, and the memory it keeps."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunixlike import models
from tunixlike.models import attention

on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (cuDNN)")


def _qkv(b, t, h, kv, d, dtype=jnp.float32, seed=0):
  r = np.random.RandomState(seed)
  return tuple(jnp.asarray(r.randn(b, t, n, d), dtype) for n in (h, kv, kv))


def _shared_prompt_segments(b, t):
  """Two rows: a prompt (0), answers 1..3 of uneven lengths, then padding (-1)."""
  seg = np.full((b, t), -1, np.int32)
  for row in range(b):
    cuts = np.sort(np.random.RandomState(row).choice(np.arange(5, t - 5), 3, replace=False))
    seg[row, :cuts[0]] = 0
    for s, (lo, hi) in enumerate(zip(cuts, list(cuts[1:]) + [t - 3 * row - 1]), start=1):
      seg[row, lo:hi] = s
  return jnp.asarray(seg)


def _packed_segments(t):
  """One row of two groups: group A's prompt (1) and answers (2, 3), group B's prompt (4) and answer (5);
  prefix = the group's prompt segment."""
  seg = np.full((1, t), -1, np.int32)
  pre = np.full((1, t), -1, np.int32)
  bounds = [(1, 1, 0.15), (2, 1, 0.3), (3, 1, 0.45), (4, 4, 0.6), (5, 4, 0.9)]
  lo = 0
  for s, p, frac in bounds:
    hi = int(t * frac)
    seg[0, lo:hi], pre[0, lo:hi] = s, p
    lo = hi
  return jnp.asarray(seg), jnp.asarray(pre)


def _loss(impl, segments=None, prefix=None, window=None, block=16):
  def f(q, k, v):
    o = attention.attend(q, k, v, segments_bt=segments, prefix_bt=prefix, window=window, impl=impl, block=block)
    w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)  # a cotangent that is not uniform
    return (o.astype(jnp.float32) * w).sum()
  return f


def _check_against_reference(q, k, v, atol, **kw):
  ref, got = _loss("reference", **{k_: v_ for k_, v_ in kw.items() if k_ != "block"}), _loss("blockwise", **kw)
  np.testing.assert_allclose(jax.jit(ref)(q, k, v), jax.jit(got)(q, k, v), atol=atol * 100, rtol=1e-5)
  g_ref = jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(q, k, v)
  g_got = jax.jit(jax.grad(got, argnums=(0, 1, 2)))(q, k, v)
  for name, a, b in zip("qkv", g_ref, g_got):
    np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), atol=atol, err_msg=f"d{name}")


@pytest.mark.parametrize("h,kv,t,block", [(4, 4, 64, 16), (4, 2, 100, 16), (4, 1, 37, 512), (6, 2, 100, 32)])
def test_blockwise_equals_reference_causal(h, kv, t, block):
  """MHA, GQA and MQA; T a multiple of the block, not one, and shorter than one block."""
  q, k, v = _qkv(2, t, h, kv, 16)
  _check_against_reference(q, k, v, 1e-5, block=block)


@pytest.mark.parametrize("window", [None, 1, 40])
def test_blockwise_equals_reference_with_shared_prompt_segments(window):
  q, k, v = _qkv(2, 96, 4, 2, 16, seed=1)
  _check_against_reference(q, k, v, 1e-5, segments=_shared_prompt_segments(2, 96), window=window)


def test_blockwise_equals_reference_with_a_window():
  q, k, v = _qkv(1, 100, 4, 2, 16, seed=7)
  _check_against_reference(q, k, v, 1e-5, window=9)


def test_blockwise_equals_reference_with_packed_groups():
  q, k, v = _qkv(1, 128, 4, 2, 16, seed=2)
  segments, prefix = _packed_segments(128)
  _check_against_reference(q, k, v, 1e-5, segments=segments, prefix=prefix)
  # the mask really separates the groups: group B's tokens do not move when group A's keys change
  out = jax.jit(lambda k_: attention.attend(q, k_, v, segments_bt=segments, prefix_bt=prefix, impl="blockwise", block=16))
  k2 = k.at[:, :int(128 * 0.45)].multiply(3.0)
  b_start = int(128 * 0.45)
  np.testing.assert_allclose(out(k2)[:, b_start:], out(k)[:, b_start:], atol=1e-6)
  assert not np.allclose(out(k2)[:, :b_start], out(k)[:, :b_start])


def test_blockwise_bf16_keeps_fp32_accumulation():
  q, k, v = _qkv(1, 256, 4, 2, 32, dtype=jnp.bfloat16, seed=3)
  got = attention.attend(q, k, v, impl="blockwise", block=64)
  assert got.dtype == jnp.bfloat16
  exact = attention.reference(*(x.astype(jnp.float32) for x in (q, k, v)))
  ref = attention.reference(q, k, v)
  # as close to the fp32 result as the reference in bf16 is
  err_got = float(jnp.abs(got.astype(jnp.float32) - exact).max())
  err_ref = float(jnp.abs(ref.astype(jnp.float32) - exact).max())
  assert err_got <= 2 * err_ref + 1e-3, (err_got, err_ref)
  _check_against_reference(q, k, v, 0.1, block=64)


def _grad_temp_bytes(impl, t):
  q, k, v = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _qkv(1, 8, 4, 2, 64))
  q, k, v = (jax.ShapeDtypeStruct((1, t) + x.shape[2:], x.dtype) for x in (q, k, v))
  f = jax.jit(jax.grad(lambda q, k, v: attention.attend(q, k, v, impl=impl).sum(), argnums=(0, 1, 2)))
  return f.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly():
  ref_4k = _grad_temp_bytes("reference", 4096)
  blk_4k, blk_16k = _grad_temp_bytes("blockwise", 4096), _grad_temp_bytes("blockwise", 16384)
  assert ref_4k > 4 * 4096 * 4096 * 4  # the [H, T, T] fp32 probabilities at least
  assert blk_4k < ref_4k / 8, (blk_4k, ref_4k)
  assert blk_16k < 6 * blk_4k, (blk_4k, blk_16k)  # 4x the length: ~4x the memory, not 16x


def test_blockwise_compiles_once_per_shape():
  q, k, v = _qkv(1, 64, 4, 2, 16)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def grads(q, k, v):
    return jax.grad(_loss("blockwise"), argnums=(0, 1, 2))(q, k, v)

  grads(q, k, v)
  grads(q * 2, k, v)


def test_choose_per_backend():
  c = attention.choose
  assert c("auto", 64, jnp.float32, False, False, backend="cpu") == "reference"
  assert c("auto", 8192, jnp.float32, False, False, backend="cpu") == "blockwise"
  assert c("auto", 8192, jnp.bfloat16, False, False, backend="gpu") == "cudnn"
  assert c("auto", 8192, jnp.float32, False, False, backend="gpu") == "blockwise"  # cuDNN has no fp32
  assert c("auto", 8192, jnp.bfloat16, True, False, backend="gpu") == "blockwise"  # a shared prefix
  assert c("auto", 8192, jnp.bfloat16, False, False, backend="tpu") == "pallas_tpu"
  assert c("cudnn", 64, jnp.bfloat16, True, False, backend="gpu") == "blockwise"
  assert c("reference", 65536, jnp.float32, False, False, backend="cpu") == "reference"
  with pytest.raises(ValueError, match="attention implementation 'flash'"):
    attention.attend(*_qkv(1, 8, 4, 2, 16), impl="flash")
  with pytest.raises(ValueError, match="ModelConfig.attention='flash'"):
    models.tiny_config(attention="flash")


def test_splash_kernel_in_interpret_mode_equals_reference():
  """The TPU kernel run by the Pallas interpreter on this backend (head_dim 128, as on TPU)."""
  q, k, v = _qkv(1, 200, 4, 2, 128, seed=4)
  for window in (None, 50):
    ref = lambda q, k, v: (attention.reference(q, k, v, window=window) ** 2).sum()
    got = lambda q, k, v: (attention.splash_interpret(q, k, v, window=window) ** 2).sum()
    np.testing.assert_allclose(attention.splash_interpret(q, k, v, window=window),
                               attention.reference(q, k, v, window=window), atol=1e-5)
    grads = lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(grads(ref), grads(got)):
      np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("segments", [False, True])
def test_model_with_blockwise_attention_equals_reference(segments):
  """The whole model (forward and every parameter's gradient), shared-prompt rows included."""
  cfg = models.tiny_config()
  toks = jax.random.randint(jax.random.key(0), (2, 48), 0, cfg.vocab_size)
  seg = _shared_prompt_segments(2, 48) if segments else None
  pos = None
  if segments:  # each answer restarts at the prompt's length, as prompt_rows lays them out
    s = np.asarray(seg)
    pos = np.zeros_like(s)
    for r in range(2):
      p = int((s[r] == 0).sum())
      pos[r, :p] = np.arange(p)
      for a in range(1, s[r].max() + 1):
        idx = np.nonzero(s[r] == a)[0]
        pos[r, idx] = p + np.arange(len(idx))
    pos = jnp.asarray(pos)

  def loss_and_grads(impl):
    m = models.Transformer(cfg.replace(attention=impl), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(m)
    f = lambda p: (nnx.merge(graphdef, p).hidden_states(toks, pos, segments_bt=seg) ** 2).mean()
    return jax.jit(jax.value_and_grad(f))(params)

  (l_ref, g_ref), (l_blk, g_blk) = loss_and_grads("reference"), loss_and_grads("blockwise")
  np.testing.assert_allclose(l_blk, l_ref, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-4), g_ref, g_blk)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("window", [None, 128])
def test_cudnn_equals_reference_on_gpu(window):
  q, k, v = _qkv(2, 1024, 8, 2, 64, dtype=jnp.bfloat16, seed=5)
  assert attention.choose("auto", 1024, jnp.bfloat16, False, False) == "cudnn"
  exact = lambda q, k, v: attention.reference(*(x.astype(jnp.float32) for x in (q, k, v)), window=window)
  got = attention.attend(q, k, v, window=window, impl="cudnn")
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), exact(q, k, v), atol=2e-2)
  loss = lambda fn: (lambda q, k, v: (fn(q, k, v).astype(jnp.float32) ** 2).sum())
  g_ref = jax.grad(loss(exact), argnums=(0, 1, 2))(q, k, v)
  g_got = jax.grad(loss(lambda q, k, v: attention.attend(q, k, v, window=window, impl="cudnn")),
                   argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g_ref, g_got):
    scale = float(jnp.abs(a).max())
    np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), atol=3e-2 * scale)


@pytest.mark.gpu
@on_gpu
def test_blockwise_on_gpu_equals_reference():
  q, k, v = _qkv(2, 1000, 4, 2, 64, seed=6)
  with jax.default_matmul_precision("highest"):
    _check_against_reference(q, k, v, 1e-4, segments=_shared_prompt_segments(2, 1000), block=128)
