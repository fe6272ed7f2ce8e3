"""Causal self-attention over a whole sequence: the reference and the memory-efficient kernels.

`attend(q, k, v, segments=, prefix=, window=, impl=)` is what `Attention.__call__` (training,
prefill) runs. Every kernel computes the same function:

  o[t] = sum_s softmax_s(q[t] . k[s] / sqrt(D)) v[s]  over the keys s that t may see:
         s <= t (causal), t - s < window (sliding window, when set), and with segments
         seg[s] == seg[t] or seg[s] == prefix[t] (a token sees its own sequence and its prefix:
         a shared prompt, `learner/prompt_rows.py`; prefix defaults to segment 0).

q [B, T, H, D], k / v [B, T, Hkv, D] (GQA: H a multiple of Hkv); softmax and accumulation in fp32
whatever the input dtype. The kernels (`IMPLEMENTATIONS`, config key `model.attention`):

  reference   materialises the [B, H, T, T] scores and probabilities; the backward pass keeps them
              (memory ~ T^2: 20 GB per 8K-token row of the 4M-parameter bench model on CPU).
  blockwise   flash attention in pure JAX (`jax.custom_vjp`): an online softmax over key blocks,
              only [block, block] scores at a time; the backward pass recomputes them from the
              saved log-sum-exp (FlashAttention-2, arXiv 2307.08691). Memory ~ T * block. Blocks
              wholly above the diagonal (or outside the window) are skipped, and so are blocks the
              segments hide from every query (packed groups, a shared prompt's other answers). Any backend.
              Its pieces (`forward_blocks`, `softmax_finish`, `backward_blocks`) take global block
              offsets, so that context parallelism's ring folds in one chunk of keys at a time.
  cudnn       cuDNN flash attention (`jax.nn.dot_product_attention(implementation='cudnn')`), GPU,
              bf16 / fp16 only; masks it cannot express (a shared prefix) go to blockwise.
  pallas_tpu  Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`), TPU;
              masks it cannot express (a shared prefix) go to blockwise.
  auto        the fastest one that is correct here (`choose`): cuDNN on GPU, splash on TPU where
              they take the mask; otherwise the reference for short rows (`REFERENCE_MAX_LEN`, as
              fast there) and blockwise beyond.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tunixlike.models.config import ATTENTION_IMPLEMENTATIONS

IMPLEMENTATIONS = ATTENTION_IMPLEMENTATIONS  # `ModelConfig.attention`, `model.attention`
# On CPU the reference is as fast up to here (and the main job's rows, tens of tokens, keep today's
# program); beyond it the blockwise kernel is faster (a learner step at 2K: 0.65x the reference's
# time, docs/benchmarks.md#long-context-training) and its memory grows linearly.
REFERENCE_MAX_LEN = 256
BLOCK = 256  # key / query block of the blockwise kernel ([G*256, 256] fp32 scores per KV head at a time)
_MASKED = -1e30
BACKEND_ONLY = {"cudnn": "gpu", "pallas_tpu": "tpu"}  # kernels that run on one backend only


def backend_error(impl: str, backend: str) -> str | None:
  """Why `model.attention=impl` cannot run on `backend` (a kernel of another one), or None."""
  needs = BACKEND_ONLY.get(impl)
  if needs is None or backend == needs:
    return None
  return (f"model.attention={impl!r} runs on {needs.upper()} only and this run's JAX backend is {backend}: use "
          "'auto' (the fastest correct kernel on any backend) or 'blockwise'")


def attend(q_bthd, k_btkd, v_btkd, *, segments_bt=None, prefix_bt=None, window: int | None = None,
           impl: str = "auto", block: int = BLOCK):
  """Causal attention (module docstring) -> [B, T, H, D] in q's dtype."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation {impl!r}, expected one of {IMPLEMENTATIONS}")
  if prefix_bt is not None and segments_bt is None:
    raise ValueError("attend: prefix_bt needs segments_bt")
  if window is not None and window <= 0:
    raise ValueError(f"attend: window={window!r} must be a positive number of tokens")
  impl = choose(impl, q_bthd.shape[1], q_bthd.dtype, segments_bt is not None, prefix_bt is not None)
  if impl == "reference":
    return reference(q_bthd, k_btkd, v_btkd, segments_bt, prefix_bt, window)
  if impl == "cudnn":
    return _cudnn(q_bthd, k_btkd, v_btkd, segments_bt, window)
  if impl == "pallas_tpu":
    return _splash(q_bthd, k_btkd, v_btkd, segments_bt, window)
  return blockwise(q_bthd, k_btkd, v_btkd, segments_bt, prefix_bt, window, block)


