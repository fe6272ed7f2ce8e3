"""The per-layer key/value cache for incremental decoding.

K is stored transposed, [B, Hkv, D, S], so that decode attention `q @ K` is a plain batched matmul
over a contiguous [D, S] slab; V is [B, Hkv, S, D] so that `p @ V` is one too. The sequence axis is
last-but-one or last, so `cache[..., :attend_len]` (a static bucket) reads only the live prefix.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tunixlike.models import sharding as sharding_lib

# Logical axis names of the cache arrays (map them to mesh axes with the same rules as parameters).
K_AXES = ("batch", "kv_heads", "head_dim", "seq")
V_AXES = ("batch", "kv_heads", "seq", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # per layer [B, Hkv, D, S]
  v: tuple[jax.Array, ...]  # per layer [B, Hkv, S, D]

  @property
  def batch_size(self) -> int:
    return self.k[0].shape[0]

  @property
  def max_len(self) -> int:
    return self.k[0].shape[-1]

  @classmethod
  def zeros(cls, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, max_len: int,
            dtype) -> KVCache:
    for name, value in (("batch_size", batch_size), ("max_len", max_len)):
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"KVCache: {name}={value!r} must be a positive int")
    k = tuple(jnp.zeros((batch_size, num_kv_heads, head_dim, max_len), dtype) for _ in range(num_layers))
    v = tuple(jnp.zeros((batch_size, num_kv_heads, max_len, head_dim), dtype) for _ in range(num_layers))
    return cls(k=k, v=v)


def cache_shardings(cache: KVCache, mesh: jax.sharding.Mesh, rules) -> KVCache:
  """NamedShardings for `cache` under logical-axis `rules`.

  A dimension whose size does not divide the mesh axis (e.g. 2 KV heads on 4 tensor devices) is
  replicated along it instead of failing: the cache is activations, not parameters, and correctness
  does not depend on its layout.
  """
  def one(x, axes):
    return sharding_lib.named_sharding(x.shape, axes, mesh, rules, strict=False)
  return KVCache(k=tuple(one(x, K_AXES) for x in cache.k), v=tuple(one(x, V_AXES) for x in cache.v))


def write_rows(cache_bkxs: jax.Array, new_bkx: jax.Array, positions_b: jax.Array, seq_axis: int) -> jax.Array:
  """Writes new_bkx[b] at position positions_b[b] along `seq_axis` of row b (a scatter, in place if donated)."""
  b = jnp.arange(cache_bkxs.shape[0])
  if seq_axis == 3:  # K: [B, Hkv, D, S]
    return cache_bkxs.at[b, :, :, positions_b].set(new_bkx.astype(cache_bkxs.dtype), mode="drop")
  if seq_axis == 2:  # V: [B, Hkv, S, D]
    return cache_bkxs.at[b, :, positions_b, :].set(new_bkx.astype(cache_bkxs.dtype), mode="drop")
  raise ValueError(f"write_rows: seq_axis={seq_axis} must be 2 (V) or 3 (K)")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GroupedKVCache:
  """The decode cache split into slot groups, each with its own length (its attended window).

  Continuous batching holds sequences at mixed positions; with one window every row reads the KV of
  the longest one. Groups let a group of short sequences read only its own (shorter) window, while
  the weights are still read once for the whole batch (only attention is split by group).

  Row b of the batch lives in group (b // block) % G at row (b // (G * block)) * block + b % block:
  groups interleave in blocks of `block` rows, so that with the batch split over R data-parallel
  replicas (block = B / (R * G)) every replica holds `block` rows of every group and splitting rows
  by group never moves data between devices.
  """

  groups: tuple[KVCache, ...]
  block: int = dataclasses.field(metadata=dict(static=True))

  @property
  def batch_size(self) -> int:
    return sum(g.batch_size for g in self.groups)

  @property
  def windows(self) -> tuple[int, ...]:
    return tuple(g.max_len for g in self.groups)

  def layer(self, i: int) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Layer i's (k per group, v per group)."""
    return tuple(g.k[i] for g in self.groups), tuple(g.v[i] for g in self.groups)

  @classmethod
  def from_layers(cls, ks, vs, block: int) -> GroupedKVCache:
    """Inverse of `layer`: ks[i][g], vs[i][g] -> GroupedKVCache."""
    groups = tuple(KVCache(k=tuple(k[g] for k in ks), v=tuple(v[g] for v in vs)) for g in range(len(ks[0])))
    return cls(groups=groups, block=block)


def group_of_row(b: int, num_groups: int, block: int) -> tuple[int, int]:
  """(group, row within the group) of batch row b under GroupedKVCache's interleaving."""
  return (b // block) % num_groups, (b // (num_groups * block)) * block + b % block


def split_rows(x_b, num_groups: int, block: int) -> list:
  """[B, ...] -> num_groups arrays [B / G, ...] (GroupedKVCache's row interleaving)."""
  b = x_b.shape[0]
  if b % (num_groups * block):
    raise ValueError(f"split_rows: batch {b} is not a multiple of groups {num_groups} x block {block}")
  x = x_b.reshape(b // (num_groups * block), num_groups, block, *x_b.shape[1:])
  return [x[:, g].reshape(b // num_groups, *x_b.shape[1:]) for g in range(num_groups)]


def merge_rows(parts, block: int):
  """Inverse of split_rows: G arrays [B / G, ...] -> [B, ...]."""
  n = parts[0].shape[0]
  x = jnp.stack([p.reshape(n // block, block, *p.shape[1:]) for p in parts], axis=1)
  return x.reshape(n * len(parts), *parts[0].shape[1:])
