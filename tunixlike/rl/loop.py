"""The train loop both runtimes run: one policy (`runtime.AsyncRuntime`) or several on episodes
(`multi_agent.runtime.MultiAgentRuntime`). They differ in what a batch is and how a step trains on
it; the loop around that is this one function:

    start the sampler (its own thread) -> per step: check for errors, [sample inline], wait for a
    batch, check again, train on it -> stop the sampler, whatever happened

`threaded=False` samples in the loop's own thread before each batch (it needs max_staleness=0):
the synchronous loop that the threaded one at staleness 0 must reproduce exactly. An error in the
sampler's thread or the reward stage stops the queue (`Stopped` in the learner's wait) and is
re-raised here with its own type.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

from tunixlike.rl.queue import Stopped


class Sampling(Protocol):
  """The sampling side as the loop drives it."""

  def start_sampling(self) -> None: ...  # in its own thread
  def sample_inline(self) -> None: ...  # in this thread, until a batch is ready (threaded=False)
  def check(self) -> None: ...  # re-raises an error of the sampling side
  def stop_sampling(self) -> None: ...  # always called, also after an error


def run_steps(num_steps: int, sampling: Sampling, next_batch: Callable[[], Any],
              train: Callable[[int, Any, float], dict[str, Any]], *, threaded: bool, max_staleness: int,
              should_stop: Callable[[], bool] = lambda: False,
              before_stop: Callable[[], None] = lambda: None) -> dict[str, Any]:
  """Up to `num_steps` steps of `train(step, batch, wait_s)` (its metrics) on `next_batch()`
  (`wait_s`: the time the batch took, inline sampling included), until `should_stop()`; then
  `before_stop()` while the sampler still runs (not after an error). Returns the last step's
  metrics with `wall_s`."""
  if not threaded and max_staleness != 0:
    raise ValueError("run(threaded=False) is the synchronous loop: it needs max_staleness=0")
  start = time.monotonic()
  last: dict[str, Any] = {}
  if threaded:
    sampling.start_sampling()
  try:
    for step in range(num_steps):
      if should_stop():
        break
      sampling.check()
      t0 = time.monotonic()
      if not threaded:
        sampling.sample_inline()
      batch = next_batch()
      sampling.check()
      last = train(step, batch, time.monotonic() - t0)
    before_stop()
  except Stopped:
    sampling.check()  # the original error of the thread that stopped the run
    raise
  finally:
    sampling.stop_sampling()
  sampling.check()
  return {**last, "wall_s": time.monotonic() - start}
