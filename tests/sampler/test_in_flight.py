"""Rollouts in flight kept by a checkpoint and continued by a resumed driver (rl/in_flight.py)."""

import json

import numpy as np
import pytest

from sampler_prompts import random_prompts
from tunixlike.rl import in_flight
from tunixlike.sampler import PromptRequest, RolloutDriver

PAGED = dict(kv_layout="paged", kv_block_size=4, max_new_tokens=16)


def _requests(n, seed=0):
  return [PromptRequest(prompt_id=i, token_ids=p, columns={"stream_index": i})
          for i, p in enumerate(random_prompts(n, seed=seed))]


def _by_prompt(groups):
  return {g.prompt_id: g for g in groups}


def _through_a_checkpoint(driver) -> in_flight.Kept:
  """The driver's groups in flight as a checkpoint writes and a resume reads them (JSON)."""
  kept = in_flight.Kept(scored=[], in_flight=driver.in_flight(timeout_s=5), next_seq=driver.next_seq)
  return in_flight.from_json(json.loads(json.dumps(in_flight.to_json(kept))))


@pytest.mark.parametrize("layout", [dict(max_new_tokens=12), PAGED], ids=["contiguous", "paged"])
def test_a_continued_rollout_is_the_one_an_uninterrupted_run_produces(make_engine, layout):
  engine = make_engine(temperature=1.0, top_k=20, group_size=2, **layout)
  params = engine.load_params()
  requests = _requests(6, seed=3)
  whole = []
  uninterrupted = RolloutDriver(engine, params, source=iter(requests), sink=whole.append)
  uninterrupted.run(max_wall_s=120)

  before, after = [], []
  source = iter(requests)  # the prompts the first driver did not take go to the resumed one
  first = RolloutDriver(engine, params, source=source, sink=before.append)
  for _ in range(3):
    first.step()
  kept = _through_a_checkpoint(first)
  assert kept.in_flight and any(0 < len(s["tokens"]) for g in kept.in_flight for s in g.samples if isinstance(s, dict))
  resumed = RolloutDriver(engine, params, source=source, sink=after.append, resume=kept.in_flight,
                          first_seq=kept.next_seq)
  resumed.run(max_wall_s=120)

  want, got = _by_prompt(whole), _by_prompt(before + after)
  assert sorted(got) == sorted(want) == list(range(6))
  for pid, group in want.items():
    for a, b in zip(got[pid].completions, group.completions):
      assert a.token_ids.tolist() == b.token_ids.tolist() and a.finish_reason == b.finish_reason
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
      np.testing.assert_array_equal(a.policy_versions, b.policy_versions)
  # No token was decoded twice: the two drivers together decoded what the uninterrupted one did.
  assert resumed.stats.tokens_kept == kept.tokens > 0
  assert first.stats.live_slot_steps + resumed.stats.live_slot_steps == uninterrupted.stats.live_slot_steps
  assert (first.stats.tokens_generated + resumed.stats.tokens_generated + resumed.stats.tokens_kept
          == uninterrupted.stats.tokens_generated)


def test_groups_with_every_sample_finished_are_emitted_again(make_engine):
  engine = make_engine(temperature=1.0, group_size=2)
  params = engine.load_params()
  out = []
  driver = RolloutDriver(engine, params, source=iter(_requests(2)), sink=out.append)
  driver.run(max_wall_s=120)
  finished = in_flight.from_json(json.loads(json.dumps(in_flight.to_json(in_flight.Kept(
      scored=[], in_flight=[in_flight._finished(g) for g in out], next_seq=driver.next_seq)))))
  again = []
  resumed = RolloutDriver(engine, params, source=iter([]), sink=again.append, resume=finished.in_flight,
                          first_seq=finished.next_seq)
  resumed.run(max_wall_s=60)
  assert [g.prompt_id for g in again] == [g.prompt_id for g in out]
  assert [c.token_ids.tolist() for g in again for c in g.completions] == \
         [c.token_ids.tolist() for g in out for c in g.completions]
  assert resumed.stats.live_slot_steps == 0 and resumed.stats.tokens_generated == 0


def test_a_resumed_group_must_start_before_first_seq(make_engine):
  engine = make_engine(temperature=1.0, group_size=2)
  params = engine.load_params()
  driver = RolloutDriver(engine, params, source=iter(_requests(2)), sink=[].append)
  driver.step()
  kept = driver.in_flight(timeout_s=5)
  with pytest.raises(Exception, match="first_seq"):
    RolloutDriver(engine, params, source=iter([]), sink=[].append, resume=kept, first_seq=0)
