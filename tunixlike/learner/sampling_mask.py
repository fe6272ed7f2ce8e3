"""Keep Sampling Mask: learner log-probs under the sampler's truncated distribution.

With top-k / top-p the sampler draws from pi_T restricted to a kept set K_t and renormalised:

  mu(y_t) = exp(z_y / T) / sum_{v in K_t} exp(z_v / T)        (z: logits, T: temperature)

and ships log mu(y_t) as the behaviour logprob. A learner that scores the token under the full
softmax compares two different distributions, so the importance ratio pi / mu is off by the kept
mass (about 1 / top_p) even when the weights are identical. DeepSeek-V3.2 (arXiv 2512.02556,
"Keep Sampling Mask") applies the sampler's recorded K_t to the learner's logits as well:

  log pi(y_t) = z_y / T - logsumexp_{v in K_t} z_v / T

so at staleness 0 the ratio is exactly 1 up to rounding, and gradients flow only through the kept
logits. The sampler records K_t as packed bits (`np.packbits`, big bit order, uint8 [.., ceil(V/8)]);
an all-zero row means "no truncation recorded" (prompt positions, padding, environment tokens)
and keeps the whole vocabulary. Unpacking happens per chunk of positions inside the chunked
log-prob computation, so no more than [B, C, V] booleans exist at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def mask_width(vocab_size: int) -> int:
  """Bytes per token of a packed mask over `vocab_size` tokens."""
  return -(-int(vocab_size) // 8)


def unpack(mask_bcw: jax.Array, vocab_size: int) -> jax.Array:
  """Packed masks uint8 [..., W] -> kept set bool [..., V]; an empty row keeps every token."""
  if mask_bcw.shape[-1] != mask_width(vocab_size):
    raise ValueError(f"sampling mask has {mask_bcw.shape[-1]} bytes per token; a vocabulary of {vocab_size} "
                     f"needs {mask_width(vocab_size)} (was it recorded with a different model?)")
  keep_bcv = jnp.unpackbits(mask_bcw.astype(jnp.uint8), axis=-1, count=vocab_size).astype(jnp.bool_)
  recorded_bc1 = jnp.any(mask_bcw != 0, axis=-1, keepdims=True)
  return keep_bcv | ~recorded_bc1


def processed_logits(logits_bcv: jax.Array, temperature: float = 1.0,
                     mask_bcw: jax.Array | None = None) -> jax.Array:
  """float32 logits / T with -inf outside the recorded kept set: log_softmax of this is log mu."""
  if not temperature > 0:
    raise ValueError(f"sampling temperature={temperature!r}: must be > 0 (0 is greedy: no distribution)")
  x_bcv = logits_bcv.astype(jnp.float32)
  if temperature != 1.0:
    x_bcv = x_bcv / jnp.float32(temperature)
  if mask_bcw is not None:
    keep_bcv = unpack(mask_bcw, logits_bcv.shape[-1])
    x_bcv = jnp.where(keep_bcv, x_bcv, -jnp.inf)
  return x_bcv


def tokens_in_mask(mask_tw: np.ndarray, tokens_t: np.ndarray) -> np.ndarray:
  """Host check: bool [T], whether token t's bit is set in its packed mask row (uint8 [T, W])."""
  mask_tw = np.asarray(mask_tw, np.uint8)
  tokens_t = np.asarray(tokens_t, np.int64)
  byte_t = mask_tw[np.arange(len(tokens_t)), tokens_t >> 3]
  return ((byte_t >> (7 - (tokens_t & 7))) & 1).astype(bool)
