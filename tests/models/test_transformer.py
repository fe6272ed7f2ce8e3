"""The NNX transformer: causal forward, KV-cache decoding, gradients, dtypes, sharded creation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tunixlike import models

RULES = (("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"))


# Eager NNX dispatches op by op; jitting the forward keeps these tests fast on CPU.
_forward = jax.jit(lambda m, t: m(t))


def _model(**kw):
  return models.Transformer(models.tiny_config(**kw), rngs=nnx.Rngs(0))


@pytest.mark.gpu
def test_causal_and_right_padding_do_not_leak():
  m = _model(qkv_bias=True, tie_embeddings=False)
  toks = jax.random.randint(jax.random.key(1), (2, 8), 0, 256)
  logits = _forward(m, toks)
  assert logits.shape == (2, 8, 256) and logits.dtype == jnp.float32
  changed = toks.at[:, 5:].set(7)  # later tokens (or padding) cannot change earlier logits
  after = _forward(m, changed)
  np.testing.assert_allclose(after[:, :5], logits[:, :5], atol=1e-6)
  assert not np.allclose(after[:, 5:], logits[:, 5:])


@pytest.mark.parametrize("kw", [dict(), dict(qkv_bias=True), dict(qk_norm=True, tie_embeddings=False),
                                dict(rope_scaling=models.RopeScaling(original_max_position_embeddings=32))])
@pytest.mark.gpu
def test_prefill_then_decode_equals_full_forward(kw, random_batch):
  m = _model(**kw)
  lengths, steps = [5, 2, 4], 4
  prompts, lens = random_batch(256, lengths, 6, seed=1)
  cont = np.random.RandomState(2).randint(1, 256, (3, steps)).astype(np.int32)
  full = np.zeros((3, 6 + steps), np.int32)  # each row: its prompt then its continuation, right padded
  for b, n in enumerate(lengths):
    full[b, :n], full[b, n:n + steps] = prompts[b, :n], cont[b]
  ref = np.asarray(_forward(m, jnp.asarray(full)))

  cache = m.init_cache(3, 16)
  logits, cache = jax.jit(lambda m, t, c, n: m.prefill(t, c, n))(m, jnp.asarray(prompts), cache, jnp.asarray(lens))
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(logits[b, :n], ref[b, :n], atol=1e-5)
  decode = jax.jit(lambda m, t, p, c: m.decode_step(t, p, c, 12))  # attend bucket < cache max_len
  for i in range(steps):
    pos = lens + i
    logits_bv, cache = decode(m, jnp.asarray(cont[:, i]), jnp.asarray(pos), cache)
    np.testing.assert_allclose(logits_bv, ref[np.arange(3), pos], atol=1e-5)


def test_cache_layout_and_prefill_zeroes_padding():
  m = _model()
  cache = m.init_cache(2, 10, dtype=jnp.bfloat16)
  assert cache.k[0].shape == (2, 2, 16, 10) and cache.v[0].shape == (2, 2, 10, 16)
  assert cache.k[0].dtype == jnp.bfloat16 and len(cache.k) == 2
  _, cache = m.prefill(jnp.ones((2, 4), jnp.int32), cache, jnp.array([4, 2]))
  assert np.all(np.asarray(cache.k[1][1, :, :, 2:], np.float32) == 0)
  assert np.any(np.asarray(cache.k[1][0, :, :, 3], np.float32) != 0)
  with pytest.raises(ValueError, match="attend_len=11"):
    m.decode_step(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), cache, 11)


@pytest.mark.gpu
@pytest.mark.parametrize("tie", [True, False])
def test_every_parameter_gets_a_gradient(tie):
  m = _model(qkv_bias=True, tie_embeddings=tie)
  toks = jax.random.randint(jax.random.key(0), (2, 6), 0, 256)
  grads = jax.jit(nnx.grad(lambda m: jax.nn.log_softmax(m(toks)).mean()))(m)
  for path, g in nnx.to_flat_state(grads):
    assert np.abs(np.asarray(g.get_value())).max() > 0, f"zero gradient for {path}"


def test_remat_gives_same_gradients():
  toks = jax.random.randint(jax.random.key(0), (2, 6), 0, 256)
  loss = lambda m: m(toks).std()
  g0 = nnx.to_flat_state(jax.jit(nnx.grad(loss))(_model()))
  g1 = nnx.to_flat_state(jax.jit(nnx.grad(loss))(_model(remat=True)))
  for (p, a), (_, b) in zip(g0, g1):
    np.testing.assert_allclose(a.get_value(), b.get_value(), atol=1e-6, err_msg=str(p))


@pytest.mark.gpu
def test_bf16_params_and_compute():
  ref = _model()
  graphdef, _ = nnx.split(_model(param_dtype="bfloat16", dtype="bfloat16"))
  m = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(ref)))
  assert m.layers[0].mlp.up_proj.kernel.get_value().dtype == jnp.bfloat16
  toks = jax.random.randint(jax.random.key(0), (2, 6), 0, 256)
  out = _forward(m, toks)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, _forward(ref, toks), atol=0.05)


def test_full_size_eval_shape_uses_no_memory():
  cfg = models.qwen2_5_0_5b()
  abstract = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  n = sum(np.prod(v.get_value().shape) for _, v in nnx.to_flat_state(nnx.state(abstract)))
  assert 490e6 < n < 500e6  # Qwen2.5-0.5B: 494M parameters (tied)
  out = jax.eval_shape(lambda m, t: m(t), abstract, jax.ShapeDtypeStruct((2, 16), jnp.int32))
  assert out.shape == (2, 16, 151936)


def test_create_sharded_matches_unsharded(mesh4):
  cfg = models.tiny_config(qkv_bias=True, tie_embeddings=False)
  sharded = models.create_sharded(cfg, mesh4, RULES, seed=3)
  plain = models.Transformer(cfg, rngs=nnx.Rngs(3))
  q = sharded.layers[1].attn.q_proj.kernel.get_value()
  assert q.sharding.spec == P("fsdp", "tensor") and q.sharding.mesh == mesh4
  assert sharded.embed_tokens.embedding.get_value().sharding.spec == P("tensor", "fsdp")
  assert sharded.lm_head.kernel.get_value().addressable_shards[0].data.shape == (32, 128)
  toks = jax.random.randint(jax.random.key(0), (4, 8), 0, 256)
  want = _forward(plain, toks)
  np.testing.assert_allclose(_forward(sharded, toks), want, atol=1e-5)
  # decode with a cache sharded by the same logical rules
  cache = sharded.init_cache(4, 16)
  cache = jax.device_put(cache, models.cache_shardings(cache, mesh4, RULES + (("batch", "fsdp"),)))
  logits, cache = jax.jit(lambda m, t, c: m.prefill(t, c, jnp.full((4,), 8)))(sharded, toks, cache)
  np.testing.assert_allclose(logits, want, atol=1e-5)
  assert cache.k[0].sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh4, P("fsdp", "tensor")), 4)


def test_bad_sharding_rules_are_named(mesh4):
  with pytest.raises(ValueError, match=r"embed_tokens/embedding: dimension 'vocab' of size 255 does not divide"):
    models.create_sharded(models.tiny_config(vocab_size=255), mesh4, RULES, seed=0)
  explicit = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with pytest.raises(ValueError, match=r"Explicit"):
    models.create_sharded(models.tiny_config(), explicit, RULES, seed=0)
  with pytest.raises(ValueError, match=r"mesh axis 'model'"):
    models.create_sharded(models.tiny_config(), mesh4, (("mlp", "model"),), seed=0)
