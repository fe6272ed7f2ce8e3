"""Context parallelism: attention over a row split along the sequence over a mesh axis.

A row too long for one device's activations is sharded along T over the N devices of `axis`: each
holds T/N queries and their keys and values. `attend` all-gathers K and V (linear in T: Hkv * D
values per token, ~1/G of the activations the row already has) and runs the blockwise kernel
(`attention.blockwise_chunk`) for its own queries against every key up to them; the backward pass of
the all-gather is a reduce-scatter of dK and dV, so each device ends with the gradients of its own
keys. Memory per device: its T/N queries, the row's K and V, and [block, block] scores.
A ring (`lax.ppermute` of K/V blocks, overlapping transfer and compute) would hold only two K/V
chunks at a time; the all-gather is the simpler equivalent while K/V of the whole row fit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from tunixlike.models import attention


def sequence_rules(rules, axis: str) -> tuple:
  """Activation rules that split a row's tokens (logical 'length') over mesh axis `axis` instead of
  splitting the rows ('batch') over it: the learner's rules with `optim.context_parallel`."""
  return tuple((name, None if name == "batch" else target) for name, target in rules
               if name != "length") + (("length", axis),)


def attend(q_bthd, k_btkd, v_btkd, mesh: Mesh, axis: str, *, segments_bt=None, prefix_bt=None,
           window: int | None = None, block: int = attention.BLOCK):
  """Causal attention (attention.py's function) with T sharded over mesh axis `axis`.

  q [B, T, H, D], k / v [B, T, Hkv, D], segments / prefix [B, T]. Returns [B, T, H, D], sharded like
  q. A row that does not split into N chunks of whole blocks is padded at its end (the padded keys
  come after every real query, so causality hides them; the padded queries are cut off).
  """
  n = mesh.shape[axis]
  t = q_bthd.shape[1]
  blk = min(block, -(-t // (8 * n)) * 8)  # a short row: one block of at least 8 tokens per device
  tp = -(-t // (n * blk)) * n * blk
  has_seg = segments_bt is not None
  pad = lambda x, fill=0: x if tp == t else jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2),
                                                    constant_values=fill)
  seg = pad(segments_bt.astype(jnp.int32), -1) if has_seg else jnp.zeros((q_bthd.shape[0], tp), jnp.int32)
  pre = pad(prefix_bt.astype(jnp.int32), -1) if prefix_bt is not None else jnp.zeros_like(seg)
  seq = P(None, axis)

  def local(q, k, v, seg, pre):
    gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
    offset = jax.lax.axis_index(axis) * q.shape[1]
    return attention.blockwise_chunk(q, gather(k), gather(v), offset, seg if has_seg else None,
                                     pre if has_seg else None, gather(seg) if has_seg else None, window, blk)

  o = jax.shard_map(local, mesh=mesh, in_specs=(seq,) * 5, out_specs=seq, check_vma=False)(
      pad(q_bthd), pad(k_btkd), pad(v_btkd), seg, pre)
  return o[:, :t]
