"""Batched admission: the groups admitted at one refill share one prefill call and one insert call
(`Engine.prefill_many` / `insert_many`), and give the same completions as one group at a time."""

import jax
import numpy as np
import pytest

from jit_traces import count_traces, engine_counts
from sampler_prompts import random_prompts
from tunixlike.sampler import Engine, PromptRequest, RolloutDriver, SamplerConfig
from tunixlike.sampler.single_turn import SingleTurn

# Every prompt bucket of max_prefill_length=32 (16, 32), in mixed order.
LENGTHS = (1, 3, 7, 12, 5, 16, 9, 2, 31, 20, 17, 32)


class _OneAtATime(SingleTurn):
  """The path before batched admission: each group its own prefill, each sample its own insert."""

  def refill(self, free):
    if free:
      self.refill_one_at_a_time(free)


def one_group_at_a_time(engine, params, **kw):
  return RolloutDriver(engine, params, episodes=_OneAtATime(), **kw)


def _refill(driver):
  driver.episodes.refill(driver.slots.free())


class ProgramCalls:
  """Counts calls of an engine's prefill and insert programs (wraps the jitted functions)."""

  def __init__(self, engine):
    self.engine, self.counts = engine, {}
    self._saved = {name: getattr(engine, name) for name in ("_prefill_fn", "_insert_fn")}

  def __enter__(self):
    for name, fn in self._saved.items():
      setattr(self.engine, name, self._counted(name, fn))
    return self.counts

  def __exit__(self, *exc):
    for name, fn in self._saved.items():
      setattr(self.engine, name, fn)

  def _counted(self, name, fn):
    def call(*args, **kwargs):
      self.counts[name] = self.counts.get(name, 0) + 1
      return fn(*args, **kwargs)
    return call


def _requests(n, seed=0, limits=None):
  return [PromptRequest(prompt_id=i, token_ids=p, max_new_tokens=None if limits is None else limits[i % len(limits)])
          for i, p in enumerate(random_prompts(n, lengths=LENGTHS, seed=seed))]


def _engine(make_engine, **kw):
  kw = dict(max_prefill_length=32, max_new_tokens=12, max_concurrent_decodes=8, **kw)
  return make_engine(**kw)


def _run(driver_cls, engine, requests, params, swap_after=None, **kw):
  """Runs to the end; with swap_after=(steps, params, version), new weights after that many steps."""
  out = []
  driver = driver_cls(engine, params, source=iter(requests), sink=out.append, **kw)
  if swap_after is not None:
    steps, new_params, version = swap_after
    for _ in range(steps):
      driver.step()
    driver.update_params(new_params, version)
  driver.run(max_wall_s=120)
  return {g.prompt_id: g for g in out}, driver


def _assert_same_groups(got, ref):
  assert sorted(got) == sorted(ref)
  for pid in ref:
    for a, b in zip(got[pid].completions, ref[pid].completions, strict=True):
      np.testing.assert_array_equal(a.token_ids, b.token_ids)
      np.testing.assert_array_equal(a.policy_versions, b.policy_versions)
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
      assert a.finish_reason == b.finish_reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_admission_gives_the_same_groups_as_one_group_at_a_time(make_engine, temperature):
  # 8 slots, groups of 3: refills admit two or three groups, the last usually only partly inserted;
  # per-prompt limits end groups at different steps, and the weights change mid-run.
  engine = _engine(make_engine, temperature=temperature, group_size=3)
  params = engine.load_params()
  noisy = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(1), x.shape, x.dtype), params)
  requests = _requests(12, limits=(12, 2, 5, 9, 3))
  with ProgramCalls(engine) as batched_calls:
    got, driver = _run(RolloutDriver, engine, requests, params, swap_after=(2, noisy, 1))
  with ProgramCalls(engine) as one_calls:
    ref, one = _run(one_group_at_a_time, engine, requests, params, swap_after=(2, noisy, 1))
  _assert_same_groups(got, ref)
  versions = {int(v) for g in got.values() for c in g.completions for v in c.policy_versions}
  assert versions == {0, 1}
  # One prefill per group and weight version in both; fewer program calls batched.
  assert driver.stats.prefills == one.stats.prefills >= 12
  assert batched_calls["_prefill_fn"] < one_calls["_prefill_fn"] == one.stats.prefills
  assert batched_calls["_insert_fn"] < one_calls["_insert_fn"] == 12 * 3
  assert driver.stats.generate_calls == one.stats.generate_calls


@pytest.mark.slow
def test_batched_admission_on_a_2x2_mesh_gives_the_same_groups(make_engine, mesh_2x2):
  # Prefill batches of 2 and 4 prompts are split over the 2 replicas; the groups must not change.
  engine = _engine(make_engine, mesh=mesh_2x2, temperature=1.0, group_size=2)
  params = engine.load_params()
  requests = _requests(12, limits=(12, 2, 5))
  got, _ = _run(RolloutDriver, engine, requests, params)
  ref, _ = _run(one_group_at_a_time, engine, requests, params)
  _assert_same_groups(got, ref)


