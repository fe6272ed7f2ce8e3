"""Collapse detection on step metrics: a uniform policy after an informed one, and gradient spikes."""

import math

import pytest

from tunixlike import config as config_lib
from tunixlike.rl.collapse import CollapseConfig, CollapseDetector

V = 83
UNIFORM = math.log(V)
RL = config_lib.Config().rl  # the run's rl.collapse_* defaults


def test_the_library_guard_is_the_runs():
  """A library user gets the CLI's guard: spikes checked at rl.collapse_spike_factor's default."""
  c = CollapseConfig.from_config(config_lib.Config(), vocab_size=V)
  assert (c.entropy_frac, c.spike_factor) == (RL.collapse_entropy_frac, RL.collapse_spike_factor) == (0.01, 1000.0)
  with pytest.raises(TypeError, match="spike_factor"):
    CollapseConfig(vocab_size=V, entropy_frac=0.01)  # no default of its own


def test_a_policy_that_turns_uniform_is_flagged_once_it_was_informed():
  d = CollapseDetector(CollapseConfig.from_config(RL, vocab_size=V))
  assert d.check({"entropy": 0.999 * UNIFORM}) is None  # a fresh model starts near uniform: not a collapse
  assert d.check({"entropy": 0.5 * UNIFORM}) is None
  reason = d.check({"entropy": 0.995 * UNIFORM})
  assert reason is not None and "ln V" in reason and "uniform" in reason
  assert d.check({"entropy": 0.98 * UNIFORM}) is None  # outside the 1% band


def test_grad_norm_spikes_beyond_the_factor_of_the_recent_median():
  d = CollapseDetector(CollapseConfig.from_config(RL, vocab_size=V, spike_factor=100.0, window=10, min_history=5))
  assert d.check({"grad_norm": 1e6}) is None  # no history yet: the first steps never trip it
  d = CollapseDetector(CollapseConfig.from_config(RL, vocab_size=V, spike_factor=100.0, window=10, min_history=5))
  for norm in (1.0, 2.0, 1.5, 0.5, 1.2):
    assert d.check({"grad_norm": norm}) is None
  assert d.check({"grad_norm": 99.0}) is None
  reason = d.check({"grad_norm": 1e4})
  assert reason is not None and reason.startswith("grad_norm 1e+04")
  assert d.check({"grad_norm": float("nan")}) is None  # non-finite steps have their own guard


@pytest.mark.parametrize("factor", [0.0])
def test_spikes_off(factor):
  d = CollapseDetector(CollapseConfig.from_config(RL, vocab_size=V, spike_factor=factor, min_history=1))
  for norm in (1.0, 1.0, 1e9):
    assert d.check({"grad_norm": norm}) is None
