"""The bounded rollout queue between sampler and learner, with staleness control (DESIGN "Staleness").

Admission control (AReaL, `areal/infra/staleness_manager.py`): the sampler may start a group only while
    consumed + in_flight < (max_staleness + v + 1) * batch_groups,   v = the sampler's weights version,
where `consumed` counts the groups of every batch that advanced the policy to its current version
(start_version * batch_groups after a resume; a batch whose step was skipped as non-finite gives
its admissions back). So a group started at sampler version v is trained at a learner step
<= v + max_staleness, and the queue never holds more than (max_staleness + 1) batches. Finished work is never thrown away to
bound the queue (that biases training toward short, easy rollouts); groups are dropped only by
version rejection (oldest token older than version - max_staleness) or by a batch filter such as
DAPO dynamic sampling, and each drop frees an admission so the sampler regenerates the work.
With max_staleness=0 this is exactly the synchronous loop: one batch in flight at a time.

Long-tailed generation finishes groups out of order, so counting alone would let a slow group fall
behind and be rejected (the bias toward short rollouts again). The learner therefore takes the
oldest ready groups first and, before training version L, waits for every group started at a
version <= L - max_staleness: that is the only wait the staleness bound requires, and with
oldest-first selection those groups always fit in one batch.

Every wait has a timeout and a stop event, so a dead peer surfaces as an error, never a hang.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Sequence

from tunixlike.rollout import RolloutGroup


class QueueTimeout(TimeoutError):
  """A wait on the queue exceeded its timeout (the other side is stuck or dead)."""


class Stopped(RuntimeError):
  """The runtime is shutting down (error elsewhere, preemption or the end of training)."""


class RolloutQueue:

  def __init__(self, batch_groups: int, max_staleness: int, stop_event: threading.Event | None = None,
               on_drop: Callable[[RolloutGroup], None] | None = None, start_version: int = 0,
               counts: dict[str, int] | None = None, carried: Sequence[RolloutGroup] = (), continued: int = 0,
               first_seq: int = 0):
    """`start_version`: the policy version the learner starts from (a resumed run's step).
    `counts`: `counts()` of the run being resumed, so the queue's counters continue. Dropped groups
    go to `on_drop`, by default kept until `take_dropped()`. A checkpoint's rollouts in flight
    (`rl/in_flight.py`) are admitted again: its scored groups (`carried`) are queued, and `continued`
    groups the driver goes on decoding run as if admitted at `start_version`; the driver's new groups
    start at `first_seq`, after theirs."""
    if batch_groups < 1:
      raise ValueError(f"batch_groups={batch_groups}: must be >= 1")
    if max_staleness < 0:
      raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
    self.batch_groups = batch_groups
    self.max_staleness = max_staleness
    self.stop_event = stop_event or threading.Event()
    self._dropped: list[RolloutGroup] = []
    self._on_drop = on_drop or self._dropped.append  # dropped groups are counted and reported, never silently lost
    self._cond = threading.Condition()
    self._ready: list[RolloutGroup] = []
    self._running: collections.Counter[int] = collections.Counter()  # start version -> groups not yet put
    counts = counts or {}
    self.dropped_stale = int(counts.get("dropped_stale", 0))
    self.dropped_filtered = int(counts.get("dropped_filtered", 0))
    self.trained = int(counts.get("trained", 0))
    # Groups ever admitted: those a resume regenerates are admitted again as they start.
    self.admitted = self.trained + self.dropped_stale + self.dropped_filtered + len(carried) + continued
    self._consumed = start_version * batch_groups  # groups whose batches advanced the policy
    self._ready.extend(carried)
    if continued:
      self._running[self._running_key(start_version)] += continued
    self._first_seq = first_seq

  @property
  def first_seq(self) -> int:
    """The start order of the sampler's first new group (it seeds the group's noise)."""
    return self._first_seq

  def ready_groups(self) -> list[RolloutGroup]:
    """The scored groups waiting for a batch (a checkpoint keeps them)."""
    with self._cond:
      return list(self._ready)

  # ---- the staleness rule (EpisodeQueue applies it per policy) -------------------------------
  def _admissible(self, sampler_version: int) -> bool:
    return self.admitted < self._admission_limit(sampler_version)

  def _admission_limit(self, sampler_version: int) -> int:
    """The rule as a count of groups ever admitted: `consumed + in_flight < (max_staleness + v + 1) *
    batch_groups` is `admitted < (max_staleness + v + 1) * batch_groups + admissions freed`."""
    return (self.max_staleness + sampler_version + 1) * self.batch_groups + self._freed()

  def _freed(self) -> int:
    return self.dropped_stale + self.dropped_filtered + self.trained - self._consumed

  def _too_old(self, group: RolloutGroup, learner_version: int) -> bool:
    return group.min_version < learner_version - self.max_staleness

  def _last_chance(self, admitted_version: int, learner_version: int) -> bool:
    """Work admitted at this version must be in the batch that trains `learner_version`."""
    return admitted_version <= learner_version - self.max_staleness

  def _age(self, group: RolloutGroup):
    return group.min_version

  def _consume(self, groups: int, learner_version: int) -> None:
    self._consumed += groups

  # ---- sampler side -------------------------------------------------------------------------

  @property
  def in_flight(self) -> int:
    """Admitted groups that are neither trained nor dropped (running, scoring or queued)."""
    return self.admitted - self.dropped_stale - self.dropped_filtered - self.trained

  @staticmethod
  def _running_key(version):
    return version

  def try_admit(self, sampler_version: int) -> bool:
    """Admits one new group if the staleness bound allows it (never blocks).

    `sampler_version` is the version of the weights the group will start with: the sampler asks
    with its own current version, so a weight update that is queued but not yet swapped in never
    admits work that would then start on the old weights.
    """
    with self._cond:
      if self.stop_event.is_set():
        return False
      if self._admissible(sampler_version):
        self.admitted += 1
        self._running[self._running_key(sampler_version)] += 1
        return True
      return False

  def admitted_elsewhere(self, sampler_version: int) -> None:
    """A sampler on another host admitted a group by this queue's rule (`admissions_freed`): count
    it as running, so that the learner waits for it as for a local one."""
    with self._cond:
      self.admitted += 1
      self._running[self._running_key(sampler_version)] += 1

  def admissions_freed(self) -> int:
    """Admissions given back so far (drops, trained groups not consumed by a step). The rule above
    is `admitted < (max_staleness + v + 1) * batch_groups + admissions_freed()`: a sampler on
    another host applies it with this number alone (`hosts.rollouts`)."""
    with self._cond:
      return self._freed()

  def put(self, group: RolloutGroup):
    """A finished (and scored) group enters the queue. Never blocks: admission bounded it."""
    with self._cond:
      self._ready.append(group)
      self._running[self._running_key(group.admitted_version)] -= 1
      self._cond.notify_all()

  # ---- learner side -------------------------------------------------------------------------
  def get_batch(self, learner_version: int, timeout_s: float,
                keep: Callable[[RolloutGroup], bool] | None = None) -> list[RolloutGroup]:
    """Blocks until a batch for `learner_version` is ready; returns the `batch_groups` oldest groups.

    Waits for every group started at a version <= learner_version - max_staleness (this is its
    last chance to be trained). Groups older than the bound anyway are dropped (version rejection);
    groups that fail `keep` (e.g. zero reward variance) are dropped too. Both are counted, reported
    and free their admission so the sampler makes replacements.
    """
    deadline = time.monotonic() + timeout_s
    # ids of groups that passed both checks for this learner_version: each put wakes this loop, and
    # re-checking every queued group's versions at each wake cost the learner ms per step.
    checked: set[int] = set()
    with self._cond:
      while True:
        for group in list(self._ready):
          if id(group) in checked:
            continue
          if self._too_old(group, learner_version):
            self.dropped_stale += 1
          elif keep is not None and not keep(group):
            self.dropped_filtered += 1
          else:
            checked.add(id(group))
            continue
          self._ready.remove(group)
          self._on_drop(group)
          self._cond.notify_all()  # a drop frees an admission
        waiting_old = sum(max(n, 0) for v, n in self._running.items() if self._last_chance(v, learner_version))
        if not waiting_old and len(self._ready) >= self.batch_groups:
          break
        if self.stop_event.is_set():
          raise Stopped("rollout queue stopped")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          raise QueueTimeout(
              f"waited {timeout_s:.0f}s for rollouts (ready {len(self._ready)} of {self.batch_groups}, "
              f"{waiting_old} old groups still running; in flight {self.in_flight}); is the sampler stuck? "
              "(rl.wait_timeout_s)")
        self._cond.wait(min(remaining, 0.5))
      self._ready.sort(key=self._age)  # stable: arrival order within a version
      batch, self._ready = self._ready[:self.batch_groups], self._ready[self.batch_groups:]
      self.trained += len(batch)
      self._consume(len(batch), learner_version)
    return batch

  def step_skipped(self, groups: int):
    """The batch of `groups` did not advance the policy (a non-finite step): its admissions are
    given back, so the sampler makes a new batch for the same version instead of stalling."""
    with self._cond:
      self._consumed -= groups
      self._cond.notify_all()

  def take_dropped(self) -> list[RolloutGroup]:
    """The groups dropped since the last call (with the default `on_drop`), oldest first."""
    with self._cond:
      out, self._dropped = self._dropped, []
    return out

  def counts(self) -> dict[str, int]:
    """What a checkpoint keeps to continue the counters on resume."""
    with self._cond:
      return {"trained": self.trained, "dropped_stale": self.dropped_stale,
              "dropped_filtered": self.dropped_filtered}

  def _depth(self) -> int:
    return len(self._ready)

  def depth(self) -> int:
    with self._cond:
      return self._depth()

  def stats(self) -> dict[str, float]:
    with self._cond:
      return {"queue/depth": self._depth(), "queue/in_flight": self.in_flight,
              "queue/dropped_stale": self.dropped_stale, "queue/dropped_filtered": self.dropped_filtered,
              "queue/admitted": self.admitted}

