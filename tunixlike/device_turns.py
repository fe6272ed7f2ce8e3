"""Turns on shared devices: in the colocated layout the sampler and the learner run on the same
devices, and their device work alternates rather than interleaving kernel by kernel.

The learner has priority: when it asks for a turn, the sampler finishes the call it is in and
waits until the learner's train step and weight sync are done. Host work on either side (reward
scoring, detokenisation, batch assembly, logging) needs no turn and overlaps the other side's
device work. The split layout passes `NO_TURNS`, whose turns never wait.
"""

from __future__ import annotations

import contextlib
import threading
import time


class DeviceTurns:
  """`with turns.learner():` / `with turns.sampler():` around each side's device work."""

  def __init__(self, timeout_s: float):
    self.timeout_s = timeout_s  # no wait without a timeout (rl.wait_timeout_s)
    self._cond = threading.Condition()
    self._learner_wants = 0  # learner turns asked for or running
    self._sampler_busy = False
    self.sampler_waited_s = 0.0  # time the sampler spent waiting for the learner's turns

  @contextlib.contextmanager
  def learner(self):
    with self._cond:
      self._learner_wants += 1  # from here on the sampler starts no new call
    try:
      with self._cond:
        self._wait(lambda: not self._sampler_busy, "the sampler's call")
      yield
    finally:
      with self._cond:
        self._learner_wants -= 1
        self._cond.notify_all()

  @contextlib.contextmanager
  def sampler(self):
    with self._cond:
      if self._learner_wants:
        t0 = time.perf_counter()
        self._wait(lambda: not self._learner_wants, "the learner's turn")
        self.sampler_waited_s += time.perf_counter() - t0
      self._sampler_busy = True
    try:
      yield
    finally:
      with self._cond:
        self._sampler_busy = False
        self._cond.notify_all()

  def _wait(self, ready, what: str):
    if not self._cond.wait_for(ready, self.timeout_s):
      raise TimeoutError(f"colocated layout: {what} took more than rl.wait_timeout_s={self.timeout_s}")


class _NoTurns:
  """Separate devices: neither side ever waits for the other."""

  learner = sampler = staticmethod(contextlib.nullcontext)
  sampler_waited_s = 0.0


NO_TURNS = _NoTurns()
