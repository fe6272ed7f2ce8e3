"""A guard against unlearning: a run whose held-out accuracy stays below where RL started stops.

Too high a learning rate (or a reward the policy can game) can wipe out what the supervised stage or
the pretrained model knew, while the training reward still looks busy. The held-out evaluations at
`eval.every_steps` show it: when the last `eval.unlearn_evals` of them all lie more than
`eval.unlearn_margin` below the accuracy at the RL stage's start (the step-0 evaluation), the run
stops with one line that names the keys and the best checkpoint. The rule reads only the evaluations
themselves, so a resumed run (which reads them back from metrics.jsonl) applies it the same way.
"""

from __future__ import annotations

from typing import Mapping


class Unlearning(RuntimeError):
  """Held-out accuracy stayed below the RL stage's start (eval.unlearn_margin, eval.unlearn_evals)."""


def best(evals: Mapping[int, float]) -> tuple[int, float] | None:
  """(step, accuracy) of the best evaluation, or None before any. Of equal ones the newest, as the
  checkpointer's best-checkpoint policy keeps (`checkpoint.Checkpointer(best_metric=)`)."""
  return max(evals.items(), key=lambda item: (item[1], item[0])) if evals else None


def check(evals: Mapping[int, float], *, margin: float, patience: int) -> str | None:
  """What went wrong when the last `patience` evaluations after the first all lie more than `margin`
  below the first one (the RL stage's start); None otherwise (and always for patience 0)."""
  steps = sorted(evals)
  if not patience or len(steps) <= patience:
    return None
  start, recent = steps[0], steps[-patience:]
  floor = evals[start] - margin
  if not all(evals[s] < floor for s in recent):
    return None
  seen = ", ".join(f"{evals[s]:.3f} at step {s}" for s in recent)
  return (f"held-out accuracy fell more than eval.unlearn_margin={margin:g} below the RL stage's start "
          f"({evals[start]:.3f} at step {start}) in the last {patience} evals (eval.unlearn_evals): {seen}; "
          "the run is unlearning its task")
