"""Run reward functions so that they can neither crash nor hang the training run.

A reward function is user code (regexes, sandboxes, remote graders). `SafeReward` calls it on a
worker thread with a timeout. Any failure scores 0 for the samples it affects and is counted:
  * an exception: the batch is retried one sample at a time, so one bad completion costs only itself;
  * a timeout: the whole batch scores 0 (retrying would multiply the wait);
  * a wrong number of values: the whole batch scores 0;
  * NaN, inf or a non-number for a sample: that sample scores 0.
A bool is a number here, as in Python, TRL and numpy: True scores 1.0 and False 0.0 (pass / fail).
None for a sample is no failure: the function does not apply to it (skipped; the caller counts it).
Workers are daemon threads: Python cannot kill a stuck thread, so a timed-out call is abandoned
and can never block interpreter exit (a ThreadPoolExecutor would join it at exit and hang).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, Sequence

_log = logging.getLogger(__name__)


class _Call:
  """One function call on a daemon thread; `wait(deadline)` -> (finished, result, exception)."""

  def __init__(self, fn: Callable, *args, **kwargs):
    self.result, self.error = None, None
    self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True, name="reward-fn")
    self._thread.start()

  def _run(self, fn, args, kwargs):
    try:
      self.result = fn(*args, **kwargs)
    except BaseException as e:  # Reported to the caller, never raised in the worker.
      self.error = e

  def wait(self, deadline: float) -> bool:
    self._thread.join(max(0.0, deadline - time.monotonic()))
    return not self._thread.is_alive()


def as_score(value: Any) -> float | None:
  """A finite float, or None for None / NaN / inf / text / non-numbers (a reward or PRM result).
  True / False (Python's or numpy's) are 1.0 / 0.0: a pass / fail check, as TRL reads it."""
  if value is None or isinstance(value, (str, bytes)):  # float("1") would accept text
    return None
  try:
    value = float(value)
  except (TypeError, ValueError):
    return None
  return value if math.isfinite(value) else None


def _slice_columns(columns: dict[str, Any], i: int, n: int) -> dict[str, Any]:
  """Per-sample columns: every length-n sequence is cut to [value_i]; other values pass through."""
  out = {}
  for key, values in columns.items():
    is_seq = isinstance(values, Sequence) and not isinstance(values, str) or hasattr(values, "shape")
    out[key] = values[i : i + 1] if is_seq and len(values) == n else values
  return out


_SKIPPED = object()  # a sample the function returned None for


class SafeReward:
  """Wraps `fn(prompts, completions, **columns) -> list[float | None]`; calls return (scores, num_failed),
  each score a float or None (skipped)."""

  def __init__(self, fn: Callable[..., Sequence[float]], *, name: str, timeout_s: float):
    if timeout_s <= 0:
      raise ValueError(f"SafeReward({name!r}).timeout_s={timeout_s} must be positive")
    self.fn, self.name, self.timeout_s = fn, name, timeout_s
    self.failures = 0  # Samples that scored 0 because of a failure, over the object's lifetime.
    self._lock = threading.Lock()

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns) -> tuple[list[float], int]:
    n = len(completions)
    if n == 0:
      return [], 0
    deadline = time.monotonic() + self.timeout_s
    call = _Call(self.fn, list(prompts), list(completions), **columns)
    if not call.wait(deadline):
      return self._fail(n, f"timed out after {self.timeout_s:.1f}s")
    if call.error is not None:
      _log.warning("reward %s raised %r on a batch of %d; retrying per sample", self.name, call.error, n)
      return self._per_sample(prompts, completions, columns, deadline)
    values = call.result
    try:
      count = len(values)
    except TypeError:
      return self._fail(n, f"returned {type(values).__name__}, expected a list of {n} floats")
    if count != n:
      return self._fail(n, f"returned {count} values for {n} completions")
    return self._collect([_SKIPPED if v is None else as_score(v) for v in values])

  def count_of(self, prompts, completions, **columns) -> int | str | None:
    """How many values one call returns, or what it returned instead of a list ('None', 'a float');
    None when it raised or was slow."""
    call = _Call(self.fn, list(prompts), list(completions), **columns)
    if not call.wait(time.monotonic() + min(self.timeout_s, 5.0)) or call.error is not None:
      return None
    if call.result is None:
      return "None"
    if isinstance(call.result, (str, bytes)) or not hasattr(call.result, "__len__"):
      return f"a {type(call.result).__name__}"
    return len(call.result)

  def _per_sample(self, prompts, completions, columns, deadline) -> tuple[list[float], int]:
    n = len(completions)
    calls = [_Call(self.fn, [prompts[i]], [completions[i]], **_slice_columns(columns, i, n)) for i in range(n)]
    scores: list[float | None] = []
    for c in calls:
      ok = c.wait(deadline) and c.error is None
      result = c.result if ok else None
      single = result[0] if ok and isinstance(result, Sequence) and len(result) == 1 else math.nan
      scores.append(_SKIPPED if single is None else as_score(single))
    return self._collect(scores)

  def _collect(self, scores: list) -> tuple[list[float | None], int]:
    failed = sum(s is None for s in scores)
    if failed:
      self._count(failed, f"{failed} of {len(scores)} samples failed (exception, NaN or non-number)")
    return [None if s is _SKIPPED else 0.0 if s is None else s for s in scores], failed

  def _fail(self, n: int, why: str) -> tuple[list[float], int]:
    self._count(n, why)
    return [0.0] * n, n

  def _count(self, n: int, why: str) -> None:
    with self._lock:
      self.failures += n
    _log.warning("reward %s: %s; scoring 0", self.name, why)
