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

Which tokens a device holds (`model.context_parallel_layout`, `LAYOUTS`): under a causal mask the
later tokens attend to more keys: with the row cut into N contiguous chunks of C = T/N tokens,
device i computes (i + 1/2) C^2 (query, key) pairs, device 0 half a chunk's, device N-1 almost N
times as many; a ring step waits for the busiest device.

  zigzag      the row cut into 2N runs, device i holding runs i and 2N-1-i (one early, one late):
              every device computes N/2 C^2 pairs (Megatron-LM's load-balanced context
              parallelism; zigzag ring attention, github.com/zhuzilin/ring-flash-attention). The model reorders the row once, before its
              first layer, and back after its last (`to_layout` / `from_layout`: two `ppermute`s of
              half-chunks each way), with the positions and segment ids, so that each layer's
              attention sees its device's runs and their global block offsets.
  contiguous  device i holds tokens [i T/N, (i+1) T/N): no reordering; device i's queries see i+1
              of the N key chunks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from tunixlike.models import attention
from tunixlike.models.config import CONTEXT_PARALLEL_LAYOUTS as LAYOUTS, CONTEXT_PARALLEL_SCHEMES as SCHEMES


def sequence_rules(rules, axis: str) -> tuple:
  """Activation rules that split a row's tokens (logical 'length') over mesh axis `axis` instead of
  splitting the rows ('batch') over it: the learner's rules with `optim.context_parallel`."""
  return tuple((name, None if name == "batch" else target) for name, target in rules
               if name != "length") + (("length", axis),)


def runs(layout: str, n: int) -> tuple[tuple[int, ...], ...]:
  """Per device, the global indices of the runs of the row it holds, in its order: the row is cut
  into N runs (contiguous) or 2N (zigzag: device i holds runs i and 2N-1-i)."""
  if layout not in LAYOUTS:
    raise ValueError(f"context parallel layout {layout!r}, expected one of {LAYOUTS}")
  return tuple((d,) if layout == "contiguous" else (d, 2 * n - 1 - d) for d in range(n))


