"""An optional Chrome / Perfetto trace of what each thread does, and when.

Open the file in https://ui.perfetto.dev or chrome://tracing: every thread (sampler, learner,
weight sync, reward workers) is its own named track, so one can *see* whether the sampler and the
learner overlap or wait on each other, which is the whole point of an async runtime.

  tracer = trace.Tracer("runs/x/trace.json")        # Tracer(None) records nothing, at ~no cost
  with tracer.span("generate", cat="sampler", slots=64) as s:
    ...
    s.set(tokens=n)                                  # args known only at the end
  tracer.counter("queue", depth=3)
  tracer.close()                                     # atomic write; a failure raises LogWriteError
  trace.busy_fractions("runs/x/trace.json")          # {"sampler": 0.93, "learner": 0.71, ...}

The file is the Trace Event Format: complete events (`ph: "X"`, `ts` and `dur` in microseconds),
instants (`"i"`), counters (`"C"`) and metadata (`"M"`) naming the process and each thread. Events
are kept in memory up to `max_events`; later ones are counted in `otherData.dropped_events` rather
than growing without bound on a long run.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from typing import Any, Iterable, Mapping

from tunixlike.metrics import LogWriteError

_MAX_EVENTS = 500_000  # ~100 bytes each as tuples: tens of MB at worst


class _NullSpan:
  """The shared span of a disabled tracer: no clock reads, no allocation, no lock."""

  __slots__ = ()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False

  def set(self, **args):
    del args


_NULL_SPAN = _NullSpan()


class _Span:
  __slots__ = ("_tracer", "_name", "_cat", "_args", "_start_ns")

  def __init__(self, tracer: Tracer, name: str, cat: str, args: dict[str, Any]):
    self._tracer, self._name, self._cat, self._args = tracer, name, cat, args

  def set(self, **args):
    """Adds args to the span (e.g. a token count known only when the work is done)."""
    self._args.update(args)

  def __enter__(self):
    self._start_ns = time.perf_counter_ns()
    return self

  def __exit__(self, exc_type, exc, tb):
    end_ns = time.perf_counter_ns()
    if exc_type is not None:  # a failed step shows as such on the timeline
      self._args["error"] = exc_type.__name__
    self._tracer._record("X", self._name, self._cat, self._start_ns, end_ns - self._start_ns, self._args)
    return False


class Tracer:
  """Thread-safe span recorder. `path=None` disables it: every method is then a cheap no-op.

  Args:
    path: where `save()` writes the JSON (local path, or `gs://...` through etils.epath).
    max_events: events kept in memory; later ones are dropped and counted.
    pid: process id shown in the viewer (e.g. `jax.process_index()` on several hosts).
    process_name: label of the process track.
  """

  def __init__(self, path: str | os.PathLike | None = None, *, max_events: int = _MAX_EVENTS,
               pid: int | None = None, process_name: str = "tunixlike"):
    if max_events < 1:
      raise ValueError(f"Tracer.max_events={max_events!r}, expected a positive int")
    self.path = None if path is None else os.fspath(path)
    self.enabled = self.path is not None
    self.max_events = max_events
    self.pid = os.getpid() if pid is None else int(pid)
    self.process_name = process_name
    self.dropped_events = 0
    self._lock = threading.Lock()
    self._events: list[tuple] = []  # (ph, name, cat, ts_ns, dur_ns, tid, args): dicts only at save
    # Small track ids in order of first event, kept per thread object: thread idents are reused
    # once a thread ends, and a new reward worker must not inherit the old track's name.
    self._local = threading.local()
    self._num_tracks = 0
    self._thread_names: dict[int, str] = {}  # track id -> name
    self._start_ns = time.perf_counter_ns()
    self._start_unix_s = time.time()

  # ---- recording ----

  def span(self, name: str, cat: str = "", **args) -> _Span | _NullSpan:
    """A context manager timing its block as one complete event on the calling thread's track."""
    if not self.enabled:
      return _NULL_SPAN
    return _Span(self, name, cat, args)

  def instant(self, name: str, cat: str = "", **args):
    """A point in time on the calling thread's track (e.g. "weights swapped")."""
    if self.enabled:
      self._record("i", name, cat, time.perf_counter_ns(), 0, args)

  def counter(self, name: str, **values: float):
    """A value over time (`ph: "C"`), one series per keyword, e.g. `counter("queue", depth=3)`."""
    if not self.enabled:
      return
    try:
      numbers = {k: float(v) for k, v in values.items()}
    except (TypeError, ValueError) as e:
      raise TypeError(f"Tracer.counter({name!r}): values must be numbers, got {values!r}") from e
    self._record("C", name, "", time.perf_counter_ns(), 0, numbers)

  def set_thread_name(self, name: str):
    """Names the calling thread's track (default: `threading.current_thread().name`)."""
    if self.enabled:
      with self._lock:
        self._thread_names[self._tid_locked()] = name

  def _tid_locked(self) -> int:
    tid = getattr(self._local, "tid", None)
    if tid is None:
      self._num_tracks += 1
      tid = self._local.tid = self._num_tracks
      self._thread_names[tid] = threading.current_thread().name
    return tid

  def _record(self, ph: str, name: str, cat: str, ts_ns: int, dur_ns: int, args: dict[str, Any]):
    with self._lock:
      if len(self._events) >= self.max_events:
        self.dropped_events += 1
        return
      self._events.append((ph, name, cat, ts_ns, dur_ns, self._tid_locked(), args))

  # ---- output ----

  def to_json(self) -> dict[str, Any]:
    """The trace as a Trace Event Format object (what `save` writes)."""
    with self._lock:
      events, names, dropped = list(self._events), dict(self._thread_names), self.dropped_events
    pid = self.pid
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": self.process_name}}]
    for tid, thread_name in sorted(names.items()):
      out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread_name}})
      out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for ph, name, cat, ts_ns, dur_ns, tid, args in events:
      event = {"name": name, "cat": cat, "ph": ph, "ts": (ts_ns - self._start_ns) / 1e3, "pid": pid,
               "tid": tid, "args": {k: _plain(v) for k, v in args.items()}}
      if ph == "X":
        event["dur"] = dur_ns / 1e3
      elif ph == "i":
        event["s"] = "t"  # thread-scoped instant
      out.append(event)
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"dropped_events": dropped, "max_events": self.max_events,
                          "recorded_events": len(events), "start_unix_s": self._start_unix_s}}

  def save(self) -> str | None:
    """Writes the trace so far (safe to call repeatedly, e.g. at each checkpoint); returns the path.

    Raises LogWriteError (an OSError naming the file) when it cannot be written, e.g. on a full disk;
    the previous trace file, if any, is then left as it was.
    """
    if not self.enabled:
      return None
    text = json.dumps(self.to_json(), default=_plain)
    try:
      self._write(text)
    except OSError as e:
      raise LogWriteError(f"{self.path}: trace writer failed: {e}", e.errno) from e
    return self.path

  def _write(self, text: str):
    if "://" in self.path:  # object stores replace objects atomically
      from etils import epath
      epath.Path(self.path).write_text(text)
      return
    directory = os.path.dirname(os.path.abspath(self.path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".trace-", suffix=".json.tmp")
    try:
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
      os.replace(tmp, self.path)  # a reader never sees a half-written file
    except BaseException:
      if os.path.exists(tmp):
        os.remove(tmp)
      raise

  def close(self) -> str | None:
    """Saves and stops recording, also when the save fails (LogWriteError): it is not retried."""
    try:
      return self.save()
    finally:
      self.enabled = False

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False


NULL_TRACER = Tracer(None)  # the default for code that takes an optional tracer


def _plain(value: Any) -> Any:
  """JSON for numpy / JAX scalars and arrays; other unknown objects become their str."""
  if value is None or isinstance(value, (str, int, float, bool, list, tuple, dict)):
    return value
  if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
    return value.item()
  if hasattr(value, "tolist"):
    return value.tolist()
  return str(value)


# ---- analysis ----

def _load_events(path_or_events: str | os.PathLike | Mapping[str, Any] | Iterable[Mapping[str, Any]]
                 ) -> list[Mapping[str, Any]]:
  if isinstance(path_or_events, (str, os.PathLike)):
    path = os.fspath(path_or_events)
    try:
      if "://" in path:
        from etils import epath
        data = json.loads(epath.Path(path).read_text())
      else:
        with open(path, encoding="utf-8") as f:
          data = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not a JSON trace file ({e})") from e
  else:
    data = path_or_events
  if isinstance(data, Mapping):
    if "traceEvents" not in data:
      raise ValueError(f"trace object has no 'traceEvents' key (keys: {sorted(data)})")
    data = data["traceEvents"]
  return list(data)


def busy_intervals(path_or_events) -> dict[str, list[tuple[float, float]]]:
  """Per thread track, the sorted, merged [start, end) intervals (us) covered by complete spans.

  Nested spans count once. Tracks are keyed by thread name (`"pid/name"` when the trace holds
  several processes, e.g. merged host traces); an unnamed thread is keyed `"tid N"`.
  """
  events = _load_events(path_or_events)
  names: dict[tuple[Any, Any], str] = {}
  spans: dict[tuple[Any, Any], list[tuple[float, float]]] = {}
  for i, e in enumerate(events):
    key = (e.get("pid"), e.get("tid"))
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      names[key] = str(e.get("args", {}).get("name"))
    elif e.get("ph") == "X":
      try:
        start, dur = float(e["ts"]), float(e["dur"])
      except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"traceEvents[{i}] ({e.get('name')!r}): complete event needs numeric ts and dur") from err
      if dur < 0:
        raise ValueError(f"traceEvents[{i}] ({e.get('name')!r}): negative dur {dur}")
      spans.setdefault(key, []).append((start, start + dur))
  several_pids = len({pid for pid, _ in set(names) | set(spans)}) > 1

  def label(key):
    name = names.get(key, f"tid {key[1]}")
    return f"{key[0]}/{name}" if several_pids else name

  out: dict[str, list[tuple[float, float]]] = {label(k): [] for k in names}
  for key, intervals in spans.items():  # two tids may share a name: their spans merge into one track
    out.setdefault(label(key), []).extend(intervals)
  return {track: _merge(intervals) for track, intervals in out.items()}


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
  """Union of [start, end) intervals as sorted, disjoint intervals."""
  merged: list[tuple[float, float]] = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], end))
    else:
      merged.append((start, end))
  return merged


def busy_fractions(path_or_events, window: tuple[float, float] | None = None) -> dict[str, float]:
  """Fraction of `window` (us, default: first span start to last span end) each thread track spent
  inside at least one complete span. Accepts a trace path, a loaded trace object or its events."""
  intervals = busy_intervals(path_or_events)
  if window is None:
    starts = [iv[0][0] for iv in intervals.values() if iv]
    ends = [iv[-1][1] for iv in intervals.values() if iv]
    if not starts:
      return {track: 0.0 for track in intervals}
    window = (min(starts), max(ends))
  lo, hi = float(window[0]), float(window[1])
  if not hi > lo:
    raise ValueError(f"busy_fractions: window={window!r} is empty; expected (start_us, end_us) with end > start")
  return {track: sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in iv) / (hi - lo)
          for track, iv in intervals.items()}
