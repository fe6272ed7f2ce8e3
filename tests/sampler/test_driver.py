import queue
import threading
import time

import jax
import numpy as np
import pytest

from sampler_prompts import random_prompts
from tunixlike.rollout import RolloutGroup
from tunixlike.sampler import DriverError, PromptError, PromptRequest, RolloutDriver


def _requests(n, seed=0, **kw):
  return [PromptRequest(prompt_id=i, token_ids=p, **kw) for i, p in enumerate(random_prompts(n, seed=seed))]


def _run(engine, requests, params=None, **kw):
  out = []
  driver = RolloutDriver(engine, params or engine.load_params(), source=iter(requests), sink=out.append, **kw)
  driver.run(max_wall_s=120)
  return {g.prompt_id: g for g in out}, driver


def _tokens(groups):
  return {pid: [c.token_ids.tolist() for c in g.completions] for pid, g in groups.items()}


@pytest.mark.parametrize("temperature, group_size", [(0.0, 1), pytest.param(1.0, 2, marks=pytest.mark.slow)])
def test_continuous_batching_equals_one_prompt_at_a_time(make_engine, temperature, group_size):
  requests = _requests(7)
  many = make_engine(temperature=temperature, group_size=group_size, max_concurrent_decodes=4)
  one = make_engine(temperature=temperature, group_size=group_size, max_concurrent_decodes=group_size)
  got_many, driver = _run(many, requests)
  got_one, _ = _run(one, requests, params=many.load_params())
  assert sorted(got_many) == list(range(7))
  assert _tokens(got_many) == _tokens(got_one)
  for pid, g in got_many.items():
    assert isinstance(g, RolloutGroup) and g.group_size == group_size
    np.testing.assert_array_equal(g.prompt_token_ids, requests[pid].token_ids)
    for c in g.completions:
      assert c.finish_reason == "length" and c.num_tokens == many.config.max_new_tokens
      assert np.all(c.policy_versions == 0)
  if temperature > 0:  # the G samples of a group are different draws
    assert any(len({tuple(t) for t in ts}) == group_size for ts in _tokens(got_many).values())
  s = driver.stats
  assert s.tokens_generated == 7 * group_size * many.config.max_new_tokens
  assert s.prefills == 7 and s.groups_emitted == 7
  assert 0.5 < s.slot_occupancy <= 1.0


def test_param_swap_mid_generation_changes_only_later_versions(make_engine):
  engine = make_engine(temperature=1.0, group_size=2, max_concurrent_decodes=4)
  params = engine.load_params()
  requests = _requests(5)
  base, _ = _run(engine, requests)

  out = []
  driver = RolloutDriver(engine, params, source=iter(requests), sink=out.append)
  driver.step()
  driver.step()
  driver.update_params(params, version=7)  # same weights, new version
  driver.run(max_wall_s=120)
  got = {g.prompt_id: g for g in out}
  assert _tokens(got) == _tokens(base)
  mixed = 0
  for g in got.values():
    for c in g.completions:
      v = c.policy_versions
      switch = np.argmax(v == 7) if (v == 7).any() else len(v)
      assert np.all(v[:switch] == 0) and np.all(v[switch:] == 7)
      mixed += 0 < switch < len(v)
  assert mixed >= 2  # sequences in flight at the swap carry both versions
  assert driver.stats.param_swaps == 1

  # Different weights: tokens before the swap are unchanged, later ones come from the new weights.
  noisy = jax.tree.map(lambda x: x + 0.5 * jax.random.normal(jax.random.PRNGKey(0), x.shape, x.dtype), params)
  out2 = []
  driver = RolloutDriver(engine, params, source=iter(requests), sink=out2.append)
  driver.step()
  driver.step()
  driver.update_params(noisy, version=1)
  driver.run(max_wall_s=120)
  changed = 0
  for g in out2:
    for i, c in enumerate(g.completions):
      ref = base[g.prompt_id].completions[i].token_ids
      old = c.policy_versions == 0
      np.testing.assert_array_equal(c.token_ids[old], ref[old])
      changed += not np.array_equal(c.token_ids, ref)
  assert changed > 0

  # Drain swap: sequences in flight at the request finish on version 0 before the swap; no group
  # mixes versions, and groups started after it are all version 1.
  out3 = []
  driver = RolloutDriver(engine, params, source=iter(requests), sink=out3.append)
  driver.step()
  driver.step()
  driver.update_params(params, version=1, drain=True)
  driver.run(max_wall_s=120)
  assert _tokens({g.prompt_id: g for g in out3}) == _tokens(base)
  versions = [set(np.concatenate([c.policy_versions for c in g.completions]).tolist()) for g in out3]
  assert all(len(v) == 1 for v in versions)
  assert {0} in versions and {1} in versions


