"""Turns on shared devices (the colocated layout), with real threads."""

import threading
import time

import pytest

from tunixlike.device_turns import NO_TURNS, DeviceTurns


def _sampler_loop(turns, stop, spans, call_s=0.005):
  while not stop.is_set():
    with turns.sampler():
      t0 = time.perf_counter()
      time.sleep(call_s)  # one sampler call
      spans.append((t0, time.perf_counter()))


def test_learner_and_sampler_turns_never_overlap_and_the_learner_waits_one_call_at_most():
  turns, stop, sampler_spans, learner_spans, waits = DeviceTurns(timeout_s=10), threading.Event(), [], [], []
  thread = threading.Thread(target=_sampler_loop, args=(turns, stop, sampler_spans), daemon=True)
  thread.start()
  try:
    for _ in range(5):
      time.sleep(0.02)  # host work between steps: the sampler has the devices
      asked = time.perf_counter()
      with turns.learner():
        t0 = time.perf_counter()
        waits.append(t0 - asked)
        time.sleep(0.03)  # a train step and its sync
        learner_spans.append((t0, time.perf_counter()))
  finally:
    stop.set()
    thread.join(5)
  assert len(sampler_spans) > 10
  for l0, l1 in learner_spans:
    assert not any(s0 < l1 and l0 < s1 for s0, s1 in sampler_spans)
  assert max(waits) < 0.005 + 0.02  # the call in progress, plus scheduling slack
  assert turns.sampler_waited_s >= 0.5 * sum(l1 - l0 for l0, l1 in learner_spans)


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
