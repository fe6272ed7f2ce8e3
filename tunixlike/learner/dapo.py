"""DAPO's batch-level parts: dynamic sampling (drop groups that teach nothing) and the soft
overlong penalty. Yu et al. 2025, "DAPO", arXiv 2503.14476, sections 3.2 and 3.4.

Both act on host data before batch assembly. The refill (keep sampling until the batch is full
again) belongs to whoever assembles batches: it calls `keep_informative_groups` on each arriving
chunk and keeps pulling groups until it has enough.
"""

from __future__ import annotations

import numpy as np

from tunixlike.rollout import RolloutGroup


def has_reward_variance(rewards_g: np.ndarray, atol: float = 1e-6) -> bool:
  """A group whose G rewards are all equal has zero advantage everywhere: no gradient signal.

  DAPO eq. (11): keep only groups with 0 < |{correct}| < G.
  """
  r = np.asarray(rewards_g, dtype=np.float64)
  return bool(r.size > 1 and (r.max() - r.min()) > atol)


def keep_informative_groups(groups: list[RolloutGroup]) -> tuple[list[RolloutGroup], int]:
  """Dynamic sampling filter: (groups with reward variance, number dropped)."""
  kept = []
  for g in groups:
    if g.rewards is None:
      raise ValueError(f"RolloutGroup(prompt_id={g.prompt_id!r}).rewards is None: score groups before filtering")
    if has_reward_variance(g.rewards):
      kept.append(g)
  return kept, len(groups) - len(kept)


def overlong_penalty(lengths: np.ndarray, max_length: int, buffer_length: int,
                     penalty: float = 1.0) -> np.ndarray:
  """Soft overlong punishment added to the reward, measured in completion tokens.

    R(|y|) = 0                                   if |y| <= L_max - L_buf
           = ((L_max - L_buf) - |y|) / L_buf     if L_max - L_buf < |y| <= L_max
           = -1                                  if |y| > L_max
  (times `penalty`). DAPO eq. (13). Truncated answers are punished gradually, so a correct but
  long reasoning chain is not confused with a wrong one.
  """
  if buffer_length <= 0 or buffer_length > max_length:
    raise ValueError(f"overlong buffer_length={buffer_length} must be in (0, max_length={max_length}]")
  lengths = np.asarray(lengths, dtype=np.float32)
  start = max_length - buffer_length
  ramp = (start - lengths) / buffer_length
  out = np.where(lengths <= start, 0.0, np.where(lengths <= max_length, ramp, -1.0))
  return (penalty * out).astype(np.float32)