def choose(impl: str, t: int, dtype, has_segments: bool, has_prefix: bool, backend: str | None = None) -> str:
  """The kernel that runs for `impl` on this backend. A forced backend kernel whose mask or dtype
  it cannot take falls back to blockwise (same function, any backend)."""
  backend = backend or jax.default_backend()
  # A shared prefix (segment 0 seen by every segment) is not a mask cuDNN or splash can express;
  # plain segments (packed rows) map to their segment ids.
  expressible = not has_segments
  if impl == "auto":
    if backend == "gpu" and expressible and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
      return "cudnn"
    if backend == "tpu" and expressible:
      return "pallas_tpu"
    return "reference" if t <= REFERENCE_MAX_LEN else "blockwise"
  if impl == "cudnn" and not (expressible and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)):
    return "blockwise"
  if impl == "pallas_tpu" and not expressible:
    return "blockwise"
  return impl


def visible_mask(q_idx, k_idx, seg_q=None, pre_q=None, seg_k=None, window=None):
  """bool [..., Tq, Tk]: may query index q_idx [Tq] see key index k_idx [Tk]. seg_q / pre_q [B, Tq],
  seg_k [B, Tk] (optional) give a [B, Tq, Tk] mask."""
  vis = k_idx[None, :] <= q_idx[:, None]
  if window is not None:
    vis &= q_idx[:, None] - k_idx[None, :] < window
  if seg_q is not None:
    pre_q = jnp.zeros_like(seg_q) if pre_q is None else pre_q
    sk = seg_k[:, None, :]
    vis = vis & ((sk == seg_q[:, :, None]) | (sk == pre_q[:, :, None]))
  return vis


# ---------------------------------------------------------------------------------------- reference

