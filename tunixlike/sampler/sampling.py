"""Token sampling: greedy, temperature, top-k, top-p, with the logprob RL needs.

The logprob returned for each sampled token is under the *processed* distribution (after
temperature, top-k and top-p, renormalised over the kept tokens): the behaviour policy the
learner's importance weights divide by. The kept-token set can be returned as packed bits
(np.packbits layout, big bit order) for "Keep Sampling Mask" (DeepSeek-V3.2, arXiv 2512.02556).

Sampling draws one uniform per row and inverts the CDF instead of adding Gumbel noise to every
logit: one random number per row instead of V, which was 5-10% of a decode step on CPU.
Temperature 0 means argmax whatever top-k / top-p say (no division by zero): the processed
distribution is then a point mass, so the logprob is 0 and the mask keeps one token.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings (hashable: they select a compiled program)."""

  temperature: float  # 0 = greedy (no default: a run chooses sampler.temperature by what it starts from)
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off

  def __post_init__(self):
    if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
            and self.temperature >= 0.0):
      raise ValueError(f"temperature={self.temperature!r}: must be a finite number >= 0")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"top_k={self.top_k!r}: must be an int >= 0 (0 = off)")
    if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
      raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1] (1 = off)")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


class Sample(NamedTuple):
  tokens_b: jax.Array  # int32 [B]
  logprobs_b: jax.Array  # float32 [B], under the processed distribution
  mask_bw: jax.Array | None  # uint8 [B, ceil(V / 8)] packed kept-token set, or None


def process_logits(logits_bv: jax.Array, params: SamplingParams) -> jax.Array:
  """Returns processed log-probabilities [B, V]: -inf outside the kept set, logsumexp 0 inside.

  Not for temperature 0 (a point mass; see `sample`). Ties at the top-k / top-p threshold are all
  kept, so the kept set can exceed k by the number of exact ties.
  """
  if params.greedy:
    raise ValueError("process_logits needs temperature > 0; temperature 0 is argmax")
  x_bv = logits_bv.astype(jnp.float32) / params.temperature
  neg_inf = jnp.float32(-jnp.inf)
  vocab = x_bv.shape[-1]
  if 0 < params.top_k < vocab:
    kth_b1 = jax.lax.top_k(x_bv, params.top_k)[0][:, -1:]
    x_bv = jnp.where(x_bv >= kth_b1, x_bv, neg_inf)
  if params.top_p < 1.0:
    # Smallest prefix of the sorted distribution whose mass reaches top_p (the token that crosses
    # top_p is kept, so at least one token always is).
    sorted_bv = -jnp.sort(-x_bv, axis=-1)
    probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
    mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
    keep_bv = mass_before_bv < params.top_p
    threshold_b1 = jnp.min(jnp.where(keep_bv, sorted_bv, jnp.inf), axis=-1, keepdims=True)
    x_bv = jnp.where(x_bv >= threshold_b1, x_bv, neg_inf)
  return jax.nn.log_softmax(x_bv, axis=-1)


def sample_with_uniform(logits_bv: jax.Array, uniform_b: jax.Array, params: SamplingParams,
                        *, return_mask: bool = False) -> Sample:
  """Samples row b by inverting the CDF of the processed distribution at uniform_b[b] in [0, 1)."""
  vocab = logits_bv.shape[-1]
  if params.greedy:
    tokens_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logprobs_b = jnp.zeros(tokens_b.shape, jnp.float32)
    keep_bv = jax.nn.one_hot(tokens_b, vocab, dtype=jnp.bool_) if return_mask else None
  else:
    logp_bv = process_logits(logits_bv, params)
    cdf_bv = jnp.cumsum(jnp.exp(logp_bv), axis=-1)
    # First index whose CDF exceeds u * total. Excluded tokens have probability 0, so the CDF is
    # flat over them and they can never be that index. Scaling by the total absorbs rounding.
    target_b1 = uniform_b.astype(jnp.float32)[:, None] * cdf_bv[:, -1:]
    tokens_b = jnp.sum(cdf_bv <= target_b1, axis=-1).astype(jnp.int32)
    tokens_b = jnp.minimum(tokens_b, vocab - 1)
    logprobs_b = jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=-1)[:, 0]
    keep_bv = jnp.isfinite(logp_bv) if return_mask else None
  mask_bw = jnp.packbits(keep_bv, axis=-1) if return_mask else None
  return Sample(tokens_b, logprobs_b, mask_bw)


def sample(logits_bv: jax.Array, key: jax.Array, params: SamplingParams,
           *, return_mask: bool = False) -> Sample:
  """Samples one token per row of logits [B, V] with one uniform per row drawn from `key`.

  Callers advance `key` on every call (split or fold_in): reusing a key repeats the noise.
  """
  uniform_b = jax.random.uniform(key, logits_bv.shape[:1], jnp.float32)
  return sample_with_uniform(logits_bv, uniform_b, params, return_mask=return_mask)


def unpack_mask(mask_bw, vocab_size: int):
  """Inverse of the packed sampling mask: bool [..., V] (numpy or jax input)."""
  return np.unpackbits(np.asarray(mask_bw), axis=-1, count=vocab_size).astype(bool)
