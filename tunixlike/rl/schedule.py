"""What decides an async run, recorded step by step (WORKDIR/schedule.jsonl), and its replay.

Given the config, the weights it starts from and the prompts, a single-turn run is decided by:
  * each sampler step's weight swap (the version it swapped to) and how many groups it admitted
    (every other step only decodes: those are counted, not listed); thread timing decides both;
  * which groups each learner step trained and dropped (by start order, `RolloutGroup.seq`), and
    where the learner took its batch among the sampler's steps;
  * the rewards as scored (a reward may call an outside service).
Noise keys follow from the seed and each group's start order. One line per learner step:

    {"step": 12, "sampler": [[plain, swap, admitted, generated], ...], "tail": plain,
     "batch": [seq, ...], "dropped": [seq, ...], "rewards": {seq: {...}}, "metrics": {...}, "checksum": n}

where `plain` counts the steps before that only decoded, and a run (or a resume) starts a segment
with `{"segment": step, "stream": ..., "queue": ..., "first_seq": n}`. `replay` reruns a segment in
one thread, doing exactly what the record says in the recorded order, and compares each step's
metrics (timings aside) and weights checksum with the record.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable

import numpy as np

from tunixlike import metrics as metrics_lib
from tunixlike.rl.hooks import StepInfo
from tunixlike.rl.queue import RolloutQueue
from tunixlike.rollout import RolloutGroup

FILE = "schedule.jsonl"
# What thread timing may change between two runs of the same schedule: how long things took, how full
# the queue was when a step read it. A step's every other metric is part of what it decided.
# (`time_s`: the clock of a metrics.jsonl record.)
TIMING_METRICS = ("time_s", "learner/step_s", "learner/wait_s", "learner/busy_frac", "sampler/busy_frac",
                  "sampler/tokens_per_s", "sampler/slot_occupancy", "sampler/draft_acceptance",
                  "sampler/tokens_per_decode_step", "sampler/verify_calls", "sampler/draft_frac",
                  "sync/ms", "queue/depth", "queue/in_flight", "queue/admitted")


def without_timing(record: dict[str, Any]) -> dict[str, Any]:
  """A metrics record without `TIMING_METRICS`: what two runs of the same schedule must agree on."""
  return {k: v for k, v in record.items() if k not in TIMING_METRICS}


def decided(metrics: dict[str, Any]) -> dict[str, float]:
  """A step's metrics without the timing ones, as JSON numbers."""
  return {k: float(v) for k, v in without_timing(metrics).items() if isinstance(v, (int, float, np.number))}


def checksum(policy) -> int:
  """The sampler's weights as the learner holds them, summed bit for bit (`weight_sync.checksum`)."""
  from tunixlike.rl import weight_sync  # JAX: not needed to read a record
  return weight_sync.checksum(policy.full_params())


def _rewards(group: RolloutGroup) -> dict[str, Any]:
  terms = {k: v.tolist() for k, v in (group.term_rewards or {}).items()}
  return {"rewards": group.rewards.tolist(), "terms": terms, "metrics": dict(group.reward_metrics)}


