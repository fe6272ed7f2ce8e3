"""Engine.warmup compiles every program up front: a run after it compiles nothing and decodes the same."""

import pytest

from sampler_prompts import random_prompts
from test_engine import _decode_all, _fresh_model
from test_slot_groups import _run
from tunixlike.sampler import Engine, SamplerConfig

LENGTHS = (1, 2, 5, 8, 11, 16, 13, 3, 31, 20, 17, 32)


def _engine(**kw):
  kw = dict(max_prefill_length=32, max_new_tokens=24, max_concurrent_decodes=4, steps_per_call=3,
            attend_bucket=16, temperature=1.0, **kw)
  return Engine(_fresh_model(), SamplerConfig(**kw))


def test_nothing_compiles_after_warmup_and_samples_are_unchanged():
  warm, cold = _engine(), _engine()
  params = warm.load_params()
  counts = warm.warmup(params)
  cfg = warm.config
  assert counts == warm.trace_counts
  assert counts["prefill"] == len(cfg.prefill_buckets) and counts["generate"] == len(cfg.attend_windows)
  assert counts["release"] == 1 and counts["move"] == 0
  for seed in range(3):  # prompts of every bucket, completions crossing every window
    prompts = random_prompts(4, lengths=LENGTHS[seed:] + LENGTHS[:seed], seed=seed)
    assert _decode_all(warm, params, prompts) == _decode_all(cold, params, prompts)
  # Continuous batching with mixed lengths: windows shrink when the longest sequence ends first.
  assert _run(warm, params)[0] == _run(cold, params)[0]
  assert warm.trace_counts == counts
  # Without the warm-up the same run compiled on the way, and never more than the warm-up did.
  assert 0 < cold.trace_counts["generate"] and all(cold.trace_counts[k] <= counts[k] for k in counts)


@pytest.mark.slow  # windows ** 2 decode and move programs
def test_warmup_covers_slot_groups():
  engine = Engine(_fresh_model(), SamplerConfig(temperature=0.0, max_concurrent_decodes=4, slot_groups=2,
                                                max_new_tokens=24, attend_bucket=16))
  params = engine.load_params()
  counts = engine.warmup(params)
  n = len(engine.config.attend_windows)
  assert counts["generate"] == n ** 2 and counts["move"] == n ** 2
  _, stats = _run(engine, params)
  assert stats.moves > 0 and engine.trace_counts == counts
