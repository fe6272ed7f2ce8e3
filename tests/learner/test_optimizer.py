import numpy as np
import pytest

from tunixlike.learner import optimizer
from tunixlike.learner.config import OptimConfig


def test_warmup_then_constant():
  s = optimizer.make_schedule(OptimConfig(learning_rate=1e-3, warmup_steps=4))
  np.testing.assert_allclose([float(s(i)) for i in (0, 2, 4, 100)], [0.0, 5e-4, 1e-3, 1e-3], rtol=1e-6)


def test_cosine_reaches_zero_at_total_steps():
  s = optimizer.make_schedule(OptimConfig(learning_rate=1e-3, warmup_steps=2, schedule="cosine", total_steps=10))
  assert float(s(2)) == pytest.approx(1e-3)
  assert float(s(6)) == pytest.approx(5e-4, rel=1e-5)  # halfway through the decay
  assert float(s(10)) == pytest.approx(0.0, abs=1e-12)
