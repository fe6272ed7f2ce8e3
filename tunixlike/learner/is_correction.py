"""Off-policy correction for stale or mismatched rollouts: the decoupled PPO objective.

The sampler's tokens come from a behaviour policy pi_behav (an older version, and a different
numerical implementation: bf16, fused kernels, top-k/top-p processing). The decoupled objective
keeps the trust region around a proximal policy pi_prox computed by the learner, and corrects
behaviour -> proximal with an importance weight that does not carry gradient:

  loss_t = -w_t * min(r_t A, clip(r_t, 1-eps_low, 1+eps_high) A),
  r_t = pi_theta(y_t) / pi_prox(y_t),   w_t = g(pi_prox(y_t) / pi_behav(y_t))

Hilton et al. 2022, "Batch size-invariance for policy optimization", arXiv 2110.00641 (decoupled
PPO); Fu et al. 2025, "AReaL", arXiv 2505.24298, eq. (5). g is one of
  none:  g(x) = 1 (plain PPO on the proximal policy; reported only)
  tis:   g(x) = min(x, cap)                         truncated IS (Yao et al. 2025, "Your efficient
         RL framework secretly brings you off-policy RL training", fengyao.notion.site; verl cap 2)
  mis:   g(x) = x * 1[low <= x <= high]             masked IS, "IcePop" (Ling Team 2025,
         "Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model", arXiv 2510.18855)
at token level (x per token) or sequence level (x = prod_t of the token ratios, one weight per
completion, broadcast over its tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tunixlike.learner import losses

IS_MODES = ("none", "tis", "mis")
IS_LEVELS = ("token", "sequence")

# Keys of the per-token stats `importance_weights` returns.
STAT_KEYS = ("is_weight", "is_weight_sq", "is_raw_weight_max", "is_clipped_frac", "is_masked_frac", "mismatch_kl")

# A sequence-level log weight sums many token log-ratios; clip before exp to stay finite.
MAX_LOG_WEIGHT = 20.0


def importance_weights(prox_logp_bt, behav_logp_bt, mask_bt, *, mode: str, level: str,
                       cap: float = 2.0, low: float = 0.5, high: float = 2.0):
  """Stop-gradient weights w_bt [B, T] correcting behaviour -> proximal, and per-token stats.

  Stats (per token, [B, T]; the caller averages them over loss tokens, keys ending in "_max" are
  maxed): is_weight (applied weight), is_weight_sq (for the effective sample size),
  is_raw_weight_max, is_clipped_frac (tis), is_masked_frac (mis), mismatch_kl
  (k3 estimate of KL(pi_behav || pi_prox): x - 1 - log x with samples from pi_behav).
  """
  if mode not in IS_MODES:
    raise ValueError(f"algo.is_mode={mode!r} is not known; choose one of {IS_MODES}")
  if level not in IS_LEVELS:
    raise ValueError(f"algo.is_level={level!r} is not known; choose one of {IS_LEVELS}")
  mask = mask_bt.astype(jnp.float32)
  token_log_x = (jax.lax.stop_gradient(prox_logp_bt) - behav_logp_bt) * mask
  if level == "token":
    log_x = token_log_x
  else:
    log_x = jnp.broadcast_to(token_log_x.sum(axis=-1, keepdims=True), token_log_x.shape)
  log_x = jnp.clip(log_x, -MAX_LOG_WEIGHT, MAX_LOG_WEIGHT)
  x = jnp.exp(log_x)
  zeros = jnp.zeros_like(x)
  if mode == "none":
    w, clipped, masked = jnp.ones_like(x), zeros, zeros
  elif mode == "tis":
    w = jnp.minimum(x, cap)
    clipped, masked = (x > cap).astype(jnp.float32), zeros
  else:
    inside = (x >= low) & (x <= high)
    w = jnp.where(inside, x, 0.0)
    clipped, masked = zeros, (~inside).astype(jnp.float32)
  w = jax.lax.stop_gradient(w * mask)
  tok_x = jnp.exp(jnp.clip(token_log_x, -MAX_LOG_WEIGHT, MAX_LOG_WEIGHT))
  stats = {
      "is_weight": w,
      "is_weight_sq": jnp.square(w),
      "is_raw_weight_max": x,
      "is_clipped_frac": clipped,
      "is_masked_frac": masked,
      "mismatch_kl": tok_x - 1.0 - token_log_x,
  }
  return w, jax.tree.map(jax.lax.stop_gradient, stats)


def version_lag_stats(versions_bt, mask_bt, learner_version, segments_bt=None):
  """Staleness of the trained tokens: lag = learner_version - version that produced the token.

  Returns scalars: version_lag_mean / _min / _max over loss tokens, stale_token_frac (lag > 0) and
  mixed_version_seq_frac (completions whose tokens span a weight update, see DESIGN "Staleness").
  A completion is a row, or with `segments_bt` each segment of a row (as in `losses`).
  """
  mask = mask_bt.astype(bool)
  n = jnp.maximum(mask.sum(), 1)
  lag = (learner_version - versions_bt).astype(jnp.float32)
  big = jnp.float32(3.0e38)
  v = versions_bt.astype(jnp.int32)
  int_big = jnp.iinfo(jnp.int32).max
  high, low = jnp.where(mask, v, -int_big), jnp.where(mask, v, int_big)
  if segments_bt is None:
    row_max, row_min, rows = high.max(axis=-1), low.min(axis=-1), mask.any(axis=-1)
  else:
    ids = losses.sequence_ids(segments_bt)
    per_seq = lambda op, x: op(x.reshape(-1), ids, num_segments=ids.shape[0])
    row_max, row_min = per_seq(jax.ops.segment_max, high), per_seq(jax.ops.segment_min, low)
    rows = per_seq(jax.ops.segment_max, mask.astype(jnp.int32)) > 0
  return {
      "version_lag_mean": jnp.where(mask, lag, 0.0).sum() / n,
      "version_lag_max": jnp.where(mask.any(), jnp.where(mask, lag, -big).max(), 0.0),
      "version_lag_min": jnp.where(mask.any(), jnp.where(mask, lag, big).min(), 0.0),
      "stale_token_frac": (mask & (lag > 0)).sum() / n,
      "mixed_version_seq_frac": (rows & (row_max != row_min)).sum() / jnp.maximum(rows.sum(), 1),
  }
