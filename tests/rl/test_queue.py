import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tunixlike.rl.queue import QueueTimeout, RolloutQueue, Stopped
from tunixlike.rollout import Completion, RolloutGroup


def group(pid, version, rewards=(0.0, 1.0)):
  comps = [Completion(np.array([1, 2], np.int32), np.zeros(2, np.float32), np.full(2, version, np.int32), "eos")
           for _ in rewards]
  return RolloutGroup(prompt_id=pid, prompt_token_ids=np.array([5], np.int32), completions=comps,
                      rewards=np.array(rewards, np.float32))


def test_admission_bounds_in_flight_work_by_staleness():
  q = RolloutQueue(batch_groups=4, max_staleness=1)
  assert sum(q.try_admit(0) for _ in range(20)) == 8  # (1 + 0 + 1) * 4
  assert sum(q.try_admit(1) for _ in range(20)) == 4


def test_staleness_zero_is_one_batch_at_a_time():
  q = RolloutQueue(batch_groups=2, max_staleness=0)
  assert [q.try_admit(0) for _ in range(3)] == [True, True, False]
  for i in range(2):
    q.put(group(i, 0))
  assert [g.prompt_id for g in q.get_batch(0, timeout_s=1)] == [0, 1]
  assert not q.try_admit(0)  # the sampler does not run version 1 yet
  assert q.try_admit(1)


def test_version_rejection_drops_stale_groups_and_frees_admission():
  q = RolloutQueue(batch_groups=1, max_staleness=1)
  assert q.try_admit(0) and q.try_admit(2)
  q.put(group("old", 0))
  q.put(group("new", 2))
  batch = q.get_batch(learner_version=2, timeout_s=1)
  assert [g.prompt_id for g in batch] == ["new"]
  assert q.dropped_stale == 1
  assert q.admitted - q.dropped_stale == 1 and q.try_admit(0)  # the drop made room for a replacement
  assert [g.prompt_id for g in q.take_dropped()] == ["old"] and q.take_dropped() == []  # reported once


def test_filter_drops_zero_variance_groups():
  q = RolloutQueue(batch_groups=1, max_staleness=1)
  assert q.try_admit(0) and q.try_admit(0)
  q.put(group("flat", 0, rewards=(1.0, 1.0)))
  q.put(group("useful", 0, rewards=(0.0, 1.0)))
  batch = q.get_batch(0, timeout_s=1, keep=lambda g: float(np.std(g.rewards)) > 0)
  assert [g.prompt_id for g in batch] == ["useful"] and q.dropped_filtered == 1


def test_filter_drops_a_group_whose_prompt_is_also_queued_again():
  """A small dataset's next epoch puts the same prompt in the queue twice: dropping one of the two
  is by identity (comparing the groups' token arrays raised "truth value ... ambiguous")."""
  q = RolloutQueue(batch_groups=1, max_staleness=1)
  assert q.try_admit(0) and q.try_admit(0)
  q.put(group("p", 0, rewards=(0.0, 1.0)))
  q.put(group("p", 0, rewards=(1.0, 1.0)))
  batch = q.get_batch(0, timeout_s=1, keep=lambda g: float(np.std(g.rewards)) > 0)
  assert [list(g.rewards) for g in batch] == [[0.0, 1.0]] and q.dropped_filtered == 1


def test_learner_waits_for_the_oldest_running_group_instead_of_rejecting_it():
  """Long tails: a group started at version 0 still decoding must be trained at step 1 (s=1)."""
  q = RolloutQueue(batch_groups=2, max_staleness=1)
  assert q.try_admit(0) and q.try_admit(0)  # "slow" and "a"
  q.put(group("a", 0))
  assert q.try_admit(0) and q.try_admit(0)
  q.put(group("b", 0))
  q.put(group("c", 0))
  assert [g.prompt_id for g in q.get_batch(0, timeout_s=1)] == ["a", "b"]
  assert q.try_admit(1)
  q.put(group("d", 1))
  threading.Timer(0.2, lambda: q.put(group("slow", 0))).start()
  batch = q.get_batch(1, timeout_s=5)  # "d" and "c" are ready, but "slow" would be too old at step 2
  assert sorted(g.prompt_id for g in batch) == ["c", "slow"]
  assert q.dropped_stale == 0


def test_a_group_whose_first_token_comes_after_a_weight_update_counts_from_its_admission():
  """An agent's first request may arrive after the sampler moved on: the learner must not wait
  for the version it was admitted at as if that group were still running."""
  q = RolloutQueue(batch_groups=1, max_staleness=1)
  assert q.try_admit(0) and q.try_admit(0)
  q.put(group("first", 0))
  assert [g.prompt_id for g in q.get_batch(0, timeout_s=1)] == ["first"]
  late = group("late", 1)
  late.start_version = 0
  q.put(late)
  assert [g.prompt_id for g in q.get_batch(1, timeout_s=1)] == ["late"]


def test_waits_time_out_and_stop():
  q = RolloutQueue(batch_groups=1, max_staleness=0)
  with pytest.raises(QueueTimeout, match=r"waited 0s for rollouts \(ready 0 of 1.*rl.wait_timeout_s"):
    q.get_batch(0, timeout_s=0.2)  # nothing arrives: the wait ends by its timeout, not by a stop
  assert not q.stop_event.is_set()
  threading.Timer(0.1, q.stop_event.set).start()
  with pytest.raises(Stopped):
    q.get_batch(0, timeout_s=10)


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 3), staleness=st.integers(0, 2), steps=st.integers(1, 4),
       producer_delay=st.sampled_from([0.0, 0.001, 0.003]), consumer_delay=st.sampled_from([0.0, 0.002]),
       drop_every=st.sampled_from([0, 2, 3]))
