"""Per-token advantages from per-token or per-step rewards: process supervision and on-policy distillation.

The group estimators in `advantages.py` give one advantage per completion. These give one per
*token*, so that a step the process reward model liked, or a token the teacher would have chosen,
is pushed up more than its neighbours. `group_advantages.AdvantageConfig.token` (the reward stage's, or
`batch.assemble_batch`'s `unscored`) puts them in `batch["token_advantages"]` [B, T] (aligned with
`tokens`), and the train step then uses the token-level clip loss (`gae.token_policy_loss`) instead of
broadcasting the row's advantage.

  A_t = A_outcome_i + process_coef * sum_{j : end_j >= t} r~_j + distill_coef * (log p_T(y_t) - log p_S(y_t))

All functions are numpy, on the host, one group at a time.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tunixlike.rollout import RolloutGroup

STD_EPS = 1e-6  # a group whose steps all scored the same gets 0, not 0 / 0


@dataclasses.dataclass(frozen=True)
class TokenAdvantageConfig:
  """Which per-token terms to add to the outcome advantage (all 0 = the plain group advantage)."""

  process_coef: float = 0.0  # weight of the process-supervised term (Completion.step_rewards)
  distill_coef: float = 0.0  # weight of the teacher's per-token reverse-KL reward (Completion.teacher_logprobs)

  def __post_init__(self):
    for name in ("process_coef", "distill_coef"):
      v = getattr(self, name)
      if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
        raise ValueError(f"TokenAdvantageConfig.{name}={v!r}: must be a finite number >= 0")
    if not (self.process_coef or self.distill_coef):
      raise ValueError("TokenAdvantageConfig: process_coef and distill_coef are both 0; pass None instead")


def _where(group: RolloutGroup, i: int) -> str:
  return f"RolloutGroup(prompt_id={group.prompt_id!r}).completions[{i}]"


def _check_steps(group: RolloutGroup) -> None:
  for i, c in enumerate(group.completions):
    if c.step_rewards is None or c.step_ends is None:
      raise ValueError(f"{_where(group, i)} has no step_rewards / step_ends, but algo.process_reward is on: "
                       "the group must come from a driver with a ProcessRewardRecorder and be collected by its scorer")
    ends, rewards = np.asarray(c.step_ends), np.asarray(c.step_rewards)
    if ends.ndim != 1 or ends.shape != rewards.shape:
      raise ValueError(f"{_where(group, i)}.step_ends has shape {ends.shape}, step_rewards {rewards.shape}: "
                       "expected the same [S]")
    if len(ends) and (ends[0] < 0 or ends[-1] >= c.num_tokens or np.any(np.diff(ends) <= 0)):
      raise ValueError(f"{_where(group, i)}.step_ends={ends.tolist()} must increase strictly within "
                       f"[0, {c.num_tokens})")
    if not np.all(np.isfinite(rewards)):
      raise ValueError(f"{_where(group, i)}.step_rewards={rewards.tolist()} has a non-finite value")


def process_supervised(group: RolloutGroup) -> list[np.ndarray]:
  """Process-supervised GRPO: per-token advantages from the step rewards of one group.

    r~_j = (r_j - mean(R)) / (std(R) + eps)      R = every step reward of every completion in the group
    A_t  = sum_{j : end_j >= t} r~_j              (the normalised rewards of the steps at or after t)

  Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300, sec. 4.1.3 (process supervision). std is
  the population std (a group may hold a single step). Returns one float32 [T_i] per completion.
  """
  _check_steps(group)
  pooled = np.concatenate([np.asarray(c.step_rewards, np.float64) for c in group.completions])
  mean = pooled.mean() if pooled.size else 0.0
  std = pooled.std() if pooled.size else 0.0
  out = []
  for c in group.completions:
    norm = (np.asarray(c.step_rewards, np.float64) - mean) / (std + STD_EPS)
    suffix = np.cumsum(norm[::-1])[::-1]  # suffix[j] = sum_{k >= j} norm_k
    adv = np.zeros(c.num_tokens, np.float64)
    start = 0
    for end, value in zip(np.asarray(c.step_ends), suffix):
      adv[start:end + 1] = value  # step j covers tokens (end_{j-1}, end_j]
      start = end + 1
    out.append(adv.astype(np.float32))
  return out


def distill(group: RolloutGroup) -> list[np.ndarray]:
  """On-policy distillation: each sampled token's reward is the negative per-token reverse KL,

    r_t = log p_teacher(y_t | x, y_<t) - log p_student(y_t | x, y_<t),    y ~ p_student

  with the student's logprob the one the sampler recorded for y_t (the behaviour policy). Its
  expectation over y_t is -KL(p_student || p_teacher) at that position, so the policy gradient with
  A_t = r_t (no discounting, as in Agarwal et al. 2024, "On-Policy Distillation of Language
  Models", arXiv 2306.13649, and Thinking Machines' "On-Policy Distillation", 2025) lowers the
  student's reverse KL to the teacher. Tokens the policy did not produce (loss_mask 0) get 0.
  """
  out = []
  for i, c in enumerate(group.completions):
    if c.teacher_logprobs is None:
      raise ValueError(f"{_where(group, i)} has no teacher_logprobs, but algo.advantage='distill': the reward "
                       "stage must score the group with a teacher (rl/distill.py)")
    r = np.asarray(c.teacher_logprobs, np.float32) - np.asarray(c.logprobs, np.float32)
    if c.loss_mask is not None:
      r = r * (np.asarray(c.loss_mask) > 0)
    if not np.all(np.isfinite(r)):
      raise ValueError(f"{_where(group, i)}: teacher_logprobs - logprobs has a non-finite value (a token the "
                       "teacher or the sampler gives probability 0)")
    out.append(r.astype(np.float32))
  return out


def group_token_advantages(group: RolloutGroup, outcome_adv_g: np.ndarray,
                           cfg: TokenAdvantageConfig) -> list[np.ndarray]:
  """A_t of every completion of `group` (float32 [T_i] each): outcome advantage + weighted terms."""
  out = [np.full(c.num_tokens, float(a), np.float32) for c, a in zip(group.completions, outcome_adv_g)]
  if cfg.process_coef:
    out = [a + np.float32(cfg.process_coef) * p for a, p in zip(out, process_supervised(group))]
  if cfg.distill_coef:
    out = [a + np.float32(cfg.distill_coef) * d for a, d in zip(out, distill(group))]
  return out

