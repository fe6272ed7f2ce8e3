"""Periodic work on the RL loop: functions registered with `every=N`, run after learner steps.

    runtime.hooks.add(log_metrics)                 # every step
    runtime.hooks.add(evaluate, every=50)          # when the new policy version is a multiple of 50

A hook gets the step's `StepInfo`. Hooks run in the order they were added, on the learner thread,
after the step's weight sync (so the sampler decodes with the new weights meanwhile). A hook that
raises stops the run, and the hooks after it do not run for that step: the trainer adds its
collapse guard after the metrics hook and before the eval and checkpoint hooks, so a collapsed
step is logged but neither evaluated nor saved. `info.stop()` ends the run after this step as if
`rl.num_steps` were reached. The user's hooks (`tunixlike.train(hooks=...)`, `user_hooks`) run
before the metrics hook, so metrics a hook adds to `info.metrics` are logged with the step's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from tunixlike.rollout import RolloutGroup


def _no_stop():
  raise RuntimeError("StepInfo.stop: this StepInfo comes from no loop that can be stopped")


@dataclasses.dataclass
class StepInfo:
  step: int  # the policy version the batch trained (its metrics are logged at this step)
  version: int  # the policy version after the step (== step when a non-finite step was skipped)
  metrics: dict[str, Any]
  trained: list[RolloutGroup]
  dropped: list[RolloutGroup]  # dropped since the previous step (too stale, or no reward variance)
  collapse: str | None = None  # why the policy looks collapsed at this step (`collapse.py`), or None
  stop: Callable[[], None] = dataclasses.field(default=_no_stop, repr=False)  # ends the run after this step


Hook = Callable[[StepInfo], None]


def user_hooks(hooks: Sequence[Hook | Mapping[str, Any]] | None) -> list[tuple[Hook, int]]:
  """`tunixlike.train(hooks=...)` as (hook, every) pairs: each item is a function of `StepInfo` (run
  every step) or {"fn": function, "every": N}; anything else is refused naming the item."""
  out = []
  for i, item in enumerate(hooks or ()):
    fn, every = item, 1
    if isinstance(item, Mapping):
      unknown = set(item) - {"fn", "every"}
      if unknown or "fn" not in item:
        raise ValueError(f"hooks[{i}]: expected {{'fn': function, 'every': N}}, got keys {sorted(item)}")
      fn, every = item["fn"], item.get("every", 1)
    if not callable(fn):
      raise ValueError(f"hooks[{i}]: {fn!r} is not a function of StepInfo")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
      raise ValueError(f"hooks[{i}]: every={every!r} must be an int >= 1")
    out.append((fn, every))
  return out


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