def test_a_group_that_does_not_fit_stays_pending_with_its_prefix(make_engine):
  engine = _engine(make_engine, temperature=1.0, group_size=3)
  params = engine.load_params()
  requests = _requests(4)
  driver = RolloutDriver(engine, params, source=iter(requests), sink=lambda g: None)
  with ProgramCalls(engine) as calls:
    _refill(driver)
  # 8 slots: groups 0 and 1 whole, group 2 in the last 2 slots, all from one prefill and one insert.
  assert calls == {"_prefill_fn": 1, "_insert_fn": 1}
  assert [(s.group.seq, s.index) for s in driver.slots] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2),
                                                           (2, 0), (2, 1)]
  pending, prefix = driver.episodes.pending_group, driver.episodes.pending_prefix
  assert pending.seq == 2 and pending.started == 2 and prefix.version == 0
  # Group 0 ends early (limit): its slots take group 2's last sample (same prefix) and group 3.
  driver.slots[0] = driver.slots[1] = driver.slots[2] = None
  with ProgramCalls(engine) as calls:
    _refill(driver)
  # Group 3's prefill; an insert per prefill the prefixes come from (group 2's is the first one).
  assert calls == {"_prefill_fn": 1, "_insert_fn": 2}
  assert [(s.group.seq, s.index) for s in driver.slots[:3]] == [(2, 2), (3, 0), (3, 1)]
  assert driver.slots[0].prompt_routing is None and driver.stats.prefills == 4
  assert driver.episodes.pending_group.seq == 3 and driver.episodes.pending_prefix is not prefix
  # New weights: the pending group's prefix is not reused, it is prefilled again with them.
  driver.update_params(params, version=5)
  driver._maybe_swap_params()
  driver.slots[3] = None
  _refill(driver)
  assert driver.slots[3].group.seq == 3 and driver.episodes.pending_group is None
  assert driver.stats.prefills == 5


def test_admission_refused_mid_batch_admits_the_rest_later(make_engine):
  engine = _engine(make_engine, temperature=1.0, group_size=2)
  params = engine.load_params()
  requests = _requests(9)
  asked, allowed = [], [2]

  def may_start(version):  # two groups now, later one per call
    asked.append(1)
    ok = allowed[0] > 0
    allowed[0] -= ok
    return ok

  out = []
  driver = RolloutDriver(engine, params, source=iter(requests), sink=out.append, may_start_group=may_start)
  _refill(driver)
  assert len(asked) == 3  # asked per group: yes, yes, no
  assert [s is not None for s in driver.slots] == [True] * 4 + [False] * 4
  allowed[0] = 100
  driver.run(max_wall_s=120)
  ref, _ = _run(one_group_at_a_time, engine, requests, params)
  _assert_same_groups({g.prompt_id: g for g in out}, ref)


def test_nothing_compiles_after_warmup_with_batched_admission(tiny_model):
  engine = Engine(tiny_model, SamplerConfig(max_prefill_length=32, max_new_tokens=12, max_concurrent_decodes=8,
                                            temperature=1.0, group_size=2, attend_bucket=16, steps_per_call=3))
  params = engine.load_params()
  cfg = engine.config
  assert cfg.prompt_batch_sizes == (1, 2, 4) and cfg.prefill_buckets == (16, 32)
  with count_traces() as traces:
    engine.warmup(params)
  counts = engine_counts(traces)
  sizes, buckets = len(cfg.prompt_batch_sizes), len(cfg.prefill_buckets)
  assert counts["prefill"] == sizes * buckets  # a fixed number: one per (prompt batch size, bucket)
  windows = cfg.attend_windows
  assert counts["insert"] == sizes * sum(b <= w for w in windows for b in cfg.prefill_buckets)
  with count_traces() as traces:
    for seed in range(3):  # every prompt bucket, batches of 1-4 groups, partly inserted groups
      _run(RolloutDriver, engine, _requests(10, seed=seed, limits=(12, 2, 7)), params)
  assert not any(engine_counts(traces).values()), traces


def test_insert_many_equals_bulk_insert_per_prefix(make_engine):
  # Prefixes of two length buckets, a prefix with more slots than group_size, and slot groups.
  for kw in (dict(), dict(slot_groups=2)):
    engine = _engine(make_engine, temperature=1.0, group_size=2, **kw)
    params = engine.load_params()
    prompts = random_prompts(3, lengths=(5, 20, 9), seed=4)
    prefixes = engine.prefill_many(params, prompts)
    slots = [[0, 5], [1, 2, 3], [7]]
    keys = [[jax.random.PRNGKey(10 * i + j) for j in range(len(s))] for i, s in enumerate(slots)]
    limits = [4, 12, 7]
    batched = engine.insert_many(prefixes, engine.init_decode_state(), slots, keys=keys, max_new_tokens=limits)
    one = engine.init_decode_state()
    for prompt, s, k, m in zip(prompts, slots, keys, limits):
      one = engine.bulk_insert(engine.prefill(params, prompt), one, s, keys=k, max_new_tokens=m)
    np.testing.assert_array_equal(batched.host_positions, one.host_positions)
    np.testing.assert_array_equal(batched.host_live, one.host_live)
    for a, b in zip(jax.tree.leaves(batched.arrays), jax.tree.leaves(one.arrays), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_insert_many_checks_its_arguments(make_engine):
  engine = _engine(make_engine, temperature=0.0, group_size=2)
  params = engine.load_params()
  prefixes = engine.prefill_many(params, random_prompts(2))
  state = engine.init_decode_state()
  key = jax.random.PRNGKey(0)
  with pytest.raises(ValueError, match="2 prefixes need as many slot lists"):
    engine.insert_many(prefixes, state, [[0]], keys=[[key]])
  with pytest.raises(ValueError, match="distinct slots"):
    engine.insert_many(prefixes, state, [[0], [0]], keys=[[key], [key]])
  with pytest.raises(ValueError, match="prefix 1 has 1 slots and 2 keys"):
    engine.insert_many(prefixes, state, [[0], [1]], keys=[[key], [key, key]])
  with pytest.raises(ValueError, match="max_new_tokens=13"):
    engine.insert_many(prefixes, state, [[0], [1]], keys=[[key], [key]], max_new_tokens=13)
