"""Context parallelism: attention over a row split along the sequence over a mesh axis.

A row too long for one device's activations is sharded along T over the N devices of `axis`: each
holds T/N queries and their keys and values, and computes the attention of its own queries with the
blockwise kernel's pieces (`attention.py`). Two ways to bring every key to the queries after it
(`model.context_parallel_attention`, `SCHEMES`):

  ring        ring attention (Liu et al., arXiv 2310.01889): N steps; at each a device folds the K/V
              chunk it holds into its queries' online softmax and passes the chunk on to the next
              device (`lax.ppermute`), so it holds two K/V chunks at a time, never the row's. The
              backward pass (a `jax.custom_vjp`) runs the ring again, recomputing each chunk's
              scores from the saved log-sum-exp; dK and dV travel with their chunk and arrive home
              after N hops. A chunk wholly after a device's queries (causality) or outside the
              window computes nothing. Per-device K/V memory: O(T/N).
  all_gather  all-gathers K and V (Hkv * D values per token, ~1/G of the activations the row already
              has) and runs the blockwise kernel for its queries against every key up to them; the
              all-gather's backward is a reduce-scatter of dK and dV. One collective per layer
              instead of N-1 hops, but each device holds the row's K/V (and their fp32 gradients).

Memory per device otherwise: its T/N queries and [block, block] scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from tunixlike.models import attention
from tunixlike.models.config import CONTEXT_PARALLEL_SCHEMES as SCHEMES


def sequence_rules(rules, axis: str) -> tuple:
  """Activation rules that split a row's tokens (logical 'length') over mesh axis `axis` instead of
  splitting the rows ('batch') over it: the learner's rules with `optim.context_parallel`."""
  return tuple((name, None if name == "batch" else target) for name, target in rules
               if name != "length") + (("length", axis),)


def attend(q_bthd, k_btkd, v_btkd, mesh: Mesh, axis: str, *, segments_bt=None, prefix_bt=None,
           window: int | None = None, block: int = attention.BLOCK, scheme: str = "ring"):
  """Causal attention (attention.py's function) with T sharded over mesh axis `axis`.

  q [B, T, H, D], k / v [B, T, Hkv, D], segments / prefix [B, T]. Returns [B, T, H, D], sharded like
  q. A row that does not split into N chunks of whole blocks is padded at its end (the padded keys
  come after every real query, so causality hides them; the padded queries are cut off).
  """
  if scheme not in SCHEMES:
    raise ValueError(f"context parallel attention scheme {scheme!r}, expected one of {SCHEMES}")
  n = mesh.shape[axis]
  t, h = q_bthd.shape[1], q_bthd.shape[2]
  blk = min(block, -(-t // (8 * n)) * 8)  # a short row: one block of at least 8 tokens per device
  tp = -(-t // (n * blk)) * n * blk
  has_seg = segments_bt is not None
  pad = lambda x, fill=0: x if tp == t else jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2),
                                                    constant_values=fill)
  seg = pad(segments_bt.astype(jnp.int32), -1) if has_seg else jnp.zeros((q_bthd.shape[0], tp), jnp.int32)
  pre = pad(prefix_bt.astype(jnp.int32), -1) if prefix_bt is not None else jnp.zeros_like(seg)
  st = attention.static_args(q_bthd, k_btkd, blk, window, has_seg)
  seq = P(None, axis)

  def all_gather(q, k, v, seg, pre):
    gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
    offset = jax.lax.axis_index(axis) * q.shape[1]
    return attention.blockwise_chunk(q, gather(k), gather(v), offset, seg if has_seg else None,
                                     pre if has_seg else None, gather(seg) if has_seg else None, window, blk)

  def ring(q, k, v, seg, pre):
    blocks = attention.to_blocks(st, q, k, v, seg, pre, seg)
    return attention.from_blocks(_ring(*blocks, st, axis, n), h)

  local = ring if scheme == "ring" else all_gather
  o = jax.shard_map(local, mesh=mesh, in_specs=(seq,) * 5, out_specs=seq, check_vma=False)(
      pad(q_bthd), pad(k_btkd), pad(v_btkd), seg, pre)
  return o[:, :t]


# ---------------------------------------------------------------------------------------- ring
# Inside shard_map: q, k, v, segments are this device's chunk in the kernel's block layout
# (attention.to_blocks); device i holds global blocks [i * Nc, (i + 1) * Nc).

def _hop(axis: str, n: int, *xs):
  """Each of xs passed to the next device of the ring (device i -> i + 1 mod N)."""
  perm = [(i, (i + 1) % n) for i in range(n)]
  return tuple(jax.lax.ppermute(x, axis, perm) for x in xs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _ring(q, k, v, seg_q, pre_q, seg_k, st: attention.Static, axis: str, n: int):
  return _ring_fwd(q, k, v, seg_q, pre_q, seg_k, st, axis, n)[0]


def _ring_fwd(q, k, v, seg_q, pre_q, seg_k, st, axis, n):
  """At step s device i holds the K/V chunk of device i - s and folds it into its online softmax."""
  me, nc = jax.lax.axis_index(axis), q.shape[0]
  fold = lambda s, state, k_s, v_s, seg_s: attention.forward_blocks(
      st, q, k_s, v_s, seg_q, pre_q, seg_s, me * nc, ((me - s) % n) * nc, state)

  def step(s, carry):
    state, k_s, v_s, seg_s = carry
    return (fold(s, state, k_s, v_s, seg_s),) + _hop(axis, n, k_s, v_s, seg_s)

  state, k_s, v_s, seg_s = jax.lax.fori_loop(0, n - 1, step, (attention.softmax_init(q), k, v, seg_k))
  o, lse = attention.softmax_finish(fold(n - 1, state, k_s, v_s, seg_s), q.dtype)  # the last chunk stays
  return o, (q, k, v, seg_q, pre_q, seg_k, o, lse)


def _ring_bwd(st, axis, n, res, do):
  """The ring again: each step adds a chunk's part to dQ here and to the dK / dV that travel with
  the chunk; a last hop brings every dK / dV chunk home."""
  q, k, v, seg_q, pre_q, seg_k, o, lse = res
  me, nc = jax.lax.axis_index(axis), q.shape[0]
  delta = attention.output_delta(do, o)
  grads = lambda s, dq, k_s, v_s, seg_s: attention.backward_blocks(
      st, q, k_s, v_s, seg_q, pre_q, seg_s, me * nc, ((me - s) % n) * nc, do, lse, delta, dq)

  def step(s, carry):
    dq, k_s, v_s, seg_s, dk_s, dv_s = carry
    dq, dk, dv = grads(s, dq, k_s, v_s, seg_s)
    return (dq,) + _hop(axis, n, k_s, v_s, seg_s, dk_s + dk, dv_s + dv)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dq, k_s, v_s, seg_s, dk_s, dv_s = jax.lax.fori_loop(
      0, n - 1, step, (jnp.zeros(q.shape, jnp.float32), k, v, seg_k, zeros, zeros))
  dq, dk, dv = grads(n - 1, dq, k_s, v_s, seg_s)
  dk, dv = _hop(axis, n, dk_s + dk, dv_s + dv)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
