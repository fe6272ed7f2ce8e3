"""Periodic work on the RL loop: functions registered with `every=N`, run after learner steps.

    runtime.hooks.add(log_metrics)                 # every step
    runtime.hooks.add(evaluate, every=50)          # when the new policy version is a multiple of 50

A hook gets the step's `StepInfo`. Hooks run in the order they were added, on the learner thread,
after the step's weight sync (so the sampler decodes with the new weights meanwhile). A hook that
raises stops the run, and the hooks after it do not run for that step: the trainer adds its
collapse guard after the metrics hook and before the eval and checkpoint hooks, so a collapsed
step is logged but neither evaluated nor saved.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from tunixlike.rollout import RolloutGroup


@dataclasses.dataclass
class StepInfo:
  step: int  # the policy version the batch trained (its metrics are logged at this step)
  version: int  # the policy version after the step (== step when a non-finite step was skipped)
  metrics: dict[str, Any]
  trained: list[RolloutGroup]
  dropped: list[RolloutGroup]  # dropped since the previous step (too stale, or no reward variance)
  collapse: str | None = None  # why the policy looks collapsed at this step (`collapse.py`), or None


Hook = Callable[[StepInfo], None]


class Hooks:
  """An ordered list of (hook, every)."""

  def __init__(self):
    self._hooks: list[tuple[Hook, int]] = []

  def add(self, fn: Hook, *, every: int = 1) -> Hook:
    if every < 1:
      raise ValueError(f"hook {getattr(fn, '__name__', fn)!r}: every={every} must be >= 1")
    self._hooks.append((fn, every))
    return fn

  def run(self, info: StepInfo) -> None:
    """Every-step hooks always; periodic ones when the step made a new version that is a multiple of
    theirs (a skipped non-finite step made none: its version's eval is not redone)."""
    advanced = info.version != info.step
    for fn, every in self._hooks:
      if every == 1 or (advanced and info.version % every == 0):
        fn(info)
