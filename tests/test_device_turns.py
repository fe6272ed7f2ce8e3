"""Turns on shared devices (the colocated layout), with real threads."""

import threading
import time

import pytest

from tunixlike.device_turns import NO_TURNS, DeviceTurns


def _sampler_loop(turns, stop, events, call_s=0.02):
  while not stop.is_set():
    with turns.sampler():
      events.append("sampler starts")
      time.sleep(call_s)  # one sampler call
      events.append("sampler ends")


def test_learner_and_sampler_turns_never_overlap_and_the_learner_waits_one_call_at_most():
  """The order of events, not their times: inside a learner turn no sampler call runs, and once the
  learner has asked, the sampler starts no new call (one may slip in between the learner's log line
  and its request) before the learner's turn."""
  turns, stop, events = DeviceTurns(timeout_s=10), threading.Event(), []  # list.append is atomic
  thread = threading.Thread(target=_sampler_loop, args=(turns, stop, events), daemon=True)
  thread.start()
  try:
    for _ in range(5):
      time.sleep(0.05)  # host work between steps: the sampler has the devices
      events.append("learner asks")
      with turns.learner():
        events.append("learner starts")
        time.sleep(0.03)  # a train step and its sync
        events.append("learner ends")
  finally:
    stop.set()
    thread.join(5)
  asks = [i for i, e in enumerate(events) if e == "learner asks"]
  starts = [i for i, e in enumerate(events) if e == "learner starts"]
  ends = [i for i, e in enumerate(events) if e == "learner ends"]
  assert len(asks) == len(starts) == len(ends) == 5
  assert events.count("sampler starts") > 10
  for ask, start, end in zip(asks, starts, ends):
    assert ask < start < end
    assert "sampler starts" not in events[start:end] and "sampler ends" not in events[start:end]
    assert events[ask:start].count("sampler starts") <= 1, events[ask:start]
  assert turns.sampler_waited_s > 0  # it did wait for the learner


def test_a_sampler_call_that_never_ends_times_the_learner_out_naming_the_key():
  turns, inside, release = DeviceTurns(timeout_s=0.2), threading.Event(), threading.Event()

  def stuck():
    with turns.sampler():
      inside.set()
      release.wait(5)

  thread = threading.Thread(target=stuck, daemon=True)
  thread.start()
  inside.wait(5)
  with pytest.raises(TimeoutError, match=r"the sampler's call took more than rl.wait_timeout_s=0.2"):
    with turns.learner():
      pass
  release.set()
  thread.join(5)
  with turns.sampler():  # the failed turn was given back: the sampler goes on
    pass


def test_separate_devices_never_wait():
  with NO_TURNS.learner(), NO_TURNS.sampler():
    pass
  assert NO_TURNS.sampler_waited_s == 0.0