def reference(q_bthd, k_btkd, v_btkd, segments_bt=None, prefix_bt=None, window=None):
  """Today's attention: the whole [B, Hkv, G, T, T] score matrix at once."""
  b, t, h, d = q_bthd.shape
  kv = k_btkd.shape[2]
  q = q_bthd.reshape(b, t, kv, h // kv, d)
  s = jnp.einsum("btkgd,bskd->bkgts", q, k_btkd, preferred_element_type=jnp.float32) / math.sqrt(d)
  idx = jnp.arange(t)
  vis = visible_mask(idx, idx, segments_bt, prefix_bt, segments_bt, window)
  vis = vis[:, None, None] if segments_bt is not None else vis
  p = jax.nn.softmax(jnp.where(vis, s, _MASKED), axis=-1).astype(v_btkd.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", p, v_btkd).reshape(b, t, h, d)


# ---------------------------------------------------------------------------------------- blockwise

def blockwise(q_bthd, k_btkd, v_btkd, segments_bt=None, prefix_bt=None, window=None, block: int = BLOCK):
  """Flash attention in pure JAX (module docstring). T is padded up to a multiple of the block
  (the padded keys come after every real query, so causality hides them)."""
  b, t, h, d = q_bthd.shape
  blk = min(block, max(8, -(-t // 8) * 8))  # a short row is one block
  tp = -(-t // blk) * blk
  pad = lambda x, fill=0: jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
  has_seg = segments_bt is not None
  seg = pad(segments_bt.astype(jnp.int32), -1) if has_seg else None
  pre = pad(prefix_bt.astype(jnp.int32), -1) if prefix_bt is not None else None
  return blockwise_chunk(pad(q_bthd), pad(k_btkd), pad(v_btkd), 0, seg, pre, seg, window, blk)[:, :t]


def blockwise_chunk(q_bthd, k_btkd, v_btkd, q_offset, segments_q=None, prefix_q=None, segments_k=None,
                    window=None, block: int = BLOCK):
  """Blockwise attention of a chunk of queries, global positions [q_offset, q_offset + Tq), against
  every key of the row (Tk): also context parallelism's per-device part with gathered keys
  (`context_parallel.py`). Tq, Tk and q_offset must be multiples of the block (q_offset may be traced)."""
  b, tq, h, d = q_bthd.shape
  blk = min(block, tq)
  st = static_args(q_bthd, k_btkd, blk, window, segments_q is not None)
  q, k, v, seg_q, pre_q, seg_k = to_blocks(st, q_bthd, k_btkd, v_btkd, segments_q, prefix_q, segments_k)
  o = _flash(q, k, v, seg_q, pre_q, seg_k, (jnp.asarray(q_offset) // blk).astype(jnp.int32), st)
  return from_blocks(o, h)


class Static(NamedTuple):
  """The kernel's static arguments."""

  block: int
  groups: int  # query heads per KV head
  window: int | None
  has_seg: bool
  scale: float


def static_args(q_bthd, k_btkd, block: int, window, has_seg: bool) -> Static:
  return Static(block, q_bthd.shape[2] // k_btkd.shape[2], window, has_seg, 1 / math.sqrt(q_bthd.shape[3]))


def to_blocks(st: Static, q_bthd, k_btkd, v_btkd, segments_q=None, prefix_q=None, segments_k=None):
  """The kernel's layout, blocks first, each a batched matmul operand: q [Nq, B, Hkv, G*blk, D] (rows
  g-major: the G query heads of a KV head share its keys in one matmul), k / v [Nk, B, Hkv, blk, D],
  segments [N, B, blk] (zeros when absent). Lengths must be multiples of the block."""
  b, tq, h, d = q_bthd.shape
  tk, kv, blk = k_btkd.shape[1], k_btkd.shape[2], st.block
  if tq % blk or tk % blk:
    raise ValueError(f"blockwise attention: query length {tq} and key length {tk} must be multiples of the block {blk}")
  nq, nk = tq // blk, tk // blk
  q = jnp.einsum("bnqkgd->nbkgqd", q_bthd.reshape(b, nq, blk, kv, st.groups, d)).reshape(nq, b, kv, -1, d)
  k, v = (jnp.einsum("bnskd->nbksd", x.reshape(b, nk, blk, kv, d)) for x in (k_btkd, v_btkd))
  tokens = lambda x, t: jnp.moveaxis((jnp.zeros((b, t), jnp.int32) if x is None else x.astype(jnp.int32))
                                     .reshape(b, t // blk, blk), 1, 0)
  return q, k, v, tokens(segments_q, tq), tokens(prefix_q, tq), tokens(segments_k, tk)


def from_blocks(o, h: int):
  """[Nq, B, Hkv, G*blk, D] -> [B, Tq, H, D] (to_blocks' inverse for the queries)."""
  n, b, kv, r, d = o.shape
  g = h // kv
  return jnp.einsum("nbkgqd->bnqkgd", o.reshape(n, b, kv, g, r // g, d)).reshape(b, n * (r // g), h, d)


def _key_range(st: Static, gi, k_off, nk: int):
  """Local key blocks [lo, hi) (global block = local + k_off) that query block gi (global) may see:
  causal; the window drops blocks far behind."""
  lo = 0 if st.window is None else jnp.maximum(0, (gi * st.block - st.window + 1) // st.block)
  return jnp.clip(lo - k_off, 0, nk), jnp.clip(gi + 1 - k_off, 0, nk)


def _query_range(st: Static, j, q_off, nq: int):
  """Local query blocks [lo, hi) (global block = local + q_off) that may see key block j (global)."""
  hi = nq + q_off if st.window is None else jnp.minimum(
      nq + q_off, ((j + 1) * st.block - 1 + st.window - 1) // st.block + 1)
  return jnp.clip(j - q_off, 0, nq), jnp.clip(hi - q_off, 0, nq)


def _block_mask(st: Static, i, j, q_off, k_off, seg_q, pre_q, seg_k):
  """Local query block i vs local key block j: [G*blk, blk] bool, or [B, 1, G*blk, blk]."""
  rows = jnp.arange(st.groups * st.block) % st.block  # the query of each row of a G*blk block
  q_idx, k_idx = (i + q_off) * st.block + rows, (j + k_off) * st.block + jnp.arange(st.block)
  if not st.has_seg:
    return visible_mask(q_idx, k_idx, window=st.window)
  return visible_mask(q_idx, k_idx, seg_q[i][:, rows], pre_q[i][:, rows], seg_k[j], st.window)[:, None]


def _unless_hidden(st: Static, vis, update, carry):
  """update(carry), or carry itself when segments hide the whole block from every query: a packed
  row's groups, or a shared prompt's later answers, never compute each other's blocks."""
  if not st.has_seg:  # causality and the window are already in the loop bounds
    return update(carry)
  return jax.lax.cond(vis.any(), update, lambda c: c, carry)


def _scores(st: Static, q_i, k_j):
  """[B, Hkv, R, D] x [B, Hkv, blk, D] -> fp32 scores [B, Hkv, R, blk] (R = G*blk query rows)."""
  return jnp.einsum("bkrd,bksd->bkrs", q_i, k_j, preferred_element_type=jnp.float32) * st.scale


def softmax_init(q):
  """The online softmax's state before any key: (running max m, sum l) [Nq, B, Hkv, R] and the
  unnormalised output acc [Nq, B, Hkv, R, D], fp32."""
  return (jnp.full(q.shape[:-1], _MASKED, jnp.float32), jnp.zeros(q.shape[:-1], jnp.float32),
          jnp.zeros(q.shape, jnp.float32))


def forward_blocks(st: Static, q, k, v, seg_q, pre_q, seg_k, q_off, k_off, state):
  """The online softmax `state` (softmax_init) of q's blocks continued over the key blocks k, v.
  q_off / k_off: global block index of the first query / key block (may be traced), so that a
  device of a ring can fold in one chunk of keys after another (`context_parallel.py`)."""

  def query_block(args):
    i, carry = args[0], args[1:]
    q_i = q[i]

    def key_block(j, carry):
      vis = _block_mask(st, i, j, q_off, k_off, seg_q, pre_q, seg_k)

      def update(carry):
        m, l, acc = carry
        s = _scores(st, q_i, k[j])
        m_new = jnp.maximum(m, jnp.where(vis, s, _MASKED).max(-1))
        p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("bkrs,bksd->bkrd", p.astype(v.dtype), v[j], preferred_element_type=jnp.float32)
        return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

      return _unless_hidden(st, vis, update, carry)

    return jax.lax.fori_loop(*_key_range(st, i + q_off, k_off, k.shape[0]), key_block, carry)

  return jax.lax.map(query_block, (jnp.arange(q.shape[0]),) + tuple(state))


def softmax_finish(state, dtype):
  """-> (o [Nq, B, Hkv, R, D] in dtype, lse [Nq, B, Hkv, R] fp32) of an online softmax state."""
  m, l, acc = state
  l = jnp.maximum(l, 1e-30)  # never divide by 0 (every real query sees itself, so l > 0 there)
  return (acc / l[..., None]).astype(dtype), m + jnp.log(l)


def backward_blocks(st: Static, q, k, v, seg_q, pre_q, seg_k, q_off, k_off, do, lse, delta, dq):
  """FlashAttention-2's backward against the key blocks k, v (offsets as in forward_blocks): per key
  block j, the query blocks that see it, recomputing p = exp(s - lse) from the whole row's lse;
  delta = sum_d dO o [Nq, B, Hkv, R]. Returns (dq + this chunk's part, dk, dv), all fp32."""

  def key_block(dq, j):
    k_j, v_j = k[j], v[j]

    def query_block(i, carry):
      vis = _block_mask(st, i, j, q_off, k_off, seg_q, pre_q, seg_k)

      def update(carry):
        dk, dv, dq = carry
        q_i, do_i = q[i], do[i]
        p = jnp.where(vis, jnp.exp(_scores(st, q_i, k_j) - lse[i][..., None]), 0.0)  # [B, Hkv, R, blk]
        dv = dv + jnp.einsum("bkrs,bkrd->bksd", p.astype(do.dtype), do_i, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bkrd,bksd->bkrs", do_i, v_j, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[i][..., None]) * st.scale
        dk = dk + jnp.einsum("bkrs,bkrd->bksd", ds.astype(q.dtype), q_i, preferred_element_type=jnp.float32)
        dq_i = jnp.einsum("bkrs,bksd->bkrd", ds.astype(k.dtype), k_j, preferred_element_type=jnp.float32)
        return dk, dv, dq.at[i].add(dq_i)

      return _unless_hidden(st, vis, update, carry)

    zeros = jnp.zeros(k_j.shape, jnp.float32)
    dk, dv, dq = jax.lax.fori_loop(*_query_range(st, j + k_off, q_off, q.shape[0]), query_block, (zeros, zeros, dq))
    return dq, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(key_block, dq, jnp.arange(k.shape[0]))
  return dq, dk, dv


def output_delta(do, o):
  """sum_d dO o [Nq, B, Hkv, R] fp32: the softmax backward's row term."""
  return jnp.einsum("nbkrd,nbkrd->nbkr", do.astype(jnp.float32), o.astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, seg_q, pre_q, seg_k, q_off, st: Static):
  return _flash_fwd(q, k, v, seg_q, pre_q, seg_k, q_off, st)[0]


def _flash_fwd(q, k, v, seg_q, pre_q, seg_k, q_off, st: Static):
  o, lse = softmax_finish(forward_blocks(st, q, k, v, seg_q, pre_q, seg_k, q_off, 0, softmax_init(q)), q.dtype)
  return o, (q, k, v, seg_q, pre_q, seg_k, q_off, o, lse)


def _flash_bwd(st: Static, res, do):
  """dK_j, dV_j accumulate per key block, dQ in a carry of all blocks (fp32)."""
  q, k, v, seg_q, pre_q, seg_k, q_off, o, lse = res
  dq, dk, dv = backward_blocks(st, q, k, v, seg_q, pre_q, seg_k, q_off, 0, do, lse, output_delta(do, o),
                               jnp.zeros(q.shape, jnp.float32))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------- backends

def _cudnn(q_bthd, k_btkd, v_btkd, segments_bt, window):
  """cuDNN flash attention (GPU, bf16 / fp16). `choose` sends masks it cannot take elsewhere."""
  assert segments_bt is None, "choose() routes segments away from cuDNN"
  t, d = q_bthd.shape[1], q_bthd.shape[3]
  if d % 8 or d > 128:  # head dims cuDNN flash takes on every card: multiples of 8 up to 128
    return blockwise(q_bthd, k_btkd, v_btkd, None, None, window, BLOCK)
  # cuDNN refuses some lengths (odd ones in training): pad to whole 64-token tiles; the padded keys
  # come after every real query, so the causal mask hides them, and the padded queries are cut off.
  tp = -(-t // 64) * 64
  pad = lambda x: jnp.pad(x, [(0, 0), (0, tp - t), (0, 0), (0, 0)])
  o = jax.nn.dot_product_attention(pad(q_bthd), pad(k_btkd), pad(v_btkd), is_causal=True, implementation="cudnn",
                                   local_window_size=None if window is None else (window - 1, 0))
  return o[:, :t]


def _splash(q_bthd, k_btkd, v_btkd, segments_bt, window, interpret: bool = False):
  """Pallas splash attention (TPU; `interpret=True` runs it on any backend, slowly, for tests).
  GQA: one MQA kernel per KV head over its G query heads; vmapped over rows and KV heads."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
  assert segments_bt is None, "choose() routes segments away from splash attention"
  b, t, h, d = q_bthd.shape
  kv = k_btkd.shape[2]
  g = h // kv
  tp = -(-t // 128) * 128  # splash blocks are multiples of 128 tokens; the padded keys are causally hidden
  pad = lambda x: jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2))
  one = (masks.CausalMask((tp, tp)) if window is None
         else masks.LocalMask((tp, tp), window_size=(window - 1, 0), offset=0))
  blk = min(512, tp)
  sizes = splash.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                            block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
  kernel = splash.make_splash_mqa_single_device(masks.MultiHeadMask([one] * g), block_sizes=sizes,
                                                interpret=interpret)
  # [B, T, Hkv, G, D] -> [B, Hkv, G, T, D]; splash scales nothing, so q carries 1/sqrt(D)
  q = jnp.einsum("btkgd->bkgtd", pad(q_bthd).reshape(b, tp, kv, g, d)) / jnp.asarray(math.sqrt(d), q_bthd.dtype)
  k, v = (jnp.einsum("btkd->bktd", pad(x)) for x in (k_btkd, v_btkd))
  o = jax.vmap(jax.vmap(kernel))(q, k, v)  # [B, Hkv, G, T, D]
  return jnp.einsum("bkgtd->btkgd", o).reshape(b, tp, h, d)[:, :t].astype(q_bthd.dtype)


def splash_interpret(q_bthd, k_btkd, v_btkd, window=None):
  """The TPU kernel in Pallas interpret mode (any backend): for tests against the reference."""
  return _splash(q_bthd, k_btkd, v_btkd, None, window, interpret=True)

