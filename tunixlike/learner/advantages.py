"""Advantage estimators for group-based policy optimisation (a registry looked up by name).

Every estimator maps the rewards of one prompt's G completions to G advantages, one scalar per
completion that the loss broadcasts over its tokens. They work on any leading batch shape:
`rewards_ng` is [N, G] (N groups of G) and the result has the same shape.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

AdvantageFn = Callable[[np.ndarray], np.ndarray]

# Keeps a group whose rewards are all equal at advantage 0 instead of 0 / 0.
STD_EPS = 1e-6


def _check_groups(rewards_ng: np.ndarray, name: str, min_size: int) -> np.ndarray:
  """The rewards as float32 (the rollout contract's type) computed in float64: sums of rewards near
  float32's limits (`algo.reward_clip` opened that far) would overflow the group mean, while a sum of G
  equal float32 values is exact in float64 (equal rewards give advantages of exactly 0). The
  advantages go back to float32."""
  rewards_ng = np.asarray(rewards_ng, dtype=np.float32).astype(np.float64)
  if rewards_ng.ndim < 1 or rewards_ng.shape[-1] < min_size:
    raise ValueError(
        f"advantage estimator {name!r} needs groups of at least {min_size} completions, "
        f"got rewards of shape {rewards_ng.shape}")
  return rewards_ng


def grpo(rewards_ng: np.ndarray) -> np.ndarray:
  """GRPO: the reward standardised within its group.

    A_i = (r_i - mean_j r_j) / (std_j r_j + eps)

  Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300, eq. (3) (outcome supervision). The std is
  the unbiased one (ddof=1), as in TRL and Tunix.
  """
  r = _check_groups(rewards_ng, "grpo", 2)
  mean = r.mean(axis=-1, keepdims=True)
  std = r.std(axis=-1, ddof=1, keepdims=True)
  return ((r - mean) / (std + STD_EPS)).astype(np.float32)


def dr_grpo(rewards_ng: np.ndarray) -> np.ndarray:
  """Dr. GRPO: the group-mean baseline without the std division.

    A_i = r_i - mean_j r_j

  Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv 2503.20783.
  Dividing by the std up-weights groups that are nearly all right or all wrong (a difficulty bias);
  the other half of the fix, no per-sequence length normalisation, is the aggregation mode
  `seq_mean_token_sum_norm` (see `losses.aggregate`).
  """
  r = _check_groups(rewards_ng, "dr_grpo", 1)
  return (r - r.mean(axis=-1, keepdims=True)).astype(np.float32)


def rloo(rewards_ng: np.ndarray) -> np.ndarray:
  """RLOO: each sample's baseline is the mean reward of the other G-1 samples.

    A_i = r_i - 1/(G-1) sum_{j != i} r_j  =  G/(G-1) (r_i - mean_j r_j)

  Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024,
  "Back to Basics: Revisiting REINFORCE Style Optimization for RLHF", arXiv 2402.14740.
  The leave-one-out baseline does not depend on r_i, so the estimator stays unbiased.
  """
  r = _check_groups(rewards_ng, "rloo", 2)
  g = r.shape[-1]
  loo_mean = (r.sum(axis=-1, keepdims=True) - r) / (g - 1)
  return (r - loo_mean).astype(np.float32)


def distill(rewards_ng: np.ndarray) -> np.ndarray:
  """On-policy distillation: no outcome term (A_i = 0); the whole advantage is per token, the
  teacher's reverse-KL reward log p_teacher(y_t) - log p_student(y_t) (`token_advantages.distill`).
  The outcome rewards are still computed and logged, they just do not train the policy."""
  r = _check_groups(rewards_ng, "distill", 1)
  return np.zeros(r.shape, np.float32)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "distill": distill}


def get_advantage_fn(name: str) -> AdvantageFn:
  """Look up an estimator; the error names the config key and the choices."""
  try:
    return ADVANTAGE_ESTIMATORS[name]
  except KeyError:
    raise ValueError(
        f"algo.advantage={name!r} is not a known advantage estimator; "
        f"choose one of {sorted(ADVANTAGE_ESTIMATORS)}") from None
