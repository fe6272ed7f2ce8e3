"""Slot groups: per-group attention windows, sequences moved to keep long ones together."""

import numpy as np
import pytest

from jit_traces import count_traces, engine_counts
from sampler_prompts import random_prompts
from tunixlike.sampler import Engine, PromptRequest, RolloutDriver, SamplerConfig

# Mixed lengths, so slots hold sequences at very different positions and the driver has to move some.
LIMITS = (20, 3, 6, 7, 6, 20, 21, 15, 2, 4, 9, 11, 16, 13)


def _requests():
  return [PromptRequest(prompt_id=i, token_ids=p, max_new_tokens=m)
          for i, (p, m) in enumerate(zip(random_prompts(len(LIMITS)), LIMITS))]


def _run(engine, params, windows=None):
  out = []
  driver = RolloutDriver(engine, params, source=iter(_requests()), sink=out.append)
  while driver.step() or not (driver.exhausted and driver.is_idle):
    if windows is not None:
      windows.append(driver.slots.state.arrays["cache"].windows)
  return {g.prompt_id: [c.token_ids.tolist() for c in g.completions] for g in out}, driver.stats


@pytest.mark.parametrize("temperature, group_size", [(0.0, 1), (1.0, 1)])
def test_slot_groups_give_the_same_completions_as_one_at_a_time(make_engine, temperature, group_size):
  grouped = make_engine(temperature=temperature, group_size=group_size, max_concurrent_decodes=4, slot_groups=2,
                        max_new_tokens=24, attend_bucket=8)
  one = make_engine(temperature=temperature, group_size=group_size, max_concurrent_decodes=group_size,
                    max_new_tokens=24, attend_bucket=8)
  params = grouped.load_params()
  windows = []
  with count_traces() as traces:
    got, stats = _run(grouped, params, windows)
  ref, _ = _run(one, params)
  assert got == ref and len(got) == len(LIMITS)
  assert all(len(c) == m for pid, cs in got.items() for c in cs for m in [LIMITS[pid]])
  assert stats.moves > 0 and traces["_move_impl"] > 0
  assert any(len(set(w)) > 1 for w in windows)  # the groups did attend different windows


def test_slot_groups_compile_nothing_new_on_a_repeat(make_engine):
  engine = make_engine(temperature=0.0, max_concurrent_decodes=4, slot_groups=2, max_new_tokens=24,
                       attend_bucket=8)
  params = engine.load_params()
  with count_traces() as traces:
    first, _ = _run(engine, params)
  counts = engine_counts(traces)
  with count_traces() as traces:
    again, _ = _run(engine, params)
  assert again == first and not any(engine_counts(traces).values()), traces
  n = len(engine.config.attend_windows)
  assert counts["generate"] <= n ** 2 and counts["move"] <= n ** 2 and counts["resize"] <= 2 * n


def test_slot_group_errors(tiny_model, mesh_1x1, make_engine):
  with pytest.raises(ValueError, match="slot_groups=3"):
    Engine(tiny_model, SamplerConfig(max_concurrent_decodes=4, max_new_tokens=8, slot_groups=3), mesh_1x1)
  with pytest.raises(ValueError, match="slot_groups"):
    SamplerConfig(slot_groups=0)
  engine = make_engine(temperature=0.0, max_concurrent_decodes=4, slot_groups=2)
  params = engine.load_params()
  state = engine.init_decode_state()
  prefix = engine.prefill(params, np.arange(5, dtype=np.int32))
  state = engine.insert(prefix, state, 0)
  with pytest.raises(ValueError, match="same slot group"):
    engine.move(state, 0, 1)  # slots 0 and 1 are both in group 0 (block 2)
  with pytest.raises(ValueError, match="must be decoding"):
    engine.move(state, 2, 3)
  moved = engine.move(state, 0, 2)
  assert moved.host_live.tolist() == [False, False, True, False]
  assert engine.plan_insert(moved, [0, 1, 3]) == (0, None)  # group 0 has no live sequence: youngest
  with pytest.raises(ValueError, match="no free slot"):
    engine.plan_insert(moved, [])
