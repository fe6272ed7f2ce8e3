"""PPO with a critic: generalised advantage estimation, the KL-penalised token reward, the value loss.

All functions are pure and work on [B, T] arrays whose `mask_bt` marks the tokens the policy
produced (the loss tokens). Index t is one decision: the state before token t's action, its value
V_t, its reward r_t. Masked positions (prompt, padding, tool output inside a multi-turn episode)
are skipped, not treated as episode ends: the recursion carries over them, so the next value of a
loss token is the value of the next *loss* token, and the value after the last one is 0 (terminal)
unless a bootstrap value is given (e.g. for a completion cut at the length limit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tunixlike.learner import kl as kl_lib, losses


def check_discounts(gamma: float, gae_lambda: float) -> None:
  """gamma and lambda are probabilities-like weights: outside [0, 1] the sums diverge or flip sign."""
  if not 0.0 <= gamma <= 1.0:
    raise ValueError(f"algo.gamma={gamma!r}: must be in [0, 1]")
  if not 0.0 <= gae_lambda <= 1.0:
    raise ValueError(f"algo.gae_lambda={gae_lambda!r}: must be in [0, 1]")


def gae(rewards_bt, values_bt, mask_bt, *, gamma: float, gae_lambda: float, bootstrap_b=None):
  """Generalised advantage estimation over the loss tokens of each row.

    delta_t = r_t + gamma * V_{t'} - V_t                     (t' = the next loss token; V = 0 past the end)
    A_t     = delta_t + gamma * lambda * A_{t'}
    R_t     = A_t + V_t                                      (the value target, "returns")

  Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
  Estimation", arXiv 1506.02438, eq. (16). lambda = 1 gives the Monte-Carlo return minus V_t;
  lambda = 0 gives the one-step TD error. Computed right to left with `lax.scan(reverse=True)`
  over T (O(T) sequential steps of [B] vector work, one compiled loop for any T).

  rewards_bt, values_bt: float [B, T]; mask_bt: [B, T] (1 = loss token); bootstrap_b: float [B]
  value after the last token (None = 0, the episode ended). Returns (advantages_bt, returns_bt),
  both 0 on masked positions. Values are treated as constants (stop-gradient).
  """
  check_discounts(gamma, gae_lambda)
  if not (rewards_bt.shape == values_bt.shape == mask_bt.shape) or rewards_bt.ndim != 2:
    raise ValueError(f"gae: rewards_bt {rewards_bt.shape}, values_bt {values_bt.shape} and mask_bt "
                     f"{mask_bt.shape} must all be the same [B, T]")
  r_tb = jnp.swapaxes(rewards_bt.astype(jnp.float32), 0, 1)
  v_tb = jnp.swapaxes(jax.lax.stop_gradient(values_bt).astype(jnp.float32), 0, 1)
  m_tb = jnp.swapaxes(mask_bt.astype(jnp.float32), 0, 1)
  b = rewards_bt.shape[0]
  next_v = jnp.zeros((b,), jnp.float32) if bootstrap_b is None else jnp.asarray(bootstrap_b, jnp.float32)

  def step(carry, x):
    next_value, next_adv = carry  # of the next loss token to the right
    r, v, m = x
    adv = r + gamma * next_value - v + gamma * gae_lambda * next_adv
    # a masked position passes the carry through unchanged: it is not a decision of the policy
    carry = (m * v + (1 - m) * next_value, m * adv + (1 - m) * next_adv)
    return carry, m * adv

  _, adv_tb = jax.lax.scan(step, (next_v, jnp.zeros((b,), jnp.float32)), (r_tb, v_tb, m_tb), reverse=True)
  adv_bt = jnp.swapaxes(adv_tb, 0, 1)
  returns_bt = (adv_bt + jnp.swapaxes(v_tb, 0, 1)) * mask_bt.astype(jnp.float32)
  return adv_bt, returns_bt


def scores_to_token_rewards(scores_b, mask_bt):
  """A per-completion score as a sparse token reward: r_t = score on the last loss token, else 0."""
  mask = mask_bt.astype(jnp.float32)
  t = mask.shape[-1]
  last = (t - 1) - jnp.argmax(mask[:, ::-1], axis=-1)  # [B] index of the last loss token
  has_any = mask.sum(-1) > 0
  onehot = jax.nn.one_hot(last, t, dtype=jnp.float32) * has_any[:, None]
  return onehot * scores_b.astype(jnp.float32)[:, None]


def kl_penalized_rewards(rewards_bt, logp_bt, ref_logp_bt, mask_bt, *, kl_coef: float, estimator: str = "k1"):
  """Fold a per-token KL penalty into the rewards (the critic-based PPO recipe for RLHF):

    r'_t = r_t - beta * KL_t,   KL_t = k(logp_t, ref_logp_t)   on loss tokens

  Ouyang et al. 2022, "Training language models to follow instructions with human feedback",
  arXiv 2203.02155, eq. (2) (k1 = log pi - log pi_ref per token, as in Ziegler et al. 2019). Unlike
  the GRPO loss term, this penalty is discounted through GAE like any other reward. No gradient
  flows through it (the rewards are data). Returns (rewards_bt, kl_bt).
  """
  if kl_coef < 0:
    raise ValueError(f"algo.kl_reward_coef={kl_coef!r}: must be >= 0")
  kl_bt = jax.lax.stop_gradient(kl_lib.get_kl_fn(estimator)(logp_bt, ref_logp_bt)) * mask_bt.astype(jnp.float32)
  return rewards_bt.astype(jnp.float32) - kl_coef * kl_bt, kl_bt


def value_loss(values_bt, old_values_bt, returns_bt, mask_bt, *, clip_eps: float | None):
  """PPO's clipped value loss, per token:

    V_clip = V_old + clip(V - V_old, -eps, eps)
    loss_t = 1/2 * max((V - R)^2, (V_clip - R)^2)

  (PPO2 in OpenAI baselines, `ppo2/model.py`; Schulman et al. 2017, arXiv 1707.06347, sec. 5 uses
  the unclipped squared error). The clip keeps the critic inside a trust region around the values
  the advantages were computed from. clip_eps=None gives the plain 1/2 (V - R)^2.

  Returns (loss_bt [B, T], stats) with stats["vf_clip_frac"] per token (the clipped branch was
  larger). Masking happens in aggregation, as for the policy losses.
  """
  del mask_bt
  if clip_eps is not None and clip_eps <= 0:
    raise ValueError(f"algo.vf_clip={clip_eps!r}: must be > 0 (or None for no clipping)")
  v = values_bt.astype(jnp.float32)
  ret = jax.lax.stop_gradient(returns_bt.astype(jnp.float32))
  unclipped = jnp.square(v - ret)
  if clip_eps is None:
    return 0.5 * unclipped, {"vf_clip_frac": jnp.zeros_like(unclipped)}
  old = jax.lax.stop_gradient(old_values_bt.astype(jnp.float32))
  clipped = jnp.square(old + jnp.clip(v - old, -clip_eps, clip_eps) - ret)
  return 0.5 * jnp.maximum(unclipped, clipped), {"vf_clip_frac": (clipped > unclipped).astype(jnp.float32)}


def masked_whiten(x_bt, mask_bt, eps: float = 1e-8):
  """(x - mean) / std over the masked entries (PPO's advantage normalisation); 0 elsewhere."""
  mask = mask_bt.astype(jnp.float32)
  n = jnp.maximum(mask.sum(), 1.0)
  mean = (x_bt * mask).sum() / n
  var = (jnp.square(x_bt - mean) * mask).sum() / n
  return (x_bt - mean) * jax.lax.rsqrt(var + eps) * mask


TOKEN_LEVEL_LOSSES = ("ppo_clip", "dapo")  # gspo's ratio is per sequence: it has no per-token advantage


def token_policy_loss(name: str, logp_bt, old_logp_bt, advantages_bt, mask_bt, *, eps_low, eps_high,
                      is_weights_bt=None):
  """A registered clip loss (`losses.POLICY_LOSSES[name]`) with one advantage per *token* (GAE).

  The registry's losses take one advantage per row; here every token becomes its own row of
  length 1, so the objective is exactly the registered one (same clip, same IS weight) with
  A_t in place of A. Returns (loss_bt [B, T], stats) like the registry's functions.
  """
  if name not in TOKEN_LEVEL_LOSSES:
    raise ValueError(f"algo.loss={name!r} cannot take per-token (GAE) advantages; choose one of {TOKEN_LEVEL_LOSSES}")
  b, t = logp_bt.shape
  flat = lambda x: None if x is None else x.reshape(b * t, 1)
  loss_n1, stats = losses.get_policy_loss(name).fn(
      flat(logp_bt), flat(old_logp_bt), advantages_bt.reshape(b * t), flat(mask_bt),
      eps_low=eps_low, eps_high=eps_high, is_weights_bt=flat(is_weights_bt))
  return loss_n1.reshape(b, t), {k: v.reshape(b, t) for k, v in stats.items()}
