"""Speculative decoding's acceptance rule, coupled to the sampler's per-token noise.

Plain decoding samples the n-th token of a slot by inverting the CDF of the processed distribution
p_n (temperature, top-k, top-p) at u_n = uniform(fold_in(slot_key, n)) (`engine`,
`sampling.sample_with_uniform`). A verify forward gives the logits of a slot's next T = D + 1
positions, fed its next input token and its draft d_0 .. d_{D-1}. With the same noise,

    y_t = F_{n+t}^{-1}(u_{n+t})    (F: the CDF of the processed distribution at position t)

is exactly the token plain decoding samples at position t whenever d_0 .. d_{t-1} are the tokens it
sampled before. So the draft is accepted while d_t = y_t, and y_0 .. y_a are emitted, a being the
first t with d_t != y_t (y_a corrects the draft) or D (y_D is the bonus token): plain decoding's
tokens, each with its logprob under p, whatever the draft was.

This is exact speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318) for a point-mass draft q = 1[d_t]: it accepts d_t with probability
min(1, p(d_t) / q(d_t)) = p(d_t), and on rejection samples the residual (p - q)+ renormalised, i.e.
p without d_t. With the coupled uniform, "accept iff y_t = d_t" has the same acceptance probability
p(d_t), and a rejected draft leaves y_t distributed as p restricted to tokens != d_t: the same scheme,
with the draws made once and shared with plain decoding, so the tokens are identical too.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tunixlike.sampler import sampling

NO_DRAFT = -1  # a draft position with no token (shorter drafts are padded with it); never equals a sampled token


def draft_length(steps_per_call: int, draft_tokens: int) -> int:
  """Draft tokens per slot of a verify call (`PagedEngine.verify`): each of its `steps_per_call` steps
  verifies up to `draft_tokens` and emits one more (the correction or the bonus token)."""
  return steps_per_call * (draft_tokens + 1) - 1


def verify_steps(longest: int, steps_per_call: int, draft_tokens: int) -> int:
  """Verify steps of a call whose longest draft has `longest` tokens: 1 when it fits the first step
  (the call's other steps are plain decode steps: a cheaper call where a verify step costs more than
  a decode step), else all `steps_per_call`. Two verify programs per decode width."""
  return 1 if longest <= draft_tokens else steps_per_call


class Verified(NamedTuple):
  tokens_st: jax.Array  # int32 [S, T]: the token plain decoding samples at each position given the draft
  logprobs_st: jax.Array  # float32 [S, T], under the processed distribution
  mask_stw: jax.Array | None  # uint8 [S, T, ceil(V / 8)] packed kept-token sets, if asked
  accepted_s: jax.Array  # int32 [S]: leading draft tokens equal to tokens_st (0 .. D)


def position_uniforms(keys_s2, n_gen_s, steps: int) -> jax.Array:
  """u [S, steps]: the noise of each slot's tokens n_gen .. n_gen + steps - 1, as the engine draws it."""
  n_st = n_gen_s[:, None] + jnp.arange(steps, dtype=n_gen_s.dtype)
  one = lambda key, n: jax.random.uniform(jax.random.fold_in(key, n), (), jnp.float32)
  return jax.vmap(lambda key, ns: jax.vmap(lambda n: one(key, n))(ns))(keys_s2, n_st)


def verify(logits_stv, drafts_sd, keys_s2, n_gen_s, params: sampling.SamplingParams, *,
           return_mask: bool = False) -> Verified:
  """Samples every position of a verify forward with plain decoding's noise and counts the accepted
  draft prefix. logits [S, T, V] at the slot's positions n_gen .. n_gen + D; drafts [S, D] (NO_DRAFT
  padding); keys [S, 2] the slots' noise keys; n_gen [S] tokens each slot has generated so far."""
  s, t, v = logits_stv.shape
  u_st = position_uniforms(keys_s2, n_gen_s, t)
  smp = sampling.sample_with_uniform(logits_stv.reshape(s * t, v), u_st.reshape(s * t), params,
                                     return_mask=return_mask)
  tokens_st = smp.tokens_b.reshape(s, t)
  agree_sd = (drafts_sd == tokens_st[:, :-1]).astype(jnp.int32)
  accepted_s = jnp.sum(jnp.cumprod(agree_sd, axis=1), axis=1)
  mask = None if smp.mask_bw is None else smp.mask_bw.reshape(s, t, -1)
  return Verified(tokens_st, smp.logprobs_b.reshape(s, t), mask, accepted_s)
