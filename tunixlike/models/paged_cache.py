"""The paged decode cache: a pool of fixed-size KV blocks per layer, read through block tables.

Per layer, K and V are each [R, Hkv, NB, bs, D]: R sampler replicas (each owns its slots and its
NB blocks), then the layout of the Pallas TPU paged-attention kernel ([Hkv, pages, page_size, D]).
Which blocks a slot reads is host bookkeeping (`sampler.blocks`); a decode call gets a `DecodePlan`
built from the block tables.

Decode attention reads only live blocks ("ragged"): the plan lists, per replica, every block of
every live slot as an entry (slot, block, first position), padded to a static count. Scores are
computed per entry and combined per slot with segment max / sum (the flash-decoding reduction), so
a step reads each sequence's own KV, not every slot padded to the longest one. On TPU the Pallas
kernel (`jax.experimental.pallas.ops.tpu.paged_attention`) reads the block tables directly; the
choice is made when the engine is built (`use_kernel`), and both agree within fp tolerance.
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

  entry_block / entry_slot / entry_start [R, N]: block ids, local slots and first positions of the
    live blocks; padding entries name slot Sr (dropped by the segment reductions).
  write_blocks [R, Sr, W]: the blocks covering positions first_block * bs ... of each slot in this
    call (W = blocks a call of steps_per_call tokens can touch), NB = none (the write is dropped).
  first_block [R, Sr]: index in the slot's table of write_blocks[..., 0].
  tables [R, Sr, MB]: whole block tables, only for the Pallas kernel (None otherwise).
  """

  entry_block: jax.Array
  entry_slot: jax.Array
  entry_start: jax.Array
  write_blocks: jax.Array
  first_block: jax.Array
  tables: jax.Array | None = None


def _write(pool_hnbd, new_sd, blocks_s, offsets_s):
  """new_sd[i] ([Hkv, D] per slot) at block blocks_s[i], offset offsets_s[i]; out-of-range ids drop."""
  return pool_hnbd.at[:, blocks_s, offsets_s, :].set(new_sd.transpose(1, 0, 2).astype(pool_hnbd.dtype),
                                                     mode="drop")


def _ragged_attend(q_skgd, k_pool, v_pool, positions_s, entry_block, entry_slot, entry_start):
  """One replica: each slot attends positions [0, position] of its blocks listed in the entries."""
  num_slots = q_skgd.shape[0]
  block_size = k_pool.shape[2]
  k_blocks = k_pool[:, entry_block]  # [Hkv, N, bs, D]: only the live blocks are read
  v_blocks = v_pool[:, entry_block]
  q = jnp.take(q_skgd, entry_slot, axis=0, mode="clip").astype(k_pool.dtype)  # [N, Hkv, G, D]
  s = jnp.einsum("nkgd,knbd->nkgb", q, k_blocks, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
  position = jnp.take(positions_s, entry_slot, mode="clip")
  valid = (entry_start[:, None] + jnp.arange(block_size)[None, :] <= position[:, None]) \
      & (entry_slot < num_slots)[:, None]  # [N, bs]
  s = jnp.where(valid[:, None, None, :], s, -1e30)
  peak = jax.ops.segment_max(s.max(-1), entry_slot, num_slots, indices_are_sorted=True)  # [Sr, Hkv, G]
  p = jnp.exp(s - jnp.take(peak, entry_slot, axis=0, mode="clip")[..., None])
  p = jnp.where(valid[:, None, None, :], p, 0.0)
  total = jax.ops.segment_sum(p.sum(-1), entry_slot, num_slots, indices_are_sorted=True)
  o = jnp.einsum("nkgb,knbd->nkgd", p.astype(v_pool.dtype), v_blocks, preferred_element_type=jnp.float32)
  o = jax.ops.segment_sum(o, entry_slot, num_slots, indices_are_sorted=True)
  return o / jnp.where(total > 0, total, 1.0)[..., None]


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
  """Writes this step's K/V at positions_b through the plan, then attends each slot's blocks.

  q [B, Hkv, G, D] with B = R * Sr slots (replica-major); k/v [B, Hkv, D]. Returns
  (o [B, Hkv, G, D], k_pool, v_pool).
  """
  r = k_pool.shape[0]
  block_size = k_pool.shape[3]
  by_replica = lambda x: x.reshape(r, x.shape[0] // r, *x.shape[1:])
  q, k_new, v_new, positions = (by_replica(x) for x in (q_bkgd, k_bkd, v_bkd, positions_b))
  col = positions // block_size - plan.first_block  # [R, Sr]
  width = plan.write_blocks.shape[-1]
  blocks = jnp.take_along_axis(plan.write_blocks, jnp.clip(col, 0, width - 1)[..., None], axis=-1)[..., 0]
  blocks = jnp.where((col >= 0) & (col < width), blocks, k_pool.shape[2])  # outside the plan: dropped
  offsets = positions % block_size
  k_pool = jax.vmap(_write)(k_pool, k_new, blocks, offsets)
  v_pool = jax.vmap(_write)(v_pool, v_new, blocks, offsets)
  if plan.tables is not None:
    o = jax.vmap(_kernel_attend)(q, k_pool, v_pool, positions, plan.tables)
  else:
    o = jax.vmap(_ragged_attend)(q, k_pool, v_pool, positions, plan.entry_block, plan.entry_slot,
                                 plan.entry_start)
  return o.reshape(q_bkgd.shape), k_pool, v_pool
