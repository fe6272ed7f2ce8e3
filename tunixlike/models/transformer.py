"""Decoder-only transformer (Llama 3.x / Qwen2 / Qwen3, dense or MoE: Qwen3-MoE / Mixtral) in Flax NNX.

Names follow Hugging Face one to one (`layers[i].attn.q_proj`, `mlp.gate_proj`, `input_layernorm`,
...) so checkpoints map directly and LoRA can wrap projections by name. Kernels are [in, out]
(the transpose of torch's nn.Linear weight). Softmax, RMSNorm statistics and RoPE run in fp32
whatever the compute dtype.

MoE models (cfg.num_experts > 0) take optional forced routing and can return what they routed
(see moe.py): `hidden_states(..., routing_btlk=, return_aux=True)`, `prefill(..., routing_btlk=,
return_routing=True)`, `decode_step(..., routing_blk=, return_routing=True)`. Dense models accept
the same keywords (routing arrays then have L = k = 0).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from tunixlike.models import attention as attention_lib
from tunixlike.models import context_parallel
from tunixlike.models import sharding as sharding_lib
from tunixlike.models.config import ModelConfig
from tunixlike.models import paged_cache
from tunixlike.models.kv_cache import GroupedKVCache, KVCache, merge_rows, split_rows, write_rows
from tunixlike.models.moe import MoeAux, MoeMLP, check_routing


def _init(cfg: ModelConfig, axes, base=None):
  # eager_sharding=False: the module can be built with no mesh; create_sharded applies the layout.
  return nnx.with_partitioning(base or nnx.initializers.normal(cfg.init_std), axes, eager_sharding=False)


def _linear(cfg: ModelConfig, d_in: int, d_out: int, axes, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, use_bias=bias, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
                    kernel_init=_init(cfg, axes), bias_init=_init(cfg, axes[1:], nnx.initializers.zeros_init()),
                    rngs=rngs)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, cfg: ModelConfig):
    self.eps = cfg.rms_norm_eps
    self.weight = nnx.Param(_init(cfg, ("norm",), nnx.initializers.ones_init())(
        jax.random.key(0), (dim,), jnp.dtype(cfg.param_dtype)))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (self.weight[...].astype(x.dtype) * x32.astype(x.dtype))


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
  """[D/2] inverse frequencies, with Llama 3.1 scaling when configured (as in HF `llama3`)."""
  d = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  s = cfg.rope_scaling
  if s is None:
    return inv
  low_wl = s.original_max_position_embeddings / s.low_freq_factor
  high_wl = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = jnp.where(wavelen > low_wl, inv / s.factor, inv)
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_wl) & (wavelen <= low_wl)
  return jnp.where(medium, smoothed, scaled)


def rope_cos_sin(positions, cfg: ModelConfig):
  """cos, sin of shape positions.shape + [D] (halves duplicated, HF rotate_half convention)."""
  freqs = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
  """x [..., H, D]; cos/sin [..., D] broadcast over heads."""
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos[..., None, :] + rotated * sin[..., None, :]).astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    h, kv, d, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    self.q_proj = _linear(cfg, e, h * d, ("embed", "heads"), cfg.qkv_bias, rngs)
    self.k_proj = _linear(cfg, e, kv * d, ("embed", "kv_heads"), cfg.qkv_bias, rngs)
    self.v_proj = _linear(cfg, e, kv * d, ("embed", "kv_heads"), cfg.qkv_bias, rngs)
    self.o_proj = _linear(cfg, h * d, e, ("heads", "embed"), False, rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(d, cfg)
      self.k_norm = RMSNorm(d, cfg)

  def _qkv(self, x_btd, cos, sin):
    cfg = self.cfg
    b, t = x_btd.shape[:2]
    q = self.q_proj(x_btd).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = self.k_proj(x_btd).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = self.v_proj(x_btd).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def __call__(self, x_btd, cos, sin, segments_bt=None, prefix_bt=None):
    """Causal self-attention over the whole sequence. Returns (out [B,T,E], k [B,T,Hkv,D], v).

    segments_bt (int [B,T], optional): a token sees only the earlier tokens of its own segment and of
    segment prefix_bt (default 0: a shared prompt); without it every token sees every earlier one.
    The kernel is cfg.attention's (`attention.py`: reference, blockwise flash, cuDNN, splash); with
    the row's tokens split over devices (activation rule 'length', the learner's
    `optim.context_parallel`) cfg.context_parallel_attention's scheme (`context_parallel.py`: ring, all-gather),
    the tokens in cfg.context_parallel_layout's order (`Transformer._run_layers` reorders them).
    """
    cfg = self.cfg
    b, t = x_btd.shape[:2]
    q, k, v = self._qkv(x_btd, cos, sin)
    split = sharding_lib.activation_axis("length")
    if split is None:
      o = attention_lib.attend(q, k, v, segments_bt=segments_bt, prefix_bt=prefix_bt, impl=cfg.attention)
    else:
      o = context_parallel.attend(q, k, v, *split, segments_bt=segments_bt, prefix_bt=prefix_bt,
                                  scheme=cfg.context_parallel_attention, layout=cfg.context_parallel_layout)
    return self.o_proj(o.reshape(b, t, cfg.num_heads * cfg.head_dim)), k, v

  def decode(self, x_bd, cos_bd, sin_bd, positions_b, k_cache, v_cache, attend_len: int | None,
             block: int | None = None, plan: paged_cache.PoolPlan | paged_cache.KernelPlan | None = None):
    """One new token per row. k_cache [B,Hkv,D,S], v_cache [B,Hkv,S,D]; attends [0, attend_len).

    Slot groups (kv_cache.GroupedKVCache): k_cache / v_cache are tuples of per-group caches
    [B/G, ...] whose rows interleave in blocks of `block`; each group attends its whole cache (its
    own window), so a group of short sequences does not read the window of the longest one.
    Paged cache (`plan` given): k_cache / v_cache are the layer's block pools (`paged_cache`).
    """
    cfg = self.cfg
    b = x_bd.shape[0]
    if plan is not None:
      o, k_cache, v_cache = self.decode_chunk(x_bd[:, None], cos_bd[:, None], sin_bd[:, None], positions_b[:, None],
                                              k_cache, v_cache, plan)
      return o[:, 0], k_cache, v_cache
    q, k, v = self._qkv(x_bd[:, None], cos_bd[:, None], sin_bd[:, None])  # [B,1,H,D] ...
    q = q.reshape(b, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
    if block is None:
      o, k_cache, v_cache = _attend_cache(q, k[:, 0], v[:, 0], positions_b, k_cache, v_cache, attend_len)
    else:
      n = len(k_cache)
      rows = [split_rows(t, n, block) for t in (q, k[:, 0], v[:, 0], positions_b)]
      parts = [_attend_cache(*(r[i] for r in rows), k_cache[i], v_cache[i], k_cache[i].shape[-1])
               for i in range(n)]
      o = merge_rows([p[0] for p in parts], block)
      k_cache, v_cache = tuple(p[1] for p in parts), tuple(p[2] for p in parts)
    return self.o_proj(o.reshape(b, 1, -1).astype(x_bd.dtype))[:, 0], k_cache, v_cache


  def decode_chunk(self, x_btd, cos_btd, sin_btd, positions_bt, k_cache, v_cache,
                   plan: paged_cache.PoolPlan | paged_cache.KernelPlan, written_bt=None):
    """T new tokens per row at positions_bt over a paged cache (`paged_cache.attend`): each is written
    (where written_bt), then attends its row's positions up to its own. Returns (out [B,T,E], k_cache, v_cache)."""
    cfg = self.cfg
    b, t = x_btd.shape[:2]
    q, k, v = self._qkv(x_btd, cos_btd, sin_btd)  # [B,T,H,D], [B,T,Hkv,D] ...
    q = q.reshape(b, t, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
    o, k_cache, v_cache = paged_cache.attend(q, k, v, positions_bt, k_cache, v_cache, plan, written_bt)
    return self.o_proj(o.reshape(b, t, -1).astype(x_btd.dtype)), k_cache, v_cache

  def extend(self, x_bcd, cos, sin, k_cache, v_cache, start, live_bc):
    """Chunked prefill: the chunk's K/V go into the cache at [start, start + C) (zero where not
    `live_bc`), then each chunk position attends every cache position up to its own.
    k_cache [B,Hkv,D,L], v_cache [B,Hkv,L,D]; returns (out [B,C,E], k_cache, v_cache)."""
    cfg = self.cfg
    b, c = x_bcd.shape[:2]
    q, k, v = self._qkv(x_bcd, cos, sin)
    k = jnp.where(live_bc[:, :, None, None], k, 0).astype(k_cache.dtype)
    v = jnp.where(live_bc[:, :, None, None], v, 0).astype(v_cache.dtype)
    k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.transpose(0, 2, 3, 1), start, axis=3)
    v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.transpose(0, 2, 1, 3), start, axis=2)
    g = cfg.num_heads // cfg.num_kv_heads
    q = q.reshape(b, c, cfg.num_kv_heads, g, cfg.head_dim).astype(k_cache.dtype)
    s = jnp.einsum("bckgd,bkdl->bkgcl", q, k_cache, preferred_element_type=jnp.float32) / math.sqrt(cfg.head_dim)
    visible = jnp.arange(k_cache.shape[-1])[None, :] <= (start + jnp.arange(c))[:, None]  # [C, L]
    p = jax.nn.softmax(jnp.where(visible, s, -1e30), axis=-1).astype(v_cache.dtype)
    o = jnp.einsum("bkgcl,bkld->bckgd", p, v_cache).reshape(b, c, cfg.num_heads * cfg.head_dim)
    return self.o_proj(o.astype(x_bcd.dtype)), k_cache, v_cache


