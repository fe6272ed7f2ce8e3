"""Preemption (SIGTERM on TPU VMs) and Ctrl-C: finish the current step, save, exit 0; during
start-up, when there is nothing to save, stop at once."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable


class StartupInterrupted(BaseException):
  """A signal during start-up (`Preemption.starting`): a BaseException, so that no `except Exception` of
  the code it interrupts (a data loader, a user's config) mistakes it for that code's own error."""

  def __init__(self, signum: int):
    self.signum = signum
    self.name = signal.Signals(signum).name
    super().__init__(f"received {self.name} during start-up: stopped before the first step (nothing to save "
                     "yet; the same command starts the run again)")


class Preemption:
  """SIGTERM (TPU VM preemption) and SIGINT (Ctrl-C): finish the current step, save, exit 0.

  A second signal means "stop waiting": `on_second()` runs if given (the CLI exits at once from
  there, `cli.exit_now`), else KeyboardInterrupt is raised in the main thread, as Python does.
  """

  def __init__(self, say=print, on_second: Callable[[], None] | None = None):
    self.requested, self.say, self._old = False, say, {}  # `say` may be replaced once logs are open
    self.on_second = on_second
    self._starting, self._signum = False, signal.SIGTERM

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  @contextlib.contextmanager
  def starting(self):
    """Start-up (building the run: data, rewards, model): a signal inside raises `StartupInterrupted` at
    once. There is nothing to save yet, and start-up's long loops (a generated task's rows, the data's
    first pass) never look at `requested`."""
    if self.requested:
      raise StartupInterrupted(self._signum)
    self._starting = True
    try:
      yield
    finally:
      self._starting = False

  def _handle(self, signum, frame):
    self._signum = signum
    if self._starting:
      self._starting, self.requested = False, True
      raise StartupInterrupted(signum)
    if self.requested:  # a second Ctrl-C: stop waiting
      if self.on_second is not None:
        self.on_second()
      raise KeyboardInterrupt
    self.requested = True
    self.say(f"received {signal.Signals(signum).name}: finishing the current step, saving a checkpoint")

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)
