"""Policy losses of the GRPO family (a registry looked up by name) and loss aggregation.

A loss maps per-token log-probabilities to a per-token loss `loss_bt` [B, T]; `aggregate` then
turns it into one scalar. Keeping the two apart lets the train step accumulate gradients over
micro-batches exactly: each micro-batch contributes `sum(loss_bt * token_weights_bt)` and the one
normaliser is computed from the whole batch's mask (see `token_weights` and `normaliser`).

Notation: logp = log pi_theta(y_t) (current policy, carries the gradient), old_logp = the policy
the trust region is measured from (the proximal policy in the decoupled objective, see
`is_correction`), A = the completion's advantage, w = an optional stop-gradient importance weight
(behaviour -> proximal correction). All functions are pure and shape-polymorphic in B and T.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

# log-ratios are clipped before exp so that one wild token cannot overflow to inf (its ratio is
# clipped by the objective anyway).
MAX_LOG_RATIO = 20.0

LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


def ppo_clip(logp_bt, old_logp_bt, advantages_b, mask_bt, *, eps_low, eps_high, is_weights_bt=None):
  """PPO clipped surrogate, per token (the GRPO objective without its KL term).

    r_t = exp(logp_t - old_logp_t)
    loss_t = -w_t * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)

  Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv 1707.06347, eq. (7);
  used per token with group advantages by GRPO (Shao et al. 2024, arXiv 2402.03300, eq. (3);
  eps = 0.2). At r = 1 the gradient is exactly the policy gradient -w A grad(logp).

  Returns (loss_bt [B, T], stats) where stats holds per-token indicators ("clip_frac") that the
  caller averages over the masked tokens.
  """
  del mask_bt  # masking happens in aggregation
  adv_bt = advantages_b[:, None].astype(logp_bt.dtype)
  log_ratio = jnp.clip(logp_bt - old_logp_bt, -MAX_LOG_RATIO, MAX_LOG_RATIO)
  ratio = jnp.exp(log_ratio)
  unclipped = -adv_bt * ratio
  clipped = -adv_bt * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  loss_bt = jnp.maximum(unclipped, clipped)
  if is_weights_bt is not None:
    loss_bt = loss_bt * jax.lax.stop_gradient(is_weights_bt)
  stats = {"clip_frac": (clipped > unclipped).astype(jnp.float32), "ratio": ratio}
  return loss_bt, stats


def dapo(logp_bt, old_logp_bt, advantages_b, mask_bt, *, eps_low, eps_high, is_weights_bt=None):
  """DAPO: the PPO clip objective with decoupled clip ranges ("clip-higher").

    loss_t = -w_t * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A),  eps_low=0.2, eps_high=0.28

  aggregated at token level (every token of the batch weighs the same, `token_mean`).
  Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
  arXiv 2503.14476, eq. (8)-(10). A larger eps_high lets unlikely tokens gain probability and so
  keeps entropy from collapsing. Its batch-level parts (dynamic sampling, the overlong penalty)
  live in `tunixlike.learner.dapo`.
  """
  return ppo_clip(logp_bt, old_logp_bt, advantages_b, mask_bt,
                  eps_low=eps_low, eps_high=eps_high, is_weights_bt=is_weights_bt)


def gspo(logp_bt, old_logp_bt, advantages_b, mask_bt, *, eps_low, eps_high, is_weights_bt=None):
  """GSPO: the clip objective on the length-normalised sequence likelihood ratio.

    s_i = (pi_theta(y_i | x) / pi_old(y_i | x)) ^ (1 / |y_i|) = exp(mean_t (logp_t - old_logp_t))
    loss_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),  eps = 3e-4 / 4e-4

  Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071, eq. (5)-(7).
  Implemented as GSPO-token (eq. (13)): s_it = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)] has the
  value s_i on every token of sequence i, so with `seq_mean_token_mean` aggregation the loss and
  its gradient equal the sequence-level objective, and token-level weights still compose.
  """
  mask = mask_bt.astype(logp_bt.dtype)
  adv_bt = advantages_b[:, None].astype(logp_bt.dtype)
  n_tokens = jnp.maximum(mask.sum(axis=-1, keepdims=True), 1.0)
  seq_log_ratio = ((logp_bt - old_logp_bt) * mask).sum(axis=-1, keepdims=True) / n_tokens  # [B, 1]
  seq_log_ratio = jnp.clip(seq_log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO)
  s_bt = jnp.exp(jax.lax.stop_gradient(seq_log_ratio) + logp_bt - jax.lax.stop_gradient(logp_bt))
  unclipped = -adv_bt * s_bt
  clipped = -adv_bt * jnp.clip(s_bt, 1.0 - eps_low, 1.0 + eps_high)
  loss_bt = jnp.maximum(unclipped, clipped)
  if is_weights_bt is not None:
    loss_bt = loss_bt * jax.lax.stop_gradient(is_weights_bt)
  stats = {"clip_frac": (clipped > unclipped).astype(jnp.float32), "ratio": s_bt}
  return loss_bt, stats


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
  """A registered loss with the paper's defaults (used when the config leaves a field unset)."""

  fn: LossFn
  eps_low: float
  eps_high: float
  aggregation: str


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": PolicyLoss(ppo_clip, eps_low=0.2, eps_high=0.2, aggregation="seq_mean_token_mean"),
    "dapo": PolicyLoss(dapo, eps_low=0.2, eps_high=0.28, aggregation="token_mean"),
    "gspo": PolicyLoss(gspo, eps_low=3e-4, eps_high=4e-4, aggregation="seq_mean_token_mean"),
}


