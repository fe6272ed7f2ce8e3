"""Hooks on the RL loop: `every=` on the policy version, registration order, a raising hook stops the rest."""

import pytest

from tunixlike.rl.collapse import PolicyCollapse, stop_on_collapse
from tunixlike.rl.hooks import Hooks, StepInfo


def info(version, collapse=None):
  return StepInfo(step=version - 1, version=version, metrics={}, trained=[], dropped=[], collapse=collapse)


def test_hooks_run_in_order_when_the_version_is_a_multiple_of_every():
  calls, hooks = [], Hooks()
  hooks.add(lambda i: calls.append(("each", i.version)))
  hooks.add(lambda i: calls.append(("third", i.version)), every=3)
  for v in range(1, 7):
    hooks.run(info(v))
  assert [c for c in calls if c[0] == "third"] == [("third", 3), ("third", 6)]
  assert calls[:4] == [("each", 1), ("each", 2), ("each", 3), ("third", 3)]
  with pytest.raises(ValueError, match="every=0"):
    hooks.add(lambda i: None, every=0)


def test_a_skipped_step_makes_no_version_so_periodic_hooks_do_not_run_again():
  calls, hooks = [], Hooks()
  hooks.add(lambda i: calls.append(("each", i.version)))
  hooks.add(lambda i: calls.append(("eval", i.version)), every=2)
  hooks.run(info(2))
  for _ in range(2):  # non-finite steps at version 2: trained nothing, the version stays
    hooks.run(StepInfo(step=2, version=2, metrics={}, trained=[], dropped=[]))
  assert calls == [("each", 2), ("eval", 2), ("each", 2), ("each", 2)]


def test_the_collapse_guard_stops_the_hooks_after_it():
  calls, hooks = [], Hooks()
  hooks.add(lambda i: calls.append("metrics"))
  hooks.add(stop_on_collapse)
  hooks.add(lambda i: calls.append("save"))
  hooks.run(info(1))
  with pytest.raises(PolicyCollapse, match="policy collapse at step 1: entropy"):
    hooks.run(info(2, collapse="entropy near ln V"))
  assert calls == ["metrics", "save", "metrics"]
