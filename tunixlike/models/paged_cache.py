"""The paged decode cache: a pool of fixed-size KV blocks per layer, read through block tables.

Per layer and sampler replica (each owns its slots and its NB blocks) K and V are pools of blocks
of `bs` positions. Which blocks a slot reads is host bookkeeping (`sampler.blocks`); each decode
call gets a plan built from the block tables. Two ways to attend, chosen when the engine is built:

* `PoolPlan` (plain JAX, every backend): each block of the pool is attended once, by the slot that
  owns it, in place: scores of [G, D] queries against [D, bs] keys per block, a softmax per block,
  then the blocks of a slot combined (flash-decoding's rescaling, as segment sums over owners). The
  work is the pool's size whatever the slots' lengths, and nothing is copied. Blocks more than one
  slot reads (a group's shared prompt) are owned by one and listed again, gathered, for the others.
  K is [R, Hkv, NB, D, bs] here (positions minor, as in the contiguous cache: the per-block score
  matmul is several times faster than with [bs, D]). Gathering every slot's blocks into a window
  instead was measured 9x slower on CPU: the copy of every slot's window, each padded to the longest.
* `KernelPlan` (TPU): the Pallas kernel (`jax.experimental.pallas.ops.tpu.paged_attention`) reads
  the block tables itself and stops at each slot's length; K and V are [R, Hkv, NB, bs, D].
Both give the same numbers within fp tolerance.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from tunixlike.models import sharding as sharding_lib

_AXES = ("batch", "kv_heads", None, None, None)  # replicas over the mesh's 'replica' axis, KV heads over 'tensor'


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
  k: tuple[jax.Array, ...]  # per layer [R, Hkv, NB, D, bs] (pool layout) or [R, Hkv, NB, bs, D] (kernel)
  v: tuple[jax.Array, ...]  # per layer [R, Hkv, NB, bs, D]
  kernel_layout: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @property
  def replicas(self) -> int:
    return self.v[0].shape[0]

  @property
  def num_blocks(self) -> int:
    """Blocks per replica."""
    return self.v[0].shape[2]

  @property
  def block_size(self) -> int:
    return self.v[0].shape[3]

  @classmethod
  def zeros(cls, num_layers: int, replicas: int, num_kv_heads: int, num_blocks: int, block_size: int,
            head_dim: int, dtype, kernel_layout: bool = False) -> PagedKVCache:
    v_shape = (replicas, num_kv_heads, num_blocks, block_size, head_dim)
    k_shape = v_shape if kernel_layout else (replicas, num_kv_heads, num_blocks, head_dim, block_size)
    return cls(k=tuple(jnp.zeros(k_shape, dtype) for _ in range(num_layers)),
               v=tuple(jnp.zeros(v_shape, dtype) for _ in range(num_layers)), kernel_layout=kernel_layout)

  def shardings(self, mesh: jax.sharding.Mesh, rules) -> PagedKVCache:
    one = lambda x: sharding_lib.named_sharding(x.shape, _AXES, mesh, rules, strict=False)
    return PagedKVCache(k=tuple(one(x) for x in self.k), v=tuple(one(x) for x in self.v),
                        kernel_layout=self.kernel_layout)


def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, itemsize: int) -> int:
  """K and V of one block in every layer."""
  return 2 * num_layers * num_kv_heads * block_size * head_dim * itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PoolPlan:
  """Who reads each pool block in one decode call, per replica r (slots are local indices 0..Sr-1):

  owner [R, NB]: the slot that attends block b in place (Sr: nobody; the block is skipped), for
    every block of the pool array (which the engine sizes to the blocks up to the highest in use);
  column [R, NB]: the block's index in its owner's table (it holds positions column * bs + [0, bs));
  extra [R, X, 3]: (block, slot, column) of every other reference to a shared block (slot Sr: padding).
  A live slot writes its step's K/V into the block it owns at its position's column.
  """

  owner: jax.Array
  column: jax.Array
  extra: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KernelPlan:
  """tables [R, Sr, M]: each slot's first M blocks (M: a static bucket covering the longest live
  sequence in this call; entries past a slot's length are never read); live [R, Sr]: the slot holds a
  sequence (the others write nothing)."""

  tables: jax.Array
  live: jax.Array


def _write(pool, new_sd, blocks_s, offsets_s, positions_minor: bool):
  """new_sd[i] ([Hkv, D] per slot) at block blocks_s[i], offset offsets_s[i]; out-of-range ids drop."""
  if positions_minor:  # [Hkv, NB, D, bs]: the indexed dims lead the update
    return pool.at[:, blocks_s, :, offsets_s].set(new_sd.astype(pool.dtype), mode="drop")
  return pool.at[:, blocks_s, offsets_s, :].set(new_sd.transpose(1, 0, 2).astype(pool.dtype), mode="drop")


def _pool_attend(q_stkgd, k_pool, v_pool, positions_st, owner_n, column_n, extra_x3):
  """One replica: every owned block attended in place by its owner, shared blocks' other readers
  through `extra` (gathered); the blocks of each slot combined by rescaling their softmax sums.
  Each slot has T queries (T > 1: a speculative verify forward), query t at positions_st[s, t]."""
  slots, _, _, _, d = q_stkgd.shape
  bs = v_pool.shape[2]
  # Each block's query by a one-hot matmul over this copy, not a gather: XLA fuses the query's
  # producers (RoPE's sines and cosines) into a gather and computes them again for every block
  # (measured: as long as the attention itself); the barrier keeps them out of the matmul too.
  # Exact: one term per sum; padding reads zeros.
  q_kstgd = jax.lax.optimization_barrier(jnp.moveaxis(q_stkgd, 2, 0).astype(k_pool.dtype))

  def per_block(k_kndj, v_knjd, slot_n, column):
    reader = jnp.minimum(slot_n, slots - 1)
    q_kntgd = jnp.einsum("ns,kstgd->kntgd", jax.nn.one_hot(slot_n, slots, dtype=q_kstgd.dtype), q_kstgd,
                         precision=jax.lax.Precision.HIGHEST)
    s = jnp.einsum("kntgd,kndj->kntgj", q_kntgd, k_kndj, preferred_element_type=jnp.float32)
    # Positions past the query's (and every position of a block nobody reads) get -1e30 added: an
    # add that fuses into the softmax's passes, where a select would be a pass of its own. exp of a
    # masked score is 0; a block with none unmasked has m = -1e30, and its weight in the combination
    # below, exp(m - the slot's max), is 0 (every live slot's first position is unmasked).
    at_ntj = (column[:, None] * bs + jnp.arange(bs))[:, None, :]
    valid = (slot_n < slots)[:, None, None] & (at_ntj <= positions_st[reader][:, :, None])  # [n, T, bs]
    s = s / math.sqrt(d) + jnp.where(valid, 0.0, -1e30)[None, :, :, None, :]
    m = s.max(-1)  # [Hkv, n, T, G]
    e = jnp.exp(s - m[..., None])
    pv = jnp.einsum("kntgj,knjd->kntgd", e.astype(v_knjd.dtype), v_knjd, preferred_element_type=jnp.float32)
    return m, e.sum(-1), pv

  parts = [per_block(k_pool, v_pool, owner_n, column_n) + (owner_n,)]
  if extra_x3.shape[0]:
    block, slot, column = extra_x3[:, 0], extra_x3[:, 1], extra_x3[:, 2]
    parts.append(per_block(k_pool[:, block], v_pool[:, block], slot, column) + (slot,))
  m, l, pv, slot_n = (jnp.concatenate(x, axis=1 if i < 3 else 0) for i, x in enumerate(zip(*parts)))
  to_slots = lambda x, op: op(jnp.moveaxis(x, 1, 0), slot_n, num_segments=slots + 1)[:slots]
  m_slot = to_slots(m, jax.ops.segment_max)  # [S, Hkv, T, G]
  w = jnp.exp(m - jnp.moveaxis(jnp.concatenate([m_slot, m_slot[:1]])[slot_n], 0, 1))  # [Hkv, n, T, G]
  den = to_slots(w * l, jax.ops.segment_sum)
  num = to_slots(pv * w[..., None], jax.ops.segment_sum)  # [S, Hkv, T, G, D]
  o = num / jnp.where(den > 0, den, 1.0)[..., None]  # an empty slot: zeros
  return jnp.moveaxis(o, 1, 2)  # [S, T, Hkv, G, D]


def _kernel_attend(q_stkgd, k_pool, v_pool, positions_st, tables_sm):
  """One replica through the Pallas TPU kernel: each slot's table, lengths = position + 1 (a slot's T
  queries as T rows reading the same table, each to its own length)."""
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
  s, t, kv, g, d = q_stkgd.shape
  q = (q_stkgd.astype(jnp.float32) / math.sqrt(d)).astype(k_pool.dtype).reshape(s * t, kv * g, d)
  pages = tables_sm.shape[1]
  per_block = max(c for c in range(1, min(pages, 8) + 1) if pages % c == 0)
  o = paged_attention(q, k_pool, v_pool, positions_st.reshape(-1) + 1, jnp.repeat(tables_sm, t, axis=0),
                      pages_per_compute_block=per_block)
  return o.reshape(s, t, kv, g, d).astype(jnp.float32)


def attend(q_btkgd, k_btkd, v_btkd, positions_bt, cache_k, cache_v, plan: PoolPlan | KernelPlan, written_bt=None):
  """Writes the K/V of each slot's T new tokens at positions_bt through the plan, then attends each
  slot's blocks, query t up to its own position (T = 1: a decode step; more: a verify forward).

  q [B, T, Hkv, G, D] with B = R * Sr slots (replica-major); k/v [B, T, Hkv, D]; cache_k / cache_v
  one layer's pools, in the layout of the plan's kind. Only positions where `written_bt` (bool [B, T],
  default all) holds are written: a verify forward's padding past a short draft may lie past the blocks
  its slot holds. Returns (o [B, T, Hkv, G, D], cache_k, cache_v).
  """
  r, _, num_blocks, bs = cache_v.shape[:4]
  by_replica = lambda x: x.reshape(r, x.shape[0] // r, *x.shape[1:])
  q, k_new, v_new, positions = (by_replica(x) for x in (q_btkgd, k_btkd, v_btkd, positions_bt))
  col = positions // bs  # [R, Sr, T]
  kernel = isinstance(plan, KernelPlan)
  if kernel:
    width = plan.tables.shape[-1]
    blocks = jnp.take_along_axis(plan.tables, jnp.clip(col, 0, width - 1), axis=-1)
    blocks = jnp.where(plan.live[..., None] & (col < width), blocks, num_blocks)
  else:  # the block the slot owns at that column (none for an empty slot)
    mine = (plan.owner[:, None, None, :] == jnp.arange(col.shape[1])[None, :, None, None]) & (
        plan.column[:, None, None, :] == col[..., None])  # [R, Sr, T, NB]
    blocks = jnp.where(mine.any(-1), mine.argmax(-1), num_blocks)
  if written_bt is not None:
    blocks = jnp.where(by_replica(written_bt), blocks, num_blocks)
  offsets = positions % bs
  flat = lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])  # one replica's [Sr, T, ...] -> [Sr * T, ...]
  write = lambda pool, new, minor: jax.vmap(lambda p, n, b, o: _write(p, flat(n), flat(b), flat(o), minor))(
      pool, new, blocks, offsets)
  cache_k, cache_v = write(cache_k, k_new, not kernel), write(cache_v, v_new, False)
  if kernel:
    o = jax.vmap(_kernel_attend)(q, cache_k, cache_v, positions, plan.tables)
  else:
    o = jax.vmap(_pool_attend)(q, cache_k, cache_v, positions, plan.owner, plan.column, plan.extra)
  return o.reshape(q_btkgd.shape), cache_k, cache_v