def test_threads_never_deadlock_never_train_stale_data_and_lose_nothing(batch, staleness, steps, producer_delay,
                                                                         consumer_delay, drop_every):
  """A producer thread (admit -> tag with the current version -> put) and a consumer (the learner)
  that drops some groups by a filter: every admitted group ends trained, dropped (and reported) or
  still in flight."""
  dropped_ids = []
  q = RolloutQueue(batch_groups=batch, max_staleness=staleness, on_drop=lambda g: dropped_ids.append(g.prompt_id))
  keep = (lambda g: g.prompt_id % drop_every != 0) if drop_every else None
  errors = []
  sampler_version = [0]

  def produce():
    pid = 0
    while not q.stop_event.is_set():
      version = sampler_version[0]
      if q.try_admit(version):
        time.sleep(producer_delay)
        q.put(group(pid, version))
        pid += 1
      else:
        time.sleep(0.0005)

  t = threading.Thread(target=produce, daemon=True)
  t.start()
  trained_ids = []
  try:
    for step in range(steps):
      for g in q.get_batch(step, timeout_s=5, keep=keep):
        trained_ids.append(g.prompt_id)
        if step - g.min_version > staleness:
          errors.append((step, g.min_version))
      time.sleep(consumer_delay)
      sampler_version[0] = step + 1  # weight sync done
  finally:
    q.stop_event.set()
    t.join(timeout=5)
  assert not errors
  assert not t.is_alive()
  assert q.trained == len(trained_ids) == steps * batch
  assert q.dropped_stale + q.dropped_filtered == len(dropped_ids)
  assert not set(trained_ids) & set(dropped_ids)
  assert q.admitted == len(trained_ids) + len(dropped_ids) + q.in_flight


def test_a_resumed_queue_admits_what_an_uninterrupted_one_would():
  """After a restore at version 55 the queue admits (staleness + 1) batches, not (55 + 2)."""
  fresh, started = RolloutQueue(batch_groups=4, max_staleness=1), []
  for v in range(55):  # the uninterrupted run: groups finish in start order, 55 batches trained
    while fresh.try_admit(v):
      started.append(v)
    for _ in range(4):
      fresh.put(group(len(started), started.pop(0)))
    fresh.get_batch(v, timeout_s=1)
  in_flight = fresh.in_flight  # a checkpoint at 55 loses these; the resumed run regenerates them
  resumed = RolloutQueue(batch_groups=4, max_staleness=1, start_version=55, counts=fresh.counts())
  assert resumed.in_flight == 0 and resumed.counts() == fresh.counts() and resumed.trained == 55 * 4
  admitted = sum(resumed.try_admit(55) for _ in range(100))
  assert admitted == in_flight + sum(fresh.try_admit(55) for _ in range(100)) == 8


def test_rollouts_kept_by_a_checkpoint_are_admitted_again_and_still_face_version_rejection():
  """A resume at version 10 with 2 scored groups and 3 in the driver: 5 in flight, the admission of
  an uninterrupted queue; the learner waits for the continued ones at their last chance, and one
  whose oldest token is too old for its step is dropped and counted."""
  q = RolloutQueue(batch_groups=4, max_staleness=1, start_version=10, counts={"trained": 40},
                   carried=[group("scored-a", 9), group("scored-b", 10)], continued=3, first_seq=57)
  assert q.in_flight == 5 and q.first_seq == 57
  assert sum(q.try_admit(10) for _ in range(20)) == 3  # (1 + 10 + 1) * 4 - 40 consumed - 5 in flight
  for i in range(3):
    q.put(group(f"new-{i}", 10))
  assert [g.prompt_id for g in q.get_batch(learner_version=10, timeout_s=1)] == ["scored-a", "scored-b", "new-0", "new-1"]
  with pytest.raises(QueueTimeout, match="3 old groups still running"):  # step 11 is their last chance
    q.get_batch(learner_version=11, timeout_s=0.3)
  continued = [group("continued-a", 10), group("continued-b", 8), group("continued-c", 10)]
  for g in continued:
    g.start_version = 10  # the driver re-admitted them at the resumed version
    q.put(g)
  assert q.try_admit(11)
  q.put(group("new-3", 11))
  batch = q.get_batch(learner_version=11, timeout_s=1)
  assert [g.prompt_id for g in batch] == ["new-2", "continued-a", "continued-c", "new-3"]
  assert q.dropped_stale == 1 and [g.prompt_id for g in q.take_dropped()] == ["continued-b"]  # 8 < 11 - 1


def test_a_skipped_step_gives_its_admissions_back():
  q = RolloutQueue(batch_groups=2, max_staleness=1)
  assert sum(q.try_admit(0) for _ in range(10)) == 4
  for i in range(4):
    q.put(group(i, 0))
  for _ in range(2):  # two non-finite steps at version 0: the version does not advance
    q.get_batch(0, timeout_s=1)
    q.step_skipped(2)
  assert sum(q.try_admit(0) for _ in range(10)) == 4  # a new batch for the same version, and the next