def padded_length(t: int, n: int, layout: str, block: int = attention.BLOCK) -> tuple[int, int]:
  """(block, T padded): the row cut into runs of whole blocks over n devices (a short row: one block
  of at least 8 tokens per run)."""
  r = n * len(runs(layout, 1)[0])
  blk = min(block, -(-t // (8 * r)) * 8)
  return blk, -(-t // (r * blk)) * r * blk


def to_layout(tree, mesh: Mesh, axis: str, layout: str):
  """Arrays [B, T, ...] (T a multiple of 2N), their tokens in row order split over `axis` -> in
  `layout`'s order (zigzag: each device's second half-chunk swapped for a later one)."""
  return tree if layout == "contiguous" else _zigzag(tree, mesh, axis, inverse=False)


def from_layout(tree, mesh: Mesh, axis: str, layout: str):
  """`to_layout`'s inverse: the tokens back in row order."""
  return tree if layout == "contiguous" else _zigzag(tree, mesh, axis, inverse=True)


def _zigzag(tree, mesh: Mesh, axis: str, inverse: bool):
  """Half-chunk c of the row (device c // 2, slot c % 2 in row order) goes to device c, slot 0 if
  c < N, else to device 2N-1-c, slot 1. One ppermute per slot of the sender: both are permutations
  (two even, or two odd, half-chunks never share a device); the receiver puts each where it belongs."""
  n = mesh.shape[axis]
  home = lambda c: (c, 0) if c < n else (2 * n - 1 - c, 1)
  perms = [[(d, home(2 * d + s)[0]) for d in range(n)] for s in (0, 1)]
  # the zigzag slot of the half-chunk that slot 0's ppermute brings to each device
  slot_of_even = jnp.asarray([home(2 * d)[1] for d, _ in sorted(perms[0], key=lambda p: p[1])])

  def local(tree):
    swap = slot_of_even[jax.lax.axis_index(axis)] == 1
    pick = lambda a, b: jnp.where(swap, b, a)

    def one(x):
      x0, x1 = jnp.split(x, 2, axis=1)
      if not inverse:
        e, o = (jax.lax.ppermute(h, axis, p) for h, p in zip((x0, x1), perms))
        return jnp.concatenate([pick(e, o), pick(o, e)], axis=1)
      back = [jax.lax.ppermute(h, axis, [(b, a) for a, b in p]) for h, p in zip((pick(x0, x1), pick(x1, x0)), perms)]
      return jnp.concatenate(back, axis=1)

    return jax.tree.map(one, tree)

  seq = P(None, axis)
  return jax.shard_map(local, mesh=mesh, in_specs=(seq,), out_specs=seq, check_vma=False)(tree)


def causal_block_pairs(layout: str, n: int, run_blocks: int) -> list[int]:
  """Per device, the (query block, key block) pairs its attention computes over a causal row of
  n * R runs of `run_blocks` blocks (no segments, no window): query block g sees key blocks 0..g,
  wherever they are. The work balance of a layout (benchmarks/long_context.py)."""
  return [sum(r * run_blocks + i + 1 for r in mine for i in range(run_blocks)) for mine in runs(layout, n)]


class RowSplit(NamedTuple):
  """A row whose tokens a model splits over mesh axis `axis` in `layout`'s order: `enter` pads its
  per-token inputs to `padded_length` (after every real token, so causality hides the padding) and
  reorders them; `leave` puts the outputs back in row order, cut to the row's length."""

  mesh: Mesh
  axis: str
  layout: str

  def enter(self, tokens_bt, positions_bt, segments_bt, prefix_bt, forced):
    """(tokens, positions, segments, prefix, per-layer forced experts [B, T, k] or Nones), reordered."""
    t = tokens_bt.shape[1]
    tp = padded_length(t, self.mesh.shape[self.axis], self.layout)[1]
    pad = lambda x, fill: None if x is None else jnp.pad(
        x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return to_layout((pad(tokens_bt, 0), pad(positions_bt, 0), pad(segments_bt, -1), pad(prefix_bt, -1),
                      [pad(f, -1) for f in forced]), self.mesh, self.axis, self.layout)  # -1: the router's own

  def leave(self, t: int, tree):
    """Arrays [B, T padded, ...] of the forward -> [B, t, ...] in row order."""
    return jax.tree.map(lambda x: x[:, :t], from_layout(tree, self.mesh, self.axis, self.layout))


def attend(q_bthd, k_btkd, v_btkd, mesh: Mesh, axis: str, *, segments_bt=None, prefix_bt=None,
           window: int | None = None, block: int = attention.BLOCK, scheme: str = "ring",
           layout: str = "contiguous"):
  """Causal attention (attention.py's function) with T sharded over mesh axis `axis`.

  q [B, T, H, D], k / v [B, T, Hkv, D], segments / prefix [B, T], their tokens in `layout`'s order
  (`to_layout`). Returns [B, T, H, D] in that order, sharded like q. In the contiguous layout a row
  that does not split into N chunks of whole blocks is padded at its end (the padded keys come after
  every real query, so causality hides them; the padded queries are cut off); the zigzag layout
  takes rows already padded to `padded_length` (the model pads before reordering).
  """
  if scheme not in SCHEMES:
    raise ValueError(f"context parallel attention scheme {scheme!r}, expected one of {SCHEMES}")
  n = mesh.shape[axis]
  t, h = q_bthd.shape[1], q_bthd.shape[2]
  blk, tp = padded_length(t, n, layout, block)
  if tp != t and layout != "contiguous":
    raise ValueError(f"context parallel attention: a {layout} row of {t} tokens over {n} devices must be padded "
                     f"to {tp} (padded_length) before to_layout")
  row_runs = runs(layout, n)
  has_seg = segments_bt is not None
  pad = lambda x, fill=0: x if tp == t else jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2),
                                                    constant_values=fill)
  seg = pad(segments_bt.astype(jnp.int32), -1) if has_seg else jnp.zeros((q_bthd.shape[0], tp), jnp.int32)
  pre = pad(prefix_bt.astype(jnp.int32), -1) if prefix_bt is not None else jnp.zeros_like(seg)
  st = attention.static_args(q_bthd, k_btkd, blk, window, has_seg)
  seq = P(None, axis)

  def all_gather(q, k, v, seg, pre):
    # the gathered row in device order, its runs put back in row order: keys at global offset 0
    gathered = [r for device in row_runs for r in device]  # the global run at each place of the gathered row

    def gather(x):
      parts = jnp.split(jax.lax.all_gather(x, axis, axis=1, tiled=True), len(gathered), axis=1)
      return jnp.concatenate([parts[gathered.index(g)] for g in range(len(gathered))], axis=1)

    k_all, v_all, seg_all = gather(k), gather(v), gather(seg) if has_seg else None
    n_runs = len(row_runs[0])
    run_len = q.shape[1] // n_runs
    starts = jnp.asarray(row_runs)[jax.lax.axis_index(axis)] * run_len
    part = lambda x, r: None if x is None else x[:, r * run_len:(r + 1) * run_len]
    return jnp.concatenate(
        [attention.blockwise_chunk(part(q, r), k_all, v_all, starts[r], part(seg, r) if has_seg else None,
                                   part(pre, r) if has_seg else None, seg_all, window, blk)
         for r in range(n_runs)], axis=1)

  def ring(q, k, v, seg, pre):
    blocks = attention.to_blocks(st, q, k, v, seg, pre, seg)
    return attention.from_blocks(_ring(*blocks, st, axis, row_runs), h)

  local = ring if scheme == "ring" else all_gather
  o = jax.shard_map(local, mesh=mesh, in_specs=(seq,) * 5, out_specs=seq, check_vma=False)(
      pad(q_bthd), pad(k_btkd), pad(v_btkd), seg, pre)
  return o[:, :t]


# ---------------------------------------------------------------------------------------- ring
# Inside shard_map: q, k, v, segments are this device's chunk in the kernel's block layout
# (attention.to_blocks): R runs (`runs`) of Nc / R blocks, run r at global block row_runs[i][r] * Nc / R.

def _hop(axis: str, n: int, *xs):
  """Each of xs passed to the next device of the ring (device i -> i + 1 mod N)."""
  perm = [(i, (i + 1) % n) for i in range(n)]
  return tuple(jax.lax.ppermute(x, axis, perm) for x in xs)


def run_offsets(row_runs, device, nc: int):
  """Global block offset of each run of `device`'s chunk of nc blocks (traced ints)."""
  return jnp.asarray(row_runs)[device] * (nc // len(row_runs[0]))


def fold_runs(st, q, k, v, seg_q, pre_q, seg_k, q_offs, k_offs, state):
  """One ring step on a device: forward_blocks over every (query run, key run) pair of its chunk and
  the chunk it holds (global block offsets q_offs / k_offs, `run_offsets`); pairs that causality
  hides compute nothing (forward_blocks' loop bounds)."""
  n_runs = len(q_offs)
  split = lambda x: jnp.split(x, n_runs)
  qs, ks, vs, sq, pq, sk = map(split, (q, k, v, seg_q, pre_q, seg_k))
  parts = list(zip(*map(split, state)))
  for r in range(n_runs):
    for c in range(n_runs):
      parts[r] = attention.forward_blocks(st, qs[r], ks[c], vs[c], sq[r], pq[r], sk[c], q_offs[r], k_offs[c], parts[r])
  return tuple(jnp.concatenate(x) for x in zip(*parts))


def grads_runs(st, q, k, v, seg_q, pre_q, seg_k, q_offs, k_offs, do, lse, delta, dq):
  """fold_runs' backward: backward_blocks over every (query run, key run) pair -> (dq + this
  chunk's part, dk, dv), fp32."""
  n_runs = len(q_offs)
  split = lambda x: jnp.split(x, n_runs)
  qs, ks, vs, sq, pq, sk, dos, lses, deltas, dqs = map(split, (q, k, v, seg_q, pre_q, seg_k, do, lse, delta, dq))
  dks, dvs = [], []
  for c in range(n_runs):
    dk = dv = 0.0
    for r in range(n_runs):
      dqs[r], dk_rc, dv_rc = attention.backward_blocks(st, qs[r], ks[c], vs[c], sq[r], pq[r], sk[c], q_offs[r],
                                                       k_offs[c], dos[r], lses[r], deltas[r], dqs[r])
      dk, dv = dk + dk_rc, dv + dv_rc
    dks.append(dk)
    dvs.append(dv)
  return jnp.concatenate(dqs), jnp.concatenate(dks), jnp.concatenate(dvs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _ring(q, k, v, seg_q, pre_q, seg_k, st: attention.Static, axis: str, row_runs):
  return _ring_fwd(q, k, v, seg_q, pre_q, seg_k, st, axis, row_runs)[0]


def _ring_fwd(q, k, v, seg_q, pre_q, seg_k, st, axis, row_runs):
  """At step s device i holds the K/V chunk of device i - s and folds it into its online softmax."""
  n, me, nc = len(row_runs), jax.lax.axis_index(axis), q.shape[0]
  fold = lambda s, state, k_s, v_s, seg_s: fold_runs(
      st, q, k_s, v_s, seg_q, pre_q, seg_s, run_offsets(row_runs, me, nc),
      run_offsets(row_runs, (me - s) % n, nc), state)

  def step(s, carry):
    state, k_s, v_s, seg_s = carry
    return (fold(s, state, k_s, v_s, seg_s),) + _hop(axis, n, k_s, v_s, seg_s)

  state, k_s, v_s, seg_s = jax.lax.fori_loop(0, n - 1, step, (attention.softmax_init(q), k, v, seg_k))
  o, lse = attention.softmax_finish(fold(n - 1, state, k_s, v_s, seg_s), q.dtype)  # the last chunk stays
  return o, (q, k, v, seg_q, pre_q, seg_k, o, lse)


def _ring_bwd(st, axis, row_runs, res, do):
  """The ring again: each step adds a chunk's part to dQ here and to the dK / dV that travel with
  the chunk; a last hop brings every dK / dV chunk home."""
  q, k, v, seg_q, pre_q, seg_k, o, lse = res
  n, me, nc = len(row_runs), jax.lax.axis_index(axis), q.shape[0]
  delta = attention.output_delta(do, o)
  grads = lambda s, dq, k_s, v_s, seg_s: grads_runs(
      st, q, k_s, v_s, seg_q, pre_q, seg_s, run_offsets(row_runs, me, nc),
      run_offsets(row_runs, (me - s) % n, nc), do, lse, delta, dq)

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
