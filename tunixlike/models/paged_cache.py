"""The paged decode cache: a pool of fixed-size KV blocks per layer, read through block tables.

Per layer, K and V are each [R, Hkv, NB, bs, D]: R sampler replicas (each owns its slots and its
NB blocks), then the layout of the Pallas TPU paged-attention kernel ([Hkv, pages, page_size, D]).
Which blocks a slot reads is host bookkeeping (`sampler.blocks`); a decode call gets a `DecodePlan`
built from the block tables.

Decode attention reads each slot's blocks through its table, up to a static number of blocks
covering the longest live sequence (one compiled program per power of two). In plain JAX the
blocks are gathered into a window and attended as the contiguous cache is (a gather of only the
live blocks, entry by entry, was measured 2x slower on CPU: thousands of tiny matmuls instead of a
few large ones). On TPU the Pallas kernel (`jax.experimental.pallas.ops.tpu.paged_attention`)
reads the tables directly and stops at each slot's length; the engine chooses at build time
(`DecodePlan.use_kernel`), and both agree within fp tolerance.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from tunixlike.models import sharding as sharding_lib

POOL_AXES = ("batch", "kv_heads", None, None, "head_dim")  # [R, Hkv, NB, bs, D]: R over the replicas


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
  k: tuple[jax.Array, ...]  # per layer [R, Hkv, NB, bs, D]
  v: tuple[jax.Array, ...]

  @property
  def replicas(self) -> int:
    return self.k[0].shape[0]

  @property
  def num_blocks(self) -> int:
    """Blocks per replica."""
    return self.k[0].shape[2]

  @property
  def block_size(self) -> int:
    return self.k[0].shape[3]

  @classmethod
  def zeros(cls, num_layers: int, replicas: int, num_kv_heads: int, num_blocks: int, block_size: int,
            head_dim: int, dtype) -> PagedKVCache:
    shape = (replicas, num_kv_heads, num_blocks, block_size, head_dim)
    return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
               v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))

  def shardings(self, mesh: jax.sharding.Mesh, rules) -> PagedKVCache:
    """Replicas over the mesh's 'replica' axis (rules map 'batch' there), KV heads over 'tensor'."""
    one = lambda x: sharding_lib.named_sharding(x.shape, POOL_AXES, mesh, rules, strict=False)
    return PagedKVCache(k=tuple(one(x) for x in self.k), v=tuple(one(x) for x in self.v))


def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, itemsize: int) -> int:
  """K and V of one block in every layer."""
  return 2 * num_layers * num_kv_heads * block_size * head_dim * itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodePlan:
  """What one decode call reads and writes, per replica r and its local slot i (of Sr):

  tables [R, Sr, M]: each slot's first M blocks (M: a static bucket covering the longest live
    sequence's positions in this call; unused entries are masked by position). A live slot writes
    its step's K/V into the block of its table holding its position.
  live [R, Sr]: the slot holds a sequence (the others write nothing).
  use_kernel: attend with the Pallas TPU kernel (static: chosen when the engine is built).
  """

  tables: jax.Array
  live: jax.Array
  use_kernel: bool = dataclasses.field(default=False, metadata=dict(static=True))


def _write(pool_hnbd, new_sd, blocks_s, offsets_s):
  """new_sd[i] ([Hkv, D] per slot) at block blocks_s[i], offset offsets_s[i]; out-of-range ids drop."""
  return pool_hnbd.at[:, blocks_s, offsets_s, :].set(new_sd.transpose(1, 0, 2).astype(pool_hnbd.dtype),
                                                     mode="drop")


def _gather_attend(q_skgd, k_pool, v_pool, positions_s, tables_sm):
  """One replica: each slot's blocks gathered into a [M * bs] window, attended up to its position."""
  hkv, _, bs, d = k_pool.shape
  slots, m = tables_sm.shape
  k = k_pool[:, tables_sm].reshape(hkv, slots, m * bs, d)  # [Hkv, Sr, L, D]
  v = v_pool[:, tables_sm].reshape(hkv, slots, m * bs, d)
  q = q_skgd.astype(k_pool.dtype)
  s = jnp.einsum("skgd,ksld->skgl", q, k, preferred_element_type=jnp.float32) / math.sqrt(d)
  valid = jnp.arange(m * bs)[None, :] <= positions_s[:, None]  # [Sr, L]
  p = jax.nn.softmax(jnp.where(valid[:, None, None, :], s, -1e30), axis=-1).astype(v_pool.dtype)
  return jnp.einsum("skgl,ksld->skgd", p, v, preferred_element_type=jnp.float32)


def _kernel_attend(q_skgd, k_pool, v_pool, positions_s, tables_sm):
  """One replica through the Pallas TPU kernel: each slot's table, lengths = position + 1."""
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
  s, kv, g, d = q_skgd.shape
  q = (q_skgd.astype(jnp.float32) / math.sqrt(d)).astype(k_pool.dtype).reshape(s, kv * g, d)
  pages = tables_sm.shape[1]
  per_block = max(c for c in range(1, min(pages, 8) + 1) if pages % c == 0)
  o = paged_attention(q, k_pool, v_pool, positions_s + 1, tables_sm, pages_per_compute_block=per_block)
  return o.reshape(s, kv, g, d).astype(jnp.float32)


def attend(q_bkgd, k_bkd, v_bkd, positions_b, k_pool, v_pool, plan: DecodePlan):
  """Writes this step's K/V at positions_b through the plan, then attends each slot's blocks (with
  the Pallas kernel if `plan.use_kernel`, else a gather into a window in plain JAX).

  q [B, Hkv, G, D] with B = R * Sr slots (replica-major); k/v [B, Hkv, D]. Returns
  (o [B, Hkv, G, D], k_pool, v_pool).
  """
  r = k_pool.shape[0]
  block_size = k_pool.shape[3]
  by_replica = lambda x: x.reshape(r, x.shape[0] // r, *x.shape[1:])
  q, k_new, v_new, positions = (by_replica(x) for x in (q_bkgd, k_bkd, v_bkd, positions_b))
  col = positions // block_size  # [R, Sr]
  width = plan.tables.shape[-1]
  blocks = jnp.take_along_axis(plan.tables, jnp.clip(col, 0, width - 1)[..., None], axis=-1)[..., 0]
  blocks = jnp.where(plan.live & (col < width), blocks, k_pool.shape[2])  # empty slots: dropped
  offsets = positions % block_size
  k_pool = jax.vmap(_write)(k_pool, k_new, blocks, offsets)
  v_pool = jax.vmap(_write)(v_pool, v_new, blocks, offsets)
  o = jax.vmap(_kernel_attend if plan.use_kernel else _gather_attend)(q, k_pool, v_pool, positions, plan.tables)
  return o.reshape(q_bkgd.shape), k_pool, v_pool
