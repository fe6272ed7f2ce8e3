"""Estimators of KL(pi_theta || pi_ref) from tokens sampled from pi_theta (a registry by name).

With log_r = ref_logp - logp (per token, samples from pi_theta):
  k1 = -log_r                     unbiased, high variance, can be negative
  k2 = log_r^2 / 2                biased, low variance, >= 0
  k3 = exp(log_r) - 1 - log_r     unbiased, low variance, >= 0 (GRPO uses it, beta = 0.04)
J. Schulman, "Approximating KL Divergence", 2020, http://joschu.net/blog/kl-approx.html;
k3 in GRPO: Shao et al. 2024, arXiv 2402.03300, eq. (4).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

# exp of a very negative/positive log-ratio would give 0 / inf; the KL term should be bounded.
MAX_LOG_RATIO = 20.0


def k1(logp_bt, ref_logp_bt):
  return logp_bt - ref_logp_bt


def k2(logp_bt, ref_logp_bt):
  return 0.5 * jnp.square(ref_logp_bt - logp_bt)


def k3(logp_bt, ref_logp_bt):
  log_r = jnp.clip(ref_logp_bt - logp_bt, -MAX_LOG_RATIO, MAX_LOG_RATIO)
  # expm1 keeps the relative precision of small log-ratios, where exp(r) - 1 cancels to zero in fp32.
  return jnp.expm1(log_r) - log_r


KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {"k1": k1, "k2": k2, "k3": k3}


def get_kl_fn(name: str):
  try:
    return KL_ESTIMATORS[name]
  except KeyError:
    raise ValueError(
        f"algo.kl_estimator={name!r} is not a known KL estimator; choose one of {sorted(KL_ESTIMATORS)}") from None
