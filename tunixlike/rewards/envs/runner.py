"""Runs environment calls on worker threads with a timeout, for a loop that must never block.

    runner = EnvRunner(num_workers=8, timeout_s=30)
    ticket = runner.submit(env.step, action)      # returns at once
    for ticket, value, error in runner.poll():    # non-blocking; finished and timed-out calls
      ...

The deadline counts from when a worker starts the call (time spent queued behind other calls is
not charged to it). A call past its deadline is reported once as `EnvTimeout` and abandoned:
Python cannot kill a thread, so its worker is left to finish (and then exits) and a fresh worker
takes its place, so stuck calls never starve the others. Workers are daemon threads, so a stuck
call can never block interpreter exit (a ThreadPoolExecutor would join it at exit and hang).
An awaitable result (an `async def` env method) is run to completion on the worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import queue
import threading
import time
from typing import Any, Callable


class EnvTimeout(TimeoutError):
  pass


@dataclasses.dataclass
class _Job:
  ticket: int
  fn: Callable
  args: tuple
  started: float | None = None  # time.monotonic() when a worker took it
  abandoned: bool = False


async def _await(awaitable):
  return await awaitable


class EnvRunner:
  """A pool of daemon worker threads with per-call timeouts and non-blocking polling."""

  def __init__(self, *, num_workers: int = 8, timeout_s: float, name: str = "env"):
    if not isinstance(num_workers, int) or num_workers < 1:
      raise ValueError(f"EnvRunner.num_workers={num_workers!r}: must be an int >= 1")
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
      raise ValueError(f"EnvRunner.timeout_s={timeout_s!r}: must be > 0")
    self.timeout_s, self._name = float(timeout_s), name
    self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
    self._done: queue.SimpleQueue[tuple[int, Any, BaseException | None]] = queue.SimpleQueue()
    self._running: dict[int, _Job] = {}  # submitted, not yet reported
    self._lock = threading.Lock()
    self._next_ticket = 0
    self._workers = 0
    self.timeouts = 0
    self._closed = False
    for _ in range(num_workers):
      self._spawn()

  def submit(self, fn: Callable, *args) -> int:
    if self._closed:
      raise RuntimeError("EnvRunner.submit after close")
    with self._lock:
      ticket = self._next_ticket
      self._next_ticket += 1
      job = self._running[ticket] = _Job(ticket, fn, args)
    self._jobs.put(job)
    return ticket

  @property
  def pending(self) -> int:
    """Calls submitted and not yet reported by `poll`."""
    with self._lock:
      return len(self._running)

  def poll(self) -> list[tuple[int, Any, BaseException | None]]:
    """Finished calls as (ticket, result, None) or (ticket, None, error); timed-out ones as EnvTimeout."""
    out = []
    while True:
      try:
        ticket, value, error = self._done.get_nowait()
      except queue.Empty:
        break
      with self._lock:
        job = self._running.pop(ticket, None)
      if job is not None:  # None: already reported as timed out
        out.append((ticket, value, error))
    now = time.monotonic()
    with self._lock:
      late = [j for j in self._running.values() if j.started is not None and now - j.started > self.timeout_s]
      for job in late:
        job.abandoned = True
        del self._running[job.ticket]
        self.timeouts += 1
    for job in late:
      self._spawn()  # replaces the worker stuck in `job`
      out.append((job.ticket, None, EnvTimeout(f"{getattr(job.fn, '__qualname__', job.fn)} did not return "
                                               f"within {self.timeout_s:g} s")))
    return out

  def close(self) -> None:
    """Stops idle workers (calls still running are abandoned; they are daemon threads)."""
    self._closed = True
    for _ in range(self._workers):
      self._jobs.put(None)

  def _spawn(self) -> None:
    with self._lock:
      self._workers += 1
      n = self._workers
    threading.Thread(target=self._work, name=f"{self._name}-worker-{n}", daemon=True).start()

  def _work(self) -> None:
    while True:
      job = self._jobs.get()
      if job is None:
        return
      with self._lock:
        if job.ticket not in self._running:
          continue
        job.started = time.monotonic()
      try:
        value = job.fn(*job.args)
        if inspect.isawaitable(value):
          value = asyncio.run(_await(value))
        self._done.put((job.ticket, value, None))
      except BaseException as e:  # reported to the poller, never raised on the worker
        self._done.put((job.ticket, None, e))
      with self._lock:
        abandoned = job.abandoned
      if abandoned:  # a replacement worker was started when this call timed out
        with self._lock:
          self._workers -= 1
        return