def _attend_cache(q_bkgd, k_bkd, v_bkd, positions_b, k_cache, v_cache, attend_len: int):
  """Writes this step's K/V at positions_b, then attends cache[..., :attend_len] up to each position.

  q [B,Hkv,G,D] (G query heads per KV head); returns (o [B,Hkv,G,D], k_cache, v_cache).
  """
  k_cache = write_rows(k_cache, k_bkd, positions_b, seq_axis=3)
  v_cache = write_rows(v_cache, v_bkd, positions_b, seq_axis=2)
  q = q_bkgd.astype(k_cache.dtype)
  s = jnp.einsum("bkgd,bkda->bkga", q, k_cache[..., :attend_len],
                 preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
  valid = jnp.arange(attend_len)[None, :] <= positions_b[:, None]  # [B, A]
  p = jax.nn.softmax(jnp.where(valid[:, None, None, :], s, -1e30), axis=-1).astype(v_cache.dtype)
  o = jnp.einsum("bkga,bkad->bkgd", p, v_cache[:, :, :attend_len])
  return o, k_cache, v_cache


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    e, m = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = _linear(cfg, e, m, ("embed", "mlp"), False, rngs)
    self.up_proj = _linear(cfg, e, m, ("embed", "mlp"), False, rngs)
    self.down_proj = _linear(cfg, m, e, ("mlp", "embed"), False, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg)
    self.attn = Attention(cfg, rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg)
    self.mlp = MoeMLP(cfg, rngs) if cfg.is_moe else MLP(cfg, rngs)

  def _mlp(self, x, forced):
    """-> (x + mlp(norm(x)), routing or None); routing = (experts [..., k], router logits [..., X])."""
    h = self.post_attention_layernorm(x)
    if isinstance(self.mlp, MoeMLP):
      out, experts, logits = self.mlp(h, forced)
      return x + out, (experts, logits)
    return x + self.mlp(h), None

  def __call__(self, x, cos, sin, forced=None, segments=None, prefix=None):
    a, k, v = self.attn(self.input_layernorm(x), cos, sin, segments, prefix)
    x, routed = self._mlp(x + a, forced)
    return x, k, v, routed

  def decode(self, x, cos, sin, positions_b, k_cache, v_cache, attend_len, forced=None, block=None, plan=None):
    a, k_cache, v_cache = self.attn.decode(self.input_layernorm(x), cos, sin, positions_b, k_cache, v_cache,
                                           attend_len, block, plan)
    x, routed = self._mlp(x + a, forced)
    return x, k_cache, v_cache, routed


  def decode_chunk(self, x, cos, sin, positions_bt, k_cache, v_cache, plan, written_bt=None):
    a, k_cache, v_cache = self.attn.decode_chunk(self.input_layernorm(x), cos, sin, positions_bt, k_cache, v_cache,
                                                 plan, written_bt)
    x, _ = self._mlp(x + a, None)
    return x, k_cache, v_cache

  def extend(self, x, cos, sin, k_cache, v_cache, start, live_bc):
    a, k_cache, v_cache = self.attn.extend(self.input_layernorm(x), cos, sin, k_cache, v_cache, start, live_bc)
    x, routed = self._mlp(x + a, None)
    return x, k_cache, v_cache, routed


def _stack_routing(routed, lead_shape, cfg: ModelConfig) -> MoeAux:
  """Per-layer (experts [..., k], logits [..., X]) -> MoeAux with layer axis -2 (empty for dense)."""
  if not cfg.is_moe:
    return MoeAux(routing_btlk=jnp.zeros((*lead_shape, 0, 0), jnp.int32),
                  router_logits_btlx=jnp.zeros((*lead_shape, 0, 0), jnp.float32))
  return MoeAux(routing_btlk=jnp.stack([r[0] for r in routed], axis=-2),
                router_logits_btlx=jnp.stack([r[1] for r in routed], axis=-2))


def _forced(routing, cfg: ModelConfig, lead_shape, what: str):
  """Per-layer forced experts [..., k] (or Nones) from routing [..., L, k]."""
  if routing is None:
    return [None] * cfg.num_layers
  check_routing(routing, cfg, lead_shape, what)
  return [routing[..., i, :] for i in range(cfg.num_layers)]


class Transformer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=jnp.dtype(cfg.dtype),
                                  param_dtype=jnp.dtype(cfg.param_dtype),
                                  embedding_init=_init(cfg, ("vocab", "embed")), rngs=rngs)
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg)
    if not cfg.tie_embeddings:
      self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), False, rngs)

  # ------------------------------------------------------------------ full sequence

  def _run_layers(self, tokens_bt, positions_bt, routing_btlk=None, what="forward", segments_bt=None,
                  prefix_bt=None):
    if positions_bt is None:
      positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    shape = tokens_bt.shape
    per_layer = _forced(routing_btlk, self.cfg, shape, what)
    split = self._split_row()
    if split is not None:  # the row's tokens in the order its devices hold them (context_parallel.py)
      tokens_bt, positions_bt, segments_bt, prefix_bt, per_layer = split.enter(
          tokens_bt, positions_bt, segments_bt, prefix_bt, per_layer)
    cos, sin = rope_cos_sin(positions_bt, self.cfg)
    x = sharding_lib.constrain(self.embed_tokens(tokens_bt), ("batch", "length", None))
    kvs, routed = [], []
    for layer, forced in zip(self.layers, per_layer):
      if self.cfg.remat:
        x, k, v, r = nnx.remat(lambda blk, x_, c_, s_, f_, g_, p_: blk(x_, c_, s_, f_, g_, p_))(
            layer, x, cos, sin, forced, segments_bt, prefix_bt)
      else:
        x, k, v, r = layer(x, cos, sin, forced, segments_bt, prefix_bt)
      kvs.append((k, v))
      routed.append(r)
    x = self.norm(x)
    if split is not None:
      x, kvs, routed = split.leave(shape[1], (x, kvs, routed))
    return x, kvs, _stack_routing(routed, shape, self.cfg)

  def _split_row(self) -> context_parallel.RowSplit | None:
    """How this forward reorders a row split over devices (the learner's `optim.context_parallel`,
    activation rule 'length'), or None."""
    split = sharding_lib.activation_axis("length")
    if split is None or self.cfg.context_parallel_layout == "contiguous":
      return None
    return context_parallel.RowSplit(*split, self.cfg.context_parallel_layout)

  def hidden_states(self, tokens_bt, positions_bt=None, *, segments_bt=None, prefix_bt=None, routing_btlk=None,
                    return_aux: bool = False):
    """[B,T] int -> [B,T,E] after the final norm (before unembedding).

    segments_bt: int [B,T], several sequences in a row that share its first segment (0), or with
    prefix_bt (int [B,T]) the segment each token sees besides its own (several groups packed in a
    row, each with its prompt), as `Attention` masks them (with their own positions_bt). routing_btlk: int [B,T,L,k] experts to
    force in every MoE layer (Keep Routing; rows whose first entry is negative use the router).
    return_aux=True returns (h, MoeAux) instead of h.
    """
    h, _, aux = self._run_layers(tokens_bt, positions_bt, routing_btlk, "hidden_states", segments_bt, prefix_bt)
    return (h, aux) if return_aux else h

  def unembed(self, h_btd):
    """[..., E] -> float32 logits [..., V] (tied embedding or lm_head)."""
    dt = jnp.dtype(self.cfg.dtype)
    if self.cfg.tie_embeddings:
      w_ve = self.embed_tokens.embedding[...].astype(dt)
      return jnp.einsum("...e,ve->...v", h_btd.astype(dt), w_ve, preferred_element_type=jnp.float32)
    w_ev = self.lm_head.kernel[...].astype(dt)
    return jnp.einsum("...e,ev->...v", h_btd.astype(dt), w_ev, preferred_element_type=jnp.float32)

  def __call__(self, tokens_bt, positions_bt=None, *, routing_btlk=None, return_aux: bool = False):
    """int32 [B,T] -> float32 logits [B,T,V]; causal, right padding ok (pad rows are ignored).

    routing_btlk / return_aux as in hidden_states ((logits, MoeAux) when return_aux).
    """
    h, aux = self.hidden_states(tokens_bt, positions_bt, routing_btlk=routing_btlk, return_aux=True)
    return (self.unembed(h), aux) if return_aux else self.unembed(h)

  # ------------------------------------------------------------------ KV-cache decoding

  def init_cache(self, batch_size: int, max_len: int, dtype=None) -> KVCache:
    cfg = self.cfg
    return KVCache.zeros(cfg.num_layers, batch_size, cfg.num_kv_heads, cfg.head_dim, max_len,
                         jnp.dtype(dtype or cfg.dtype))

  def prefill(self, tokens_bt, cache: KVCache, true_lengths_b, *, routing_btlk=None,
              return_routing: bool = False):
    """Runs the prompts [B,T] (right padded; T <= cache.max_len) and writes positions [0, T) of the cache.

    K/V past each row's true length are zeroed so the cache content does not depend on padding.
    Returns (logits [B,T,V], cache), or (logits, cache, routing int32 [B,T,L,k]) with return_routing.
    routing_btlk forces experts as in hidden_states.
    """
    b, t = tokens_bt.shape
    if t > cache.max_len:
      raise ValueError(f"prefill: prompt length {t} exceeds cache max_len {cache.max_len}")
    if cache.batch_size != b:
      raise ValueError(f"prefill: batch {b} != cache batch {cache.batch_size}")
    h, kvs, aux = self._run_layers(tokens_bt, None, routing_btlk, "prefill")
    live_bt = jnp.arange(t)[None, :] < jnp.asarray(true_lengths_b)[:, None]
    ks, vs = [], []
    for (k_btkd, v_btkd), k_cache, v_cache in zip(kvs, cache.k, cache.v):
      k_btkd = jnp.where(live_bt[:, :, None, None], k_btkd, 0).astype(k_cache.dtype)
      v_btkd = jnp.where(live_bt[:, :, None, None], v_btkd, 0).astype(v_cache.dtype)
      ks.append(k_cache.at[:, :, :, :t].set(k_btkd.transpose(0, 2, 3, 1)))
      vs.append(v_cache.at[:, :, :t, :].set(v_btkd.transpose(0, 2, 1, 3)))
    out = self.unembed(h), KVCache(k=tuple(ks), v=tuple(vs))
    return (*out, aux.routing_btlk) if return_routing else out

  def extend(self, tokens_bc, start, cache: KVCache, true_lengths_b, *, return_routing: bool = False):
    """Chunked prefill: runs tokens [B, C] at positions [start, start + C) (start: a traced int),
    attending the cache's earlier positions, and writes their K/V into the cache (zeroed past each
    row's true length, as `prefill` does). One compiled program per (B, C, cache length), whatever
    the prompt length. Returns the cache, plus the experts chosen, int32 [B, C, L, k], with
    return_routing."""
    b, c = tokens_bc.shape
    positions = start + jnp.broadcast_to(jnp.arange(c), (b, c))
    live = positions < jnp.asarray(true_lengths_b)[:, None]
    cos, sin = rope_cos_sin(positions, self.cfg)
    x = self.embed_tokens(tokens_bc)
    ks, vs, routed = [], [], []
    for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
      x, k_cache, v_cache, r = layer.extend(x, cos, sin, k_cache, v_cache, start, live)
      ks.append(k_cache)
      vs.append(v_cache)
      routed.append(r)
    cache = KVCache(k=tuple(ks), v=tuple(vs))
    return (cache, _stack_routing(routed, (b, c), self.cfg).routing_btlk) if return_routing else cache

  def decode_step(self, tokens_b, positions_b, cache: KVCache | GroupedKVCache | paged_cache.PagedKVCache,
                  attend_len: int | None, *, routing_blk=None, return_routing: bool = False,
                  plan: paged_cache.PoolPlan | paged_cache.KernelPlan | None = None):
    """One token per row at its own position; attends cache[..., :attend_len] (static int >= max pos + 1).

    With a GroupedKVCache (slot groups) attend_len must be None: each group attends its own cache.
    With a PagedKVCache attend_len is None and `plan` says which blocks each slot reads and writes.
    Returns (logits [B,V] float32, cache with the new K/V written at positions_b), plus the experts
    used, int32 [B,L,k], with return_routing. routing_blk [B,L,k] forces experts (Keep Routing).
    """
    grouped = isinstance(cache, GroupedKVCache)
    paged = isinstance(cache, paged_cache.PagedKVCache)
    if paged != (plan is not None) or (paged and attend_len is not None):
      raise ValueError("decode_step: a PagedKVCache needs plan= and attend_len=None; other caches take no plan")
    if paged and isinstance(plan, paged_cache.KernelPlan) != cache.kernel_layout:
      raise ValueError(f"decode_step: a {type(plan).__name__} does not read a PagedKVCache with "
                       f"kernel_layout={cache.kernel_layout}")
    if paged:
      layer_kv = list(zip(cache.k, cache.v))
    elif grouped:
      if attend_len is not None:
        raise ValueError(f"decode_step: attend_len={attend_len!r} must be None with a GroupedKVCache "
                         "(each slot group attends its own window)")
      if cache.batch_size != tokens_b.shape[0]:
        raise ValueError(f"decode_step: batch {tokens_b.shape[0]} != grouped cache batch {cache.batch_size}")
      layer_kv = [cache.layer(i) for i in range(self.cfg.num_layers)]
    else:
      if not isinstance(attend_len, int) or not 0 < attend_len <= cache.max_len:
        raise ValueError(f"decode_step: attend_len={attend_len!r} must be a static int in [1, {cache.max_len}]")
      layer_kv = list(zip(cache.k, cache.v))
    block = cache.block if grouped else None
    cos, sin = rope_cos_sin(positions_b, self.cfg)  # [B, D]
    x = self.embed_tokens(tokens_b)  # [B, E]
    ks, vs, routed = [], [], []
    forced = _forced(routing_blk, self.cfg, tokens_b.shape, "decode_step")
    for layer, (k_cache, v_cache), f in zip(self.layers, layer_kv, forced):
      x, k_cache, v_cache, r = layer.decode(x, cos, sin, positions_b, k_cache, v_cache, attend_len, f, block, plan)
      ks.append(k_cache)
      vs.append(v_cache)
      routed.append(r)
    if grouped:
      new_cache = GroupedKVCache.from_layers(ks, vs, block)
    elif paged:
      new_cache = paged_cache.PagedKVCache(k=tuple(ks), v=tuple(vs), kernel_layout=cache.kernel_layout)
    else:
      new_cache = KVCache(k=tuple(ks), v=tuple(vs))
    out = self.unembed(self.norm(x)), new_cache
    return (*out, _stack_routing(routed, tokens_b.shape, self.cfg).routing_btlk) if return_routing else out


  def decode_chunk(self, tokens_bt, positions_bt, cache: paged_cache.PagedKVCache,
                   plan: paged_cache.PoolPlan | paged_cache.KernelPlan, written_bt=None):
    """T tokens per row at positions_bt over a paged cache, in one forward (speculative decoding's
    verify: a row's next input and its draft): each token's K/V is written (where written_bt, bool
    [B,T], default all), and each attends its row's positions up to its own. Returns (logits [B,T,V]
    float32, cache)."""
    if not isinstance(cache, paged_cache.PagedKVCache) or plan is None:
      raise ValueError("decode_chunk: needs a PagedKVCache and its plan")
    cos, sin = rope_cos_sin(positions_bt, self.cfg)  # [B, T, D]
    x = self.embed_tokens(tokens_bt)  # [B, T, E]
    ks, vs = [], []
    for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
      x, k_cache, v_cache = layer.decode_chunk(x, cos, sin, positions_bt, k_cache, v_cache, plan, written_bt)
      ks.append(k_cache)
      vs.append(v_cache)
    new_cache = paged_cache.PagedKVCache(k=tuple(ks), v=tuple(vs), kernel_layout=cache.kernel_layout)
    return self.unembed(self.norm(x)), new_cache