def get_policy_loss(name: str) -> PolicyLoss:
  try:
    return POLICY_LOSSES[name]
  except KeyError:
    raise ValueError(
        f"algo.loss={name!r} is not a known policy loss; choose one of {sorted(POLICY_LOSSES)}") from None


# ---------------------------------------------------------------------------------------------
# Aggregation: loss = sum_bt(loss_bt * token_weights_bt) / normaliser.
#   token_mean               sum_{i,t} m_it l_it / sum_{i,t} m_it            (DAPO: every token equal)
#   seq_mean_token_mean      1/N sum_i (sum_t m_it l_it / sum_t m_it)       (GRPO paper)
#   seq_mean_token_sum_norm  1/N sum_i (sum_t m_it l_it / L)                (Dr. GRPO, L a constant)
# N counts the sequences with at least one loss token (padding rows do not dilute the mean). A
# sequence is a row, or with `segments_bt` (shared-prompt rows, `learner/prompt_rows.py`) each
# segment s > 0 of a row (segment 0, the shared prompt, and padding, -1, carry no loss).

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def check_aggregation(mode: str) -> str:
  if mode not in AGGREGATIONS:
    raise ValueError(f"algo.aggregation={mode!r} is not a known aggregation; choose one of {AGGREGATIONS}")
  return mode


def sequence_ids(segments_bt):
  """Each token's sequence as row * T + segment, flattened [B * T] (padding joins segment 0)."""
  b, t = segments_bt.shape
  return (jnp.arange(b)[:, None] * t + jnp.maximum(segments_bt, 0)).reshape(-1)


def _sequence_sums(mask_bt, segments_bt):
  """Per sequence ([B * T], by `sequence_ids`) the sum of the mask over its tokens; and the ids."""
  ids = sequence_ids(segments_bt)
  return jax.ops.segment_sum(mask_bt.reshape(-1), ids, num_segments=ids.shape[0]), ids


def token_weights(mask_bt, mode: str, norm_length: int | None = None, segments_bt=None):
  """Per-token weights [B, T] that depend only on each row (so micro-batches can compute them)."""
  check_aggregation(mode)
  mask = mask_bt.astype(jnp.float32)
  if mode == "token_mean":
    return mask
  if mode == "seq_mean_token_mean":
    if segments_bt is None:
      return mask / jnp.maximum(mask.sum(axis=-1, keepdims=True), 1.0)
    sums, ids = _sequence_sums(mask, segments_bt)
    return mask / jnp.maximum(sums[ids].reshape(mask.shape), 1.0)
  if not norm_length or norm_length <= 0:
    raise ValueError(f"aggregation 'seq_mean_token_sum_norm' needs algo.norm_length > 0, got {norm_length!r}")
  return mask / float(norm_length)


def normaliser(mask_bt, mode: str, segments_bt=None):
  """The denominator for the whole batch: the number of loss tokens or of non-empty sequences."""
  check_aggregation(mode)
  mask = mask_bt.astype(jnp.float32)
  if mode == "token_mean":
    return jnp.maximum(mask.sum(), 1.0)
  sums = mask.sum(axis=-1) if segments_bt is None else _sequence_sums(mask, segments_bt)[0]
  return jnp.maximum((sums > 0).sum().astype(jnp.float32), 1.0)


def aggregate(loss_bt, mask_bt, mode: str, norm_length: int | None = None):
  """One scalar from a per-token loss, for a batch that is not split into micro-batches."""
  return (loss_bt * token_weights(mask_bt, mode, norm_length)).sum() / normaliser(mask_bt, mode)