class Recorder:
  """Writes the schedule of a run as it goes: `sampler_step` is the driver's `on_step` (its thread),
  `took` the runtime's `on_batch`, `step` a hook after each step (the learner's thread)."""

  def __init__(self, path: str, *, segment: int, stream: dict, queue: dict, first_seq: int, kept: bool):
    """`kept`: the segment continues the rollouts in flight its checkpoint kept (`rl/in_flight.py`)."""
    self.path = path
    self._lock = threading.Lock()
    self._events: list[list] = []
    self._plain = 0
    self._taken: tuple[list[list], int] | None = None
    self._write({"segment": segment, "stream": stream, "queue": queue, "first_seq": first_seq, "kept": kept})

  def _write(self, record: dict) -> None:
    try:
      with open(self.path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    except OSError as e:  # e.g. a full disk: one line naming the file, as for the other logs
      raise metrics_lib.LogWriteError(f"{self.path}: schedule log write failed: {e}", e.errno) from e

  def sampler_step(self, swapped_to: int | None, admitted: int, generated: bool) -> None:
    with self._lock:
      if swapped_to is None and not admitted:
        self._plain += 1
      else:
        self._events.append([self._plain, swapped_to, admitted, generated])
        self._plain = 0

  def took(self, groups: list[RolloutGroup]) -> None:
    """The learner took its batch: the sampler's steps so far come before it."""
    with self._lock:
      self._taken, self._events, self._plain = (self._events, self._plain), [], 0

  def replay_point(self, version: int, *, stream: dict, queue: dict, first_seq: int) -> None:
    """The sampler drained and holds version `version`'s weights, and the checkpoint at `version`
    keeps the queue: a replay may start here. The sampler's steps since the last batch (the drain)
    are this record's: a replay that passes through reruns them, one that starts here does not."""
    with self._lock:
      events, plain, self._events, self._plain = self._events, self._plain, [], 0
    self._write({"replay_point": version, "sampler": events, "tail": plain, "stream": stream, "queue": queue,
                 "first_seq": first_seq, "kept": True})

  def step(self, info: StepInfo, policy) -> None:
    events, tail = self._taken or ([], 0)
    scored = info.trained + info.dropped
    self._write({"step": info.step, "sampler": events, "tail": tail, "batch": [g.seq for g in info.trained],
                 "dropped": [g.seq for g in info.dropped],
                 "rewards": {str(g.seq): _rewards(g) for g in scored}, "metrics": decided(info.metrics),
                 "checksum": checksum(policy)})


def read(path: str) -> list[dict]:
  """The records of a schedule file; a last line cut by a crash is left out."""
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return out


def at(record: dict) -> int:
  """The step a step record or a replay point is at."""
  return record["step"] if "step" in record else record["replay_point"]


def segments(records: list[dict]) -> list[tuple[dict, list[dict]]]:
  """(segment header, its step records and replay points) in the order the run went; a resumed
  run's records replace those of an earlier segment from its step on (what the checkpoint lineage
  holds)."""
  out: list[tuple[dict, list[dict]]] = []
  for r in records:
    if "segment" in r:
      out.append((r, []))
    elif out:
      out[-1][1].append(r)
  for i in range(len(out) - 1):  # steps redone after a resume belong to the later segment
    out[i] = (out[i][0], [r for r in out[i][1] if at(r) < out[i + 1][0]["segment"]])
  return out


def starts(records: list[dict]) -> list[tuple[dict, list[dict]]]:
  """Every place a replay can start, in order: (header, the records after it) for each segment
  start and each replay point (its header the point's own record: stream, queue, first_seq)."""
  out = []
  for header, rest in segments(records):
    out.append((header, rest))
    for i, r in enumerate(rest):
      if "replay_point" in r:
        out.append(({**r, "segment": r["replay_point"]}, rest[i + 1:]))
  return out


class Diverged(AssertionError):
  """The replay did something the record says the run did not."""


class ReplaySampler:
  """The runtime's driver in a replay: the real driver, stepped by `replay`; the weights the learner
  hands over wait until the record says the sampler swapped to them."""

  def __init__(self):
    self.driver = None
    self.handed: dict[int, Any] = {}
    self.allowed = 0

  @property
  def stats(self):
    return self.driver.stats

  def may_start_group(self, version: int) -> bool:
    if self.allowed <= 0:
      return False
    self.allowed -= 1
    return True

  def update_params(self, params, version: int, *, drain: bool = False) -> None:
    self.handed[version] = params

  def start(self) -> None: ...
  def check(self) -> None: ...
  def stop(self, timeout_s: float) -> None: ...

  def step(self, swap: int | None, admitted: int, generated: bool, where: str) -> None:
    if swap is not None:
      if swap not in self.handed:
        raise Diverged(f"{where}: the sampler swapped to version {swap}, which the learner has not made")
      self.driver.update_params(self.handed.pop(swap), swap)
    self.allowed = admitted
    ran = self.driver.step()
    if ran != generated or self.allowed:
      raise Diverged(f"{where}: the sampler {'ran' if ran else 'did not run'} a generate call and admitted "
                     f"{admitted - self.allowed} groups; the record says {'it ran one' if generated else 'none'} "
                     f"and {admitted}")


class ReplayQueue(RolloutQueue):
  """The learner's batches as the record says: `plan(batch, dropped)` before each `get_batch`; the
  weights a deterministic run hands over go to `sampler` like any other run's."""

  def __init__(self, *args, sampler: ReplaySampler, **kwargs):
    super().__init__(*args, **kwargs)
    self.hand_over = sampler.update_params

  def plan(self, batch: list[RolloutGroup], dropped: list[RolloutGroup]) -> None:
    self._planned = batch, dropped

  def get_batch(self, learner_version, timeout_s, keep=None):
    batch, dropped = self._planned
    for group in dropped:
      if self._too_old(group, learner_version):
        self.dropped_stale += 1
      else:
        self.dropped_filtered += 1
      self._on_drop(group)
    self.trained += len(batch)
    self._consume(len(batch), learner_version)
    return batch


def replay(runtime, sampler: ReplaySampler, queue: ReplayQueue, steps: list[dict], groups: dict[int, RolloutGroup],
           *, until: int | None = None, say: Callable[[str], None] = print) -> dict[str, Any]:
  """Reruns a segment's `steps` (after `runtime` was built on the segment's start; `groups`: where
  its sink puts finished groups) and compares each step with its record. Returns {"steps":
  replayed, "first_difference": step or None, "detail": what differed}."""
  runtime.begin()
  done = 0
  for record in steps:
    step = at(record)
    if until is not None and step >= until:
      break
    where = f"step {step}" if "step" in record else f"the replay point at step {step}"
    for plain, swap, admitted, generated in record["sampler"]:
      for _ in range(plain):
        sampler.step(None, 0, True, where)
      sampler.step(swap, admitted, generated, where)
    for _ in range(record["tail"]):
      sampler.step(None, 0, True, where)
    if "replay_point" in record:  # the drained sampler, as the checkpoint there saw it
      if not sampler.driver.is_idle or sampler.driver.version != step:
        raise Diverged(f"{where}: the sampler is not drained with version {step}'s weights")
      continue
    missing = [seq for seq in record["batch"] + record["dropped"] if seq not in groups]
    if missing:
      raise Diverged(f"{where}: groups {missing[:5]} of the recorded batch were never sampled")
    queue.plan([groups.pop(seq) for seq in record["batch"]], [groups.pop(seq) for seq in record["dropped"]])
    metrics = decided(runtime.train(step, queue.get_batch(runtime.policy.version, 0.0), 0.0))
    done += 1
    differs = {k: (v, metrics.get(k)) for k, v in record["metrics"].items() if metrics.get(k) != v}
    total = checksum(runtime.policy)
    if differs or total != record["checksum"]:
      detail = (f"{where}: " + "; ".join(f"{k} recorded {a!r}, replayed {b!r}" for k, (a, b) in sorted(differs.items()))
                if differs else f"{where}: the weights' checksum {total} differs from the recorded {record['checksum']}")
      return {"steps": done, "first_difference": step, "detail": detail}
    say(f"step {step}: equal (loss {metrics.get('loss')}, weights checksum {total})")
  return {"steps": done, "first_difference": None, "detail": None}


def sink_for(groups: dict[int, RolloutGroup], scorer, rewards: Callable[[int], dict | None]):
  """A replay's reward stage, in the sampler's step: the rewards as recorded (recomputed only for
  groups the record never scored, which no replayed step trains), then the advantages."""
  def sink(group: RolloutGroup) -> None:
    scored = rewards(group.seq)
    if scored is not None:
      group.rewards = np.asarray(scored["rewards"], np.float32)
      group.term_rewards = {k: np.asarray(v, np.float32) for k, v in scored["terms"].items()} or None
      group.reward_metrics = dict(scored["metrics"])
      scorer(group)
    groups[group.seq] = group
  return sink
