"""Engine.warmup compiles every program up front: a run after it compiles nothing and decodes the same."""

import pytest

from jit_traces import count_traces, engine_counts
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
  with count_traces() as traces:
    warm.warmup(params)
  counts = engine_counts(traces)
  cfg = warm.config
  assert counts["prefill"] == len(cfg.prefill_buckets) * len(cfg.prompt_batch_sizes)
  assert counts["generate"] == len(cfg.attend_windows)
  assert counts["release"] == 1 and counts["move"] == 0

  def decode(engine):  # prompts of every bucket, completions crossing every window
    out = [_decode_all(engine, params, random_prompts(4, lengths=LENGTHS[seed:] + LENGTHS[:seed], seed=seed))
           for seed in range(3)]
    # Continuous batching with mixed lengths: windows shrink when the longest sequence ends first.
    return out + [_run(engine, params)[0]]

  with count_traces() as warm_traces:
    warm_out = decode(warm)
  with count_traces() as cold_traces:
    cold_out = decode(cold)
  assert warm_out == cold_out
  assert not any(engine_counts(warm_traces).values()), warm_traces
  # Without the warm-up the same run compiled on the way, and never more than the warm-up did.
  cold_counts = engine_counts(cold_traces)
  assert 0 < cold_counts["generate"] and all(cold_counts[k] <= counts[k] for k in counts)


@pytest.mark.slow  # windows ** 2 decode and move programs
def test_warmup_covers_slot_groups():
  # Prompts of <= 16 tokens: 3 windows (9 + 9 programs) instead of the default 64's 6 (36 + 36).
  engine = Engine(_fresh_model(), SamplerConfig(temperature=0.0, max_concurrent_decodes=4, slot_groups=2,
                                                max_prefill_length=16, max_new_tokens=24, attend_bucket=16))
  params = engine.load_params()
  with count_traces() as traces:
    engine.warmup(params)
  counts = engine_counts(traces)
  n = len(engine.config.attend_windows)
  assert n >= 3  # more than one window per group, so the tuples and moves are real
  assert counts["generate"] == n ** 2 and counts["move"] == n ** 2
  with count_traces() as traces:
    _, stats = _run(engine, params)
  assert stats.moves > 0 and not any(engine_counts(traces).values()), traces
