"""Policy-collapse detection: a blown-up policy is flagged (and by default stops the run) at the step
it happens, instead of training on and rotating the good checkpoints away.

Two signals, both from the learner's own step metrics:
- entropy: a policy whose mean token entropy rises to within `entropy_frac` of ln V (V = vocabulary
  size) is uniform over the vocabulary: it has forgotten everything (a learning rate far too high
  does this in one step). Only a policy seen below that band first counts: a freshly initialised
  model starts near uniform without having collapsed;
- spikes: a gradient norm more than `spike_factor` times the median of the last `window` finite
  steps (once `min_history` steps are known, so the first noisy steps never trip it). The loss is
  not used: GRPO losses cross zero, so a ratio to their median means nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Mapping

from tunixlike.settings import FromConfig, tree_key


class PolicyCollapse(FloatingPointError):
  """The policy collapsed (rl.stop_on_collapse); the message names the step and the signal."""


@dataclasses.dataclass(frozen=True)
class CollapseConfig(FromConfig):
  """`CollapseConfig.from_config(cfg, vocab_size=V)`: the run's rl.collapse_* keys."""

  vocab_size: int
  entropy_frac: float = tree_key("rl.collapse_entropy_frac")
  spike_factor: float = tree_key("rl.collapse_spike_factor")  # 0 = gradient-norm spikes are not checked
  window: int = 20
  min_history: int = 5


class CollapseDetector:

  def __init__(self, cfg: CollapseConfig):
    self.cfg = cfg
    self._grad_norms = collections.deque(maxlen=cfg.window)
    self._seen_informed = False  # an entropy below the uniform band was seen

  def check(self, metrics: Mapping[str, float]) -> str | None:
    """Why the step with these metrics looks collapsed, or None. Call once per learner step."""
    c = self.cfg
    entropy = metrics.get("entropy")
    uniform = math.log(c.vocab_size)
    if entropy is not None and math.isfinite(entropy):
      if entropy < (1 - c.entropy_frac) * uniform:
        self._seen_informed = True
      elif self._seen_informed:
        return (f"token entropy {entropy:.4g} is within {c.entropy_frac:.0%} of ln V = {uniform:.4g}: "
                "the policy is uniform over the vocabulary")
    norm, history = metrics.get("grad_norm"), self._grad_norms
    if norm is None or not math.isfinite(norm):
      return None
    reason = None
    if c.spike_factor and len(history) >= c.min_history:
      median = sorted(history)[len(history) // 2]
      if median > 0 and norm > c.spike_factor * median:
        reason = f"grad_norm {norm:.4g} is {norm / median:.0f}x the median of the last {len(history)} steps"
    history.append(norm)
    return reason


def stop_on_collapse(info) -> None:
  """A loop hook (`hooks.StepInfo`): raises PolicyCollapse at a step flagged as collapsed. Added
  after the metrics hook and before the eval and checkpoint hooks, so the step is logged, not saved."""
  if info.collapse is not None:
    raise PolicyCollapse(f"policy collapse at step {info.step}: {info.collapse} (rl.stop_on_collapse; lower "
                         "optim.learning_rate, or resume from the best checkpoint)")
