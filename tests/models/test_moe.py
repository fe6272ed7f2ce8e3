"""MoE layers: top-k routing, Keep Routing (return / force experts), load-balancing loss, expert sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tunixlike import models
from tunixlike.models import moe

_forward = jax.jit(lambda m, t, r: m(t, routing_btlk=r, return_aux=True))
_plain = jax.jit(lambda m, t: m(t, return_aux=True))


def _model(**kw):
  return models.Transformer(models.tiny_moe_config(**kw), rngs=nnx.Rngs(0))


def _tokens(b, t, seed=0):
  return jnp.asarray(np.random.RandomState(seed).randint(1, 256, (b, t)), jnp.int32)


def test_route_matches_softmax_topk_by_hand():
  logits = jnp.array([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.2, -2.0]], jnp.float32)
  experts, gates = moe.route(logits, 2, norm_topk_prob=False)
  p = np.asarray(jax.nn.softmax(logits, axis=-1))
  np.testing.assert_array_equal(experts, [[1, 3], [0, 2]])
  np.testing.assert_allclose(gates, [[p[0, 1], p[0, 3]], [p[1, 0], p[1, 2]]], rtol=1e-6)
  _, normed = moe.route(logits, 2, norm_topk_prob=True)
  np.testing.assert_allclose(normed, np.asarray(gates) / np.asarray(gates).sum(-1, keepdims=True), rtol=1e-6)
  forced, fgates = moe.route(logits, 2, True, jnp.array([[2, 0], [-1, -1]]))  # row 2 falls back
  np.testing.assert_array_equal(forced, [[2, 0], [0, 2]])
  np.testing.assert_allclose(fgates[0], [p[0, 2] / (p[0, 2] + p[0, 0]), p[0, 0] / (p[0, 2] + p[0, 0])], rtol=1e-6)


def test_moe_mlp_equals_per_token_loop():
  cfg = models.tiny_moe_config(norm_topk_prob=False)
  mlp = moe.MoeMLP(cfg, nnx.Rngs(3))
  x = jax.random.normal(jax.random.key(0), (5, cfg.hidden_size))
  out, experts, logits = mlp(x)
  p = jax.nn.softmax(logits, axis=-1)
  ex = mlp.experts
  for n in range(5):
    want = sum(p[n, e] * (jax.nn.silu(x[n] @ ex.gate_proj[e]) * (x[n] @ ex.up_proj[e])) @ ex.down_proj[e]
               for e in np.asarray(experts[n]))
    np.testing.assert_allclose(out[n], want, atol=1e-5)
  assert experts.shape == (5, 2) and experts.dtype == jnp.int32 and len(set(np.asarray(experts[0]))) == 2


@pytest.mark.parametrize("norm", [True, False])
def test_forcing_own_routing_is_identical_in_every_path(norm):
  m = _model(norm_topk_prob=norm)
  toks = _tokens(2, 7)
  logits, aux = _plain(m, toks)
  assert aux.routing_btlk.shape == (2, 7, 2, 2) and aux.routing_btlk.dtype == jnp.int32
  assert aux.router_logits_btlx.shape == (2, 7, 2, 8)
  forced, aux2 = _forward(m, toks, aux.routing_btlk)
  np.testing.assert_array_equal(forced, logits)
  np.testing.assert_array_equal(aux2.routing_btlk, aux.routing_btlk)
  fallback, _ = _forward(m, toks, jnp.full_like(aux.routing_btlk, -1))  # -1: the router decides
  np.testing.assert_array_equal(fallback, logits)

  lens = jnp.array([7, 4])
  prefill = jax.jit(lambda m, t, c, r: m.prefill(t, c, lens, routing_btlk=r, return_routing=True))
  p_logits, _, p_routing = prefill(m, toks, m.init_cache(2, 8), None)
  f_logits, _, _ = prefill(m, toks, m.init_cache(2, 8), p_routing)
  np.testing.assert_array_equal(p_routing, aux.routing_btlk)
  np.testing.assert_array_equal(f_logits, p_logits)


def test_decode_routing_matches_full_forward_and_can_be_forced():
  m = _model()
  toks = _tokens(2, 6, seed=1)
  ref, aux = _plain(m, toks)
  _, cache = jax.jit(lambda m, t, c: m.prefill(t, c, jnp.array([3, 3])))(m, toks[:, :3], m.init_cache(2, 8))
  decode = jax.jit(lambda m, t, p, c, r: m.decode_step(t, p, c, 8, routing_blk=r, return_routing=True))
  for t in range(3, 6):
    pos = jnp.array([t, t])
    logits_bv, new_cache, routing_blk = decode(m, toks[:, t], pos, cache, None)
    np.testing.assert_allclose(logits_bv, ref[:, t], atol=1e-5)
    np.testing.assert_array_equal(routing_blk, aux.routing_btlk[:, t])
    forced_bv, _, _ = decode(m, toks[:, t], pos, cache, aux.routing_btlk[:, t])
    np.testing.assert_array_equal(forced_bv, logits_bv)
    cache = new_cache


def test_forced_routing_restores_logits_when_router_flips():
  """Keep Routing: a router update that flips the top-k cannot change a forced forward (fp32, exact)."""
  m = _model()  # norm_topk_prob: gates depend only on the chosen experts' logits
  toks = _tokens(1, 3, seed=2)  # 3 tokens x top-2 leave >= 2 of 8 experts unused in every layer
  logits, aux = _plain(m, toks)
  routing = np.asarray(aux.routing_btlk)[0]  # [T, L, k]
  for layer in range(2):
    unused = sorted(set(range(8)) - set(routing[:, layer].ravel()))[0]
    kernel = m.layers[layer].mlp.gate.kernel
    top1 = routing[0, layer, 0]
    # The unused expert's logit becomes 5x token 0's top-1 logit: it enters that token's top-k.
    kernel[...] = kernel[...].at[:, unused].set(5.0 * kernel[...][:, top1])
  assert float(aux.router_logits_btlx[0, 0, 0, routing[0, 0, 0]]) > 0
  perturbed, paux = _plain(m, toks)
  assert not np.array_equal(paux.routing_btlk, aux.routing_btlk)  # the top-k flipped ...
  assert np.abs(np.asarray(perturbed) - np.asarray(logits)).max() > 1e-3  # ... and changed the logits
  replayed, raux = _forward(m, toks, aux.routing_btlk)
  np.testing.assert_array_equal(raux.routing_btlk, aux.routing_btlk)
  np.testing.assert_array_equal(replayed, logits)


def test_forced_routing_still_trains_the_router():
  m = _model()
  toks = _tokens(2, 5, seed=3)
  _, aux = _plain(m, toks)

  def loss(m):
    logits, aux2 = m(toks, routing_btlk=aux.routing_btlk, return_aux=True)
    lb = models.load_balancing_loss(aux2, m.cfg.num_experts)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0]) + m.cfg.router_aux_loss_coef * lb

  grads = jax.jit(lambda m: nnx.grad(loss)(m))(m)
  for layer in range(2):
    assert float(jnp.abs(grads.layers[layer].mlp.gate.kernel[...]).max()) > 0
    for name in ("gate_proj", "up_proj", "down_proj"):
      assert float(jnp.abs(getattr(grads.layers[layer].mlp.experts, name)[...]).max()) > 0


def test_load_balancing_loss_matches_transformers():
  torch = pytest.importorskip("torch")
  from transformers.models.qwen3_moe import modeling_qwen3_moe
  m = _model()
  toks = _tokens(3, 6, seed=4)
  _, aux = _plain(m, toks)
  mask = np.array([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4], np.int64)
  per_layer = tuple(torch.tensor(np.asarray(aux.router_logits_btlx[:, :, i]).reshape(-1, 8)) for i in range(2))
  for m_bt in (None, mask):
    ref = modeling_qwen3_moe.load_balancing_loss_func(
        per_layer, 8, 2, None if m_bt is None else torch.tensor(m_bt)).item()
    ours = float(models.load_balancing_loss(aux, 8, m_bt))
    np.testing.assert_allclose(ours, ref, rtol=1e-5)
  uniform = moe.MoeAux(routing_btlk=jnp.array([[[[0, 1]], [[2, 3]]]]), router_logits_btlx=jnp.zeros((1, 2, 1, 4)))
  np.testing.assert_allclose(models.load_balancing_loss(uniform, 4), 2.0, rtol=1e-6)  # = k when balanced


def test_dense_model_accepts_keywords_with_empty_routing():
  m = models.Transformer(models.tiny_config(), rngs=nnx.Rngs(0))
  toks = _tokens(2, 4)
  logits, aux = _plain(m, toks)
  np.testing.assert_array_equal(logits, jax.jit(lambda m, t: m(t))(m, toks))
  assert aux.routing_btlk.shape == (2, 4, 0, 0)
  assert float(models.load_balancing_loss(aux, 0)) == 0.0
  with pytest.raises(ValueError, match=r"forced routing given but the model is dense"):
    m(toks, routing_btlk=jnp.zeros((2, 4, 2, 2), jnp.int32))


def test_bad_routing_shape_is_named():
  m = _model()
  with pytest.raises(ValueError, match=r"prefill: routing has shape \(2, 4, 2, 3\), expected \(2, 4, 2, 2\)"):
    m.prefill(_tokens(2, 4), m.init_cache(2, 8), jnp.array([4, 4]), routing_btlk=jnp.zeros((2, 4, 2, 3), jnp.int32))
  with pytest.raises(ValueError, match=r"decode_step: routing has dtype float32"):
    m.decode_step(_tokens(2, 1)[:, 0], jnp.array([0, 0]), m.init_cache(2, 8), 8,
                  routing_blk=jnp.zeros((2, 2, 2), jnp.float32))


@pytest.mark.parametrize("change, match", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"),
    (dict(moe_intermediate_size=0), r"moe_intermediate_size=0 must be > 0"),
    (dict(num_experts=-1), r"num_experts=-1 must be a non-negative int"),
    (dict(router_aux_loss_coef=float("nan")), r"router_aux_loss_coef=nan"),
])
def test_invalid_moe_fields_are_named(change, match):
  with pytest.raises(ValueError, match=match):
    models.tiny_moe_config(**change)


def test_expert_axis_sharding_matches_unsharded(mesh4):
  rules = (("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"),
           ("mlp", "tensor"), ("expert", "fsdp"))
  cfg = models.tiny_moe_config()
  sharded = models.create_sharded(cfg, mesh4, rules, seed=0)
  # 'expert' and 'embed' both want fsdp: the expert axis wins, embed is replicated in that tensor.
  assert sharded.layers[0].mlp.experts.gate_proj[...].sharding.spec == P("fsdp", None, "tensor")
  assert sharded.layers[0].mlp.gate.kernel[...].sharding.spec == P("fsdp", None)
  plain = models.Transformer(cfg, rngs=nnx.Rngs(0))
  toks = _tokens(2, 5)
  np.testing.assert_allclose(_plain(sharded, toks)[0], _plain(plain, toks)[0], atol=1e-5)


def test_qwen3_30b_a3b_eval_shape():
  abstract = nnx.eval_shape(lambda: models.Transformer(models.qwen3_30b_a3b(), rngs=nnx.Rngs(0)))
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract)))
  assert 30.0e9 < n < 31.0e9, n  # Qwen3-30B-A3B has 30.5B parameters
  assert abstract.layers[0].mlp.experts.down_proj.get_value().shape == (128, 768, 2048)
