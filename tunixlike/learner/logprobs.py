"""Per-token log-probabilities and entropies without materialising the [B, T, V] logits.

The train step needs log pi(y_t) for the sampled tokens only, yet a full [B, T, V] float32 logits
tensor (and its gradient) is the largest activation of a language model (V ~ 150k). We run the
trunk once (`hidden_states`, [B, T, D]) and unembed T in chunks inside a `lax.scan` whose body is
rematerialised, so forward and backward hold only [B, C, V] at a time.

The logits can be processed as the sampler processed them (`sampling_mask.processed_logits`:
temperature, and with "Keep Sampling Mask" the recorded top-k / top-p kept set), chunk by chunk.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from tunixlike.learner import sampling_mask as sampling_mask_lib
from tunixlike.models import sharding as sharding_lib


def token_logprobs_from_logits(logits_btv, targets_bt):
  """log softmax(logits)[target], computed in float32. [B, T, V], [B, T] -> [B, T]."""
  logits = logits_btv.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - lse


def entropy_from_logits(logits_btv):
  """H = -sum_v p_v log p_v = logsumexp(l) - sum_v p_v l_v, in float32. [B, T, V] -> [B, T].

  Logits of -inf (tokens outside a sampling mask) have p_v = 0 and contribute nothing.
  """
  logits = logits_btv.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  p = jax.nn.softmax(logits, axis=-1)
  return lse - (p * jnp.where(p > 0, logits, 0.0)).sum(axis=-1)


def _chunk_size(t: int, chunk_size: int) -> int:
  """The largest divisor of T that is <= chunk_size (bucketed T is usually a power of two)."""
  c = max(1, min(chunk_size, t))
  while t % c:
    c -= 1
  return c


def chunked_token_logprobs(hidden_btd, targets_bt, unembed: Callable[[jax.Array], jax.Array],
                           chunk_size: int = 128, with_entropy: bool = True, *, temperature: float = 1.0,
                           mask_btw=None):
  """(logp_bt, entropy_bt or None) for next-token targets, unembedding C positions at a time.

  hidden_btd: [B, T, D] final hidden states; targets_bt: [B, T] token predicted at each position;
  unembed: [..., D] -> [..., V]. The entropy is for reporting and carries no gradient.
  temperature: the sampler's (logits / T). mask_btw: uint8 [B, T, ceil(V/8)] packed kept set of the
  target at each position (aligned with targets_bt; all-zero rows keep everything), unpacked one
  chunk at a time so at most [B, C, V] of it exists.
  """
  if mask_btw is not None and (mask_btw.ndim != 3 or mask_btw.shape[:2] != targets_bt.shape):
    raise ValueError(f"sampling mask has shape {mask_btw.shape}, expected {tuple(targets_bt.shape)} + (ceil(V/8),)")
  b, t, _ = hidden_btd.shape
  c = _chunk_size(t, chunk_size)
  n = t // c
  p = _token_splits(n)

  @jax.checkpoint
  def one_chunk(h_bcd, y_bc, m_bcw):
    logits_bcv = sampling_mask_lib.processed_logits(unembed(h_bcd), temperature, m_bcw)
    logp = token_logprobs_from_logits(logits_bcv, y_bc)
    ent = jax.lax.stop_gradient(entropy_from_logits(logits_bcv)) if with_entropy else jnp.zeros_like(logp)
    return logp, ent

  if n == 1:
    logp, ent = one_chunk(hidden_btd, targets_bt, mask_btw)
    return logp, (ent if with_entropy else None)

  # [B, P, N/P, C, ...]: with a row's tokens split over P devices (context parallelism) step i takes
  # the i-th chunk of every device's part at once, so each device unembeds its own tokens.
  split = lambda x: sharding_lib.constrain(x.reshape(b, p, n // p, c, *x.shape[2:]),
                                           ("batch", "length") + (None,) * x.ndim)
  h, y = split(hidden_btd), split(targets_bt)
  m = None if mask_btw is None else split(mask_btw)

  def body(carry, i):
    return carry, one_chunk(h[:, :, i], y[:, :, i], None if m is None else m[:, :, i])

  _, (logp_nbpc, ent_nbpc) = jax.lax.scan(body, None, jnp.arange(n // p))
  logp = jnp.moveaxis(logp_nbpc, 0, 2).reshape(b, t)
  ent = jnp.moveaxis(ent_nbpc, 0, 2).reshape(b, t)
  return logp, (ent if with_entropy else None)


def _token_splits(n_chunks: int) -> int:
  """How many devices a row's tokens are split over (activation rule 'length', context parallelism)
  when the chunks divide among them; else 1."""
  split = sharding_lib.activation_axis("length")
  p = 1 if split is None else split[0].shape[split[1]]
  return p if n_chunks % p == 0 else 1