def test_stop_strings_eos_and_truncation(make_engine):
  detok = lambda ids: "".join(chr(97 + int(i) % 26) for i in ids)
  long_prompt = np.arange(1, 30, dtype=np.int32)  # 29 tokens > max_prefill_length=16
  requests = _requests(3, seed=4) + [PromptRequest(prompt_id=3, token_ids=long_prompt)]
  plain = make_engine(temperature=0.0, truncate_long_prompts=True)
  base, _ = _run(plain, requests)
  text0 = detok(base[0].completions[0].token_ids)
  stop = text0[4:6]
  eos = int(base[1].completions[0].token_ids[3])
  engine = make_engine(temperature=0.0, truncate_long_prompts=True, stop_strings=(stop,), eos_ids=(eos,))
  got, driver = _run(engine, requests, params=plain.load_params(), detokenize=detok)
  for pid, g in got.items():
    full = base[pid].completions[0].token_ids.tolist()
    c = g.completions[0]
    cut_stop = next((i + 1 for i in range(len(full)) if stop in detok(full[:i + 1])), None)
    cut_eos = full.index(eos) + 1 if eos in full else None
    cut = min(x for x in (cut_stop, cut_eos, len(full)) if x is not None)
    assert c.token_ids.tolist() == full[:cut], pid
    expect = "eos" if cut == cut_eos else "stop" if cut == cut_stop else "length"
    assert c.finish_reason == expect, pid
    assert c.text == detok(full[:cut])
  assert got[0].completions[0].finish_reason in ("stop", "eos")
  assert driver.stats.truncated_prompts == 1
  np.testing.assert_array_equal(got[3].prompt_token_ids, long_prompt[-16:])


def test_bad_prompts_and_settings(make_engine):
  engine = make_engine(temperature=0.0)
  with pytest.raises(PromptError, match="prompt 'x'.*non-empty"):
    _run(engine, [PromptRequest("x", np.zeros((0,), np.int32))])
  with pytest.raises(PromptError, match="prompt 'y' has 17 tokens > sampler.max_prefill_length=16"):
    _run(engine, [PromptRequest("y", np.ones((17,), np.int32))])
  with pytest.raises(PromptError, match="max_new_tokens=99"):
    _run(engine, [PromptRequest("z", np.ones((3,), np.int32), max_new_tokens=99)])
  stop_engine = make_engine(temperature=0.0, stop_strings=("ab",))
  with pytest.raises(ValueError, match="detokenize"):
    RolloutDriver(stop_engine, stop_engine.load_params(), source=[], sink=print)


def _wait_for(pred, timeout_s=60.0):
  t_end = time.monotonic() + timeout_s
  while not pred():
    if time.monotonic() > t_end:
      raise AssertionError("condition not reached in time")
    time.sleep(0.01)


def test_thread_admission_control_drain_swap_and_queue_sink(make_engine):
  engine = make_engine(temperature=1.0, group_size=2, max_concurrent_decodes=4)
  params = engine.load_params()
  sink = queue.Queue(maxsize=2)
  admitted = []
  allow = threading.Event()
  allow.set()

  def may_start(version):
    ok = allow.is_set() and len(admitted) < 3
    if ok:
      admitted.append(1)
    return ok

  driver = RolloutDriver(engine, params, source=iter(_requests(8)), sink=sink, may_start_group=may_start)
  driver.start()
  got = [sink.get(timeout=60) for _ in range(3)]
  time.sleep(0.2)
  assert sink.empty() and driver.running and not driver.exhausted and driver.is_idle  # admission held it
  # Drain swap: groups in flight at the swap finish on version 0; later ones are all version 1.
  admitted.clear()
  driver.update_params(params, version=1, drain=True)
  got += [sink.get(timeout=60) for _ in range(3)]
  driver.stop(timeout_s=30)
  assert sorted(g.prompt_id for g in got) == list(range(6))
  for g in got:
    versions = np.concatenate([c.policy_versions for c in g.completions])
    assert len(set(versions.tolist())) == 1, "drain mode never mixes versions in one group"
  assert {int(g.completions[0].policy_versions[0]) for g in got[3:]} == {1}
  assert driver.stats.param_swaps == 1 and driver.unfinished_requests() == []


def test_driver_error_stops_thread_and_is_reraised(make_engine):
  engine = make_engine(temperature=0.0)

  def source():
    yield PromptRequest(0, np.ones((3,), np.int32))
    raise RuntimeError("dataset broke")

  driver = RolloutDriver(engine, engine.load_params(), source=source(), sink=lambda g: None)
  driver.start()
  _wait_for(lambda: not driver.running)
  with pytest.raises(DriverError, match="dataset broke"):
    driver.check()


def test_sample_keys_depend_on_group_order_and_index_across_key_blocks(make_engine):
  # Keys are made for blocks of groups at once (one device fetch per block): a group's keys must
  # still be fold_in(fold_in(base, seq), index), also past a block boundary.
  engine = make_engine(temperature=1.0, group_size=2)
  driver = RolloutDriver(engine, engine.load_params(), source=iter([]), sink=lambda g: None)
  fold = jax.random.fold_in
  for seq in (0, 63, 64, 130, 200, 300, 5, 70):  # blocks 0-4, then back to 0 and 1 (evicted, remade)
    want = [np.asarray(fold(fold(driver.keys.base, seq), i)) for i in range(2)]
    np.testing.assert_array_equal(driver.keys.group(seq), np.stack(want))
  assert len(driver.keys.blocks) <= 4
