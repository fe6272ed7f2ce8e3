"""Trace recorder: named per-thread tracks, nesting, the event cap, and busy fractions."""

import json
import os
import threading
import time

import numpy as np
import pytest

from tunixlike import trace

REQUIRED_X_KEYS = {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}


def _spans(data, name=None):
  return [e for e in data["traceEvents"] if e["ph"] == "X" and (name is None or e["name"] == name)]


def _thread_names(data):
  return {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}


def test_threads_land_on_named_tracks_with_nesting_and_durations(tmp_path):
  path = tmp_path / "trace.json"
  tracer = trace.Tracer(path)
  started = threading.Barrier(3)

  def work(cat):
    started.wait(timeout=10)  # all three run at once, as sampler / learner / sync do
    with tracer.span("outer", cat=cat, role=cat):
      time.sleep(0.02)
      with tracer.span("inner", cat=cat):
        time.sleep(0.03)
      time.sleep(0.01)

  threads = [threading.Thread(target=work, args=(n,), name=n) for n in ("sampler", "learner", "weight-sync")]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=10)
  assert tracer.save() == str(path)

  with open(path) as f:
    data = json.load(f)
  assert data["displayTimeUnit"] == "ms"
  names = _thread_names(data)
  assert sorted(names.values()) == ["learner", "sampler", "weight-sync"]
  assert len(set(names)) == 3  # three distinct tracks
  for e in _spans(data):
    assert REQUIRED_X_KEYS <= set(e), e
    assert e["pid"] == os.getpid()
  for tid, thread_name in names.items():
    outer = [e for e in _spans(data, "outer") if e["tid"] == tid]
    inner = [e for e in _spans(data, "inner") if e["tid"] == tid]
    assert len(outer) == 1 and len(inner) == 1, thread_name
    outer, inner = outer[0], inner[0]
    assert outer["cat"] == inner["cat"] == thread_name  # each thread's spans sit on its own track
    assert outer["args"] == {"role": thread_name}
    # Nesting: the inner span lies inside the outer one, with the sleeps before and after it.
    assert outer["ts"] + 20_000 <= inner["ts"]
    assert inner["ts"] + inner["dur"] + 10_000 <= outer["ts"] + outer["dur"]
    assert inner["dur"] >= 30_000 and outer["dur"] >= 60_000  # microseconds
    assert outer["dur"] < 5_000_000
  # The threads overlapped: every outer span starts before any other ends.
  outers = _spans(data, "outer")
  assert max(e["ts"] for e in outers) < min(e["ts"] + e["dur"] for e in outers)
  assert not [p for p in os.listdir(tmp_path) if p != "trace.json"]  # no temp file left behind


def test_instant_counter_set_and_error(tmp_path):
  tracer = trace.Tracer(tmp_path / "t.json", process_name="host0")
  tracer.set_thread_name("learner")
  tracer.instant("weights_swapped", cat="sync", version=3)
  tracer.counter("queue", depth=2, inflight=np.int32(5))
  with tracer.span("generate", cat="sampler") as s:
    s.set(tokens=np.int64(17), mean=np.float32(0.5))
  with pytest.raises(KeyError):
    with tracer.span("reward", cat="reward"):
      raise KeyError("boom")
  with pytest.raises(TypeError, match="queue"):
    tracer.counter("queue", depth="deep")
  data = json.loads(json.dumps(tracer.to_json()))  # the saved form
  tracer.close()
  with open(tmp_path / "t.json") as f:
    assert json.load(f) == data

  events = data["traceEvents"]
  process = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
  assert process[0]["args"] == {"name": "host0"}
  assert list(_thread_names(data).values()) == ["learner"]
  (instant,) = [e for e in events if e["ph"] == "i"]
  assert instant["name"] == "weights_swapped" and instant["args"] == {"version": 3} and instant["s"] == "t"
  (counter,) = [e for e in events if e["ph"] == "C"]
  assert counter["args"] == {"depth": 2.0, "inflight": 5.0}
  (gen,) = _spans(data, "generate")
  assert gen["args"] == {"tokens": 17, "mean": 0.5}
  (reward,) = _spans(data, "reward")
  assert reward["args"] == {"error": "KeyError"}
  assert [e["ts"] for e in events if e["ph"] != "M"] == sorted(e["ts"] for e in events if e["ph"] != "M")
  # After close, nothing more is recorded.
  tracer.instant("late")
  assert len(tracer.to_json()["traceEvents"]) == len(events)


