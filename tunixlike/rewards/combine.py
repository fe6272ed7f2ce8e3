"""A weighted sum of reward functions, each run safely, with per-function metrics."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from tunixlike.rewards import registry
from tunixlike.rewards.safe import SafeReward


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """One term of the reward: `weight * get(name, **kwargs)(prompts, completions, **columns)`."""

  name: str
  weight: float = 1.0
  kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.name not in registry.names():
      raise ValueError(f"RewardSpec.name={self.name!r} is not a registered reward; known: {registry.names()}")
    if not np.isfinite(self.weight):
      raise ValueError(f"RewardSpec({self.name!r}).weight={self.weight} must be finite")


class CombinedReward:
  """`__call__(prompts, completions, **columns) -> (rewards float32 [N], metrics)`.

  metrics: `rewards/<name>` (mean unweighted score), `rewards/<name>/failures` (samples that
  scored 0 by failure in this call) and `rewards/total` (mean weighted sum).
  """

  def __init__(self, specs: Sequence[RewardSpec | str | tuple], *, timeout_s: float = 60.0):
    if not specs:
      raise ValueError("CombinedReward needs at least one reward function")
    self.specs = [_as_spec(s) for s in specs]
    names = [s.name for s in self.specs]
    if len(set(names)) != len(names):
      raise ValueError(f"CombinedReward: reward names repeat: {names}")
    self.fns = [SafeReward(registry.get(s.name, **s.kwargs), name=s.name, timeout_s=timeout_s) for s in self.specs]

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns) -> tuple[np.ndarray,
                                                                                             dict[str, float]]:
    if len(prompts) != len(completions):
      raise ValueError(f"CombinedReward: {len(prompts)} prompts for {len(completions)} completions")
    total_n = np.zeros(len(completions), np.float32)
    metrics: dict[str, float] = {}
    for spec, fn in zip(self.specs, self.fns):
      scores, failed = fn(prompts, completions, **columns)
      scores_n = np.asarray(scores, np.float32)
      total_n += spec.weight * scores_n
      metrics[f"rewards/{spec.name}"] = float(scores_n.mean()) if len(scores_n) else 0.0
      metrics[f"rewards/{spec.name}/failures"] = float(failed)
    metrics["rewards/total"] = float(total_n.mean()) if len(total_n) else 0.0
    return total_n, metrics


def _as_spec(spec: RewardSpec | str | tuple) -> RewardSpec:
  """Accepts RewardSpec, "name", (name, weight) or (name, weight, kwargs)."""
  if isinstance(spec, RewardSpec):
    return spec
  if isinstance(spec, str):
    return RewardSpec(spec)
  if isinstance(spec, tuple) and 1 <= len(spec) <= 3:
    return RewardSpec(*spec)
  raise ValueError(f"cannot read reward spec {spec!r}; use 'name', (name, weight) or (name, weight, kwargs)")