def with_attention(model: Transformer, **fields) -> Transformer:
  """`model` with these attention fields of its config replaced (`attention`, `context_parallel_attention`,
  `context_parallel_layout`): for a model loaded with the file's config."""
  cfg = model.cfg.replace(**fields)
  model.cfg = cfg
  for layer in model.layers:
    layer.attn.cfg = cfg
  return model


def check_mesh(mesh: jax.sharding.Mesh) -> None:
  explicit = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit]
  if explicit:
    raise ValueError(f"mesh axes {explicit} are Explicit; tunixlike models need Auto axes "
                     "(build the mesh with jax.sharding.Mesh(devices, names) or axis_types=Auto)")


def create_sharded(cfg: ModelConfig, mesh: jax.sharding.Mesh, rules, seed: int) -> Transformer:
  """Builds a Transformer whose parameters are born sharded on `mesh` (never whole on one device).

  The mesh must use Auto axis types (the `jax.sharding.Mesh` default; `jax.make_mesh` defaults to
  Explicit): the model relies on GSPMD propagation rather than explicit-sharding annotations.
  """
  check_mesh(mesh)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
  graphdef, abstract_state = nnx.split(abstract)
  shardings = sharding_lib.state_shardings(abstract_state, mesh, rules)

  @functools.partial(jax.jit, out_shardings=shardings)
  def init():
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))[1]

  return nnx.merge(graphdef, init())
