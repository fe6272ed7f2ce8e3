"""Preemption (SIGTERM on TPU VMs) and Ctrl-C: finish the current step, save, exit 0."""

from __future__ import annotations

import signal
import threading


class Preemption:
  """SIGTERM (TPU VM preemption) and SIGINT (Ctrl-C): finish the current step, save, exit 0."""

  def __init__(self, say=print):
    self.requested, self.say, self._old = False, say, {}  # `say` may be replaced once logs are open

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.requested:  # a second Ctrl-C: stop waiting
      raise KeyboardInterrupt
    self.requested = True
    self.say(f"received {signal.Signals(signum).name}: finishing the current step, saving a checkpoint")

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)