def test_disabled_tracer_records_and_writes_nothing(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  tracer = trace.Tracer(None)
  first = tracer.span("generate", cat="sampler", slots=4)
  assert first is tracer.span("other") is trace.NULL_TRACER.span("x")  # one shared no-op object
  with first as s:
    s.set(tokens=3)
  tracer.instant("x")
  tracer.counter("queue", depth=1)
  tracer.set_thread_name("sampler")
  assert tracer.save() is None and tracer.close() is None
  assert tracer.to_json()["traceEvents"] == [e for e in tracer.to_json()["traceEvents"] if e["ph"] == "M"]
  assert len(tracer.to_json()["traceEvents"]) == 1  # only the process name
  assert os.listdir(tmp_path) == []


def test_event_cap_counts_dropped_events(tmp_path):
  tracer = trace.Tracer(tmp_path / "t.json", max_events=5)
  for i in range(8):
    with tracer.span("step", i=i):
      pass
  tracer.counter("c", v=1)
  data = tracer.to_json()
  assert [e["args"]["i"] for e in _spans(data)] == [0, 1, 2, 3, 4]  # the first ones are kept
  assert data["otherData"]["dropped_events"] == 4
  assert data["otherData"]["recorded_events"] == 5
  with pytest.raises(ValueError, match="max_events"):
    trace.Tracer(tmp_path / "t.json", max_events=0)


def test_save_is_repeatable_and_replaces_the_file(tmp_path):
  path = tmp_path / "sub" / "trace.json"  # the directory is created
  tracer = trace.Tracer(path)
  with tracer.span("a"):
    pass
  tracer.save()
  with tracer.span("b"):
    pass
  tracer.save()
  with open(path) as f:
    assert [e["name"] for e in _spans(json.load(f))] == ["a", "b"]
  assert os.listdir(path.parent) == ["trace.json"]


def _hand_made_trace():
  """Two named tracks (pid 1): A is busy [0,10) (with a nested [2,4)) and [20,30); B [5,12) and [8,15)."""
  m = lambda tid, name: {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
  x = lambda tid, ts, dur: {"name": "s", "cat": "", "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": {}}
  return {"traceEvents": [m(1, "A"), m(2, "B"), m(3, "idle"),
                          x(1, 0, 10), x(1, 2, 2), x(1, 20, 10), x(2, 5, 7), x(2, 8, 7),
                          {"name": "i", "ph": "i", "ts": 3, "pid": 1, "tid": 2, "s": "t", "args": {}}],
          "displayTimeUnit": "ms"}


def test_busy_fractions_hand_computed(tmp_path):
  data = _hand_made_trace()
  assert trace.busy_intervals(data) == {"A": [(0, 10), (20, 30)], "B": [(5, 15)], "idle": []}
  # Whole run: window [0, 30). A busy 10 + 10 = 20, B busy 10 (overlap counted once), idle 0.
  assert trace.busy_fractions(data) == pytest.approx({"A": 20 / 30, "B": 10 / 30, "idle": 0.0})
  # Window [10, 30): A busy [20, 30) = 10 -> 0.5; B busy [10, 15) = 5 -> 0.25.
  assert trace.busy_fractions(data, window=(10, 30)) == pytest.approx({"A": 0.5, "B": 0.25, "idle": 0.0})
  path = tmp_path / "hand.json"
  path.write_text(json.dumps(data))
  assert trace.busy_fractions(str(path)) == trace.busy_fractions(data["traceEvents"])
  # Two processes (merged host traces): tracks are keyed "pid/name".
  other = [dict(e, pid=2) for e in data["traceEvents"]]
  merged = trace.busy_fractions(data["traceEvents"] + other)
  assert merged == pytest.approx({"1/A": 2 / 3, "1/B": 1 / 3, "1/idle": 0.0, "2/A": 2 / 3, "2/B": 1 / 3, "2/idle": 0.0})


def test_busy_fractions_of_a_recorded_trace(tmp_path):
  tracer = trace.Tracer(tmp_path / "t.json")

  def sampler():
    for _ in range(3):
      with tracer.span("generate"):
        time.sleep(0.01)

  t = threading.Thread(target=sampler, name="sampler")
  t.start()
  t.join(timeout=10)
  tracer.set_thread_name("learner")
  with tracer.span("train"):
    time.sleep(0.01)
  path = tracer.close()
  fractions = trace.busy_fractions(path)
  assert set(fractions) == {"sampler", "learner"}
  # Recomputed from the raw spans: union of each track's spans over the first-to-last window.
  data = tracer.to_json()
  spans = _spans(data)
  lo, hi = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
  learner_tid = next(t for t, n in _thread_names(data).items() if n == "learner")
  learner = [e for e in spans if e["tid"] == learner_tid]
  assert fractions["learner"] == pytest.approx(learner[0]["dur"] / (hi - lo))
  assert 0 < fractions["learner"] < 1 and 0 < fractions["sampler"] < 1
  assert fractions["learner"] + fractions["sampler"] <= 1 + 1e-9  # they ran one after the other


def test_busy_fractions_bad_input(tmp_path):
  with pytest.raises(ValueError, match="traceEvents"):
    trace.busy_fractions({"events": []})
  with pytest.raises(ValueError, match="window"):
    trace.busy_fractions(_hand_made_trace(), window=(5, 5))
  with pytest.raises(ValueError, match=r"traceEvents\[0\].*dur"):
    trace.busy_fractions([{"name": "bad", "ph": "X", "ts": 0, "pid": 1, "tid": 1}])
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match="bad.json"):
    trace.busy_fractions(str(bad))
  assert trace.busy_fractions([]) == {}


def test_a_new_thread_gets_its_own_track_even_if_its_ident_is_reused(tmp_path):
  tracer = trace.Tracer(tmp_path / "t.json")
  for name in ("reward-0", "reward-1", "reward-2"):  # run one after another: idents are often reused
    t = threading.Thread(target=lambda: tracer.instant("score"), name=name)
    t.start()
    t.join(timeout=10)
  data = tracer.to_json()
  names = _thread_names(data)
  assert sorted(names.values()) == ["reward-0", "reward-1", "reward-2"]
  assert sorted(e["tid"] for e in data["traceEvents"] if e["ph"] == "i") == sorted(names)
