"""Preemption (SIGTERM on TPU VMs) and Ctrl-C: finish the current step, save, exit 0."""

from __future__ import annotations

import signal
import threading
from typing import Callable


class Preemption:
  """SIGTERM (TPU VM preemption) and SIGINT (Ctrl-C): finish the current step, save, exit 0.

  A second signal means "stop waiting": `on_second()` runs if given (the CLI exits at once from
  there, `cli.exit_now`), else KeyboardInterrupt is raised in the main thread, as Python does.
  """

  def __init__(self, say=print, on_second: Callable[[], None] | None = None):
    self.requested, self.say, self._old = False, say, {}  # `say` may be replaced once logs are open
    self.on_second = on_second

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.requested:  # a second Ctrl-C: stop waiting
      if self.on_second is not None:
        self.on_second()
      raise KeyboardInterrupt
    self.requested = True
    self.say(f"received {signal.Signals(signum).name}: finishing the current step, saving a checkpoint")

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)
