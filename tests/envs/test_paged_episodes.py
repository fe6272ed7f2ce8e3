"""Multi-turn episodes over a paged KV cache: each turn's KV stays in the pool while the env runs and
the next turn computes only what came since; under a tight budget, parked KV is dropped and turns
are preempted and recomputed; the episodes are those of the contiguous cache either way."""

import numpy as np
import pytest

from test_episodes import _driver, _requests

PAGED = dict(kv_layout="paged", kv_block_size=4)
SPECS = [dict(turns=3), dict(turns=2, intro=" hi."), dict(turns=3), dict(turns=1), dict(turns=3)]


def _episodes(engine, tokenizer, params=None, **ec):
  driver, out = _driver(engine, tokenizer, _requests(tokenizer, SPECS), params=params, **ec)
  driver.run(max_wall_s=120)
  assert driver.stats.env_errors == driver.stats.env_timeouts == 0
  groups = {g.prompt_id: g for g in out}
  assert sorted(groups) == list(range(len(SPECS)))
  return groups, driver


def _assert_same(got, want):
  for pid, g in want.items():
    for a, b in zip(got[pid].completions, g.completions):
      np.testing.assert_array_equal(a.token_ids, b.token_ids)
      np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    np.testing.assert_allclose(got[pid].rewards, g.rewards)


@pytest.mark.parametrize("block_size", [4, 32])  # 32: a block longer than the smallest prefill bucket
def test_paged_episodes_keep_their_kv_between_turns(make_engine, tokenizer, block_size):
  contiguous = make_engine(temperature=1.0, group_size=2)
  want, plain = _episodes(contiguous, tokenizer)
  paged = make_engine(temperature=1.0, group_size=2, **dict(PAGED, kv_block_size=block_size))
  got, driver = _episodes(paged, tokenizer, params=contiguous.load_params())
  _assert_same(got, want)
  later_turns = driver.stats.policy_turns - driver.stats.episodes
  assert later_turns > 0 and driver.stats.kv_resumed_turns == later_turns  # no weight update: every one
  assert driver.stats.prefills == plain.stats.prefills - later_turns
  assert paged.blocks_in_use(driver.slots.state) == 0 and not driver.slots.state.tables.parked  # all given back


def test_paged_episodes_under_a_tight_budget(make_engine, tokenizer):
  long_turns = dict(max_new_tokens=24, max_prefill_length=40)  # turns of up to 24 tokens
  roomy = make_engine(temperature=1.0, group_size=2, **long_turns, **PAGED)
  want, _ = _episodes(roomy, tokenizer, max_turn_tokens=24)
  # 18 blocks of 4 positions: one longest conversation (64 positions) and its group, for 4 slots.
  tight = make_engine(temperature=1.0, group_size=2, kv_cache_bytes=18 * roomy.block_bytes, **long_turns, **PAGED)
  got, driver = _episodes(tight, tokenizer, params=roomy.load_params(), max_turn_tokens=24)
  _assert_same(got, want)
  assert driver.stats.preemptions > 0 and driver.stats.resumed == driver.stats.preemptions
  assert driver.stats.kv_resumed_turns < driver.stats.policy_turns - driver.stats.episodes  # some were dropped
  assert tight.blocks_in_use(driver.slots.state) == 0 and not driver.slots.state.tables.parked
