"""rl.deterministic: the sampler and the learner on a logical schedule instead of thread timing.

A free-running run lets thread timing decide which groups make each batch (those that finished
first) and at which decode step new weights reach the sampler. Here both follow from the run's own
progress, so the same seed and config give the same run:

    round r (sampler thread)  the weights of the r-th handover; admit groups until the handover's
                              allowance, (max_staleness + v + 1) * B + admissions freed so far;
                              decode until every one is emitted; then take the next handover
    step  (learner thread)    the next B groups in start order (`RolloutGroup.seq`), waiting for
                              each (a group a filter drops is replaced by the next one); then hand
                              over the new weights with the next allowance

Every token of a group comes from its round's weights (no swap lands mid-sequence), and batch v
holds the groups that round v - max_staleness started. The sampler and learner still overlap: while
the learner trains batch v the sampler decodes round v's groups, up to max_staleness batches ahead.
The price is the end of each round, where the last completions decode at a small batch size, and
memory: while the sampler is behind, up to max_staleness handed-over weight copies wait on its devices.

A dropped group's admission comes back with the next handover; when the learner is short of groups,
every handover taken and everything admitted examined, it hands over the same weights with the
extra admissions (`next_round` returns no params: no swap).

A checkpoint at version N holds what a resumed run cannot regenerate: the groups started before the
sampler's round of version N that no step has examined yet (`carry_over`). Round N and later are
regenerated bit for bit on resume: the same weights, prompts, admissions and noise keys (by `seq`).
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

from tunixlike.rl.queue import QueueTimeout, RolloutQueue, Stopped
from tunixlike.rollout import RolloutGroup


class LockstepQueue(RolloutQueue):
  """The rollout queue of a deterministic run (see the module docstring).

  `pending`: a checkpoint's `carry_over` groups, examined first. `stream_position()`: the prompt
  stream's position, read at the start of each round (the sampler thread's, so nothing races it).
  """

  def __init__(self, batch_groups: int, max_staleness: int, *, stream_position: Callable[[], int],
               start_version: int = 0, counts: dict[str, int] | None = None, pending: list[RolloutGroup] = ()):
    super().__init__(batch_groups, max_staleness, start_version=start_version, counts=counts)
    self._examined = self.admitted  # groups trained or dropped: the next one to examine is `seq` = this
    self._by_seq: dict[int, RolloutGroup] = {}
    for group in pending:
      self._by_seq[group.seq] = group
    self.admitted += len(pending)
    if sorted(self._by_seq) != list(range(self._examined, self.admitted)):
      raise ValueError(f"carried-over groups {sorted(self._by_seq)} are not the next {len(pending)} after "
                       f"{self._examined} examined ones")
    self._unput: set[int] = set()  # seqs admitted and not yet put
    self._stream_position = stream_position
    self._handovers: collections.deque[tuple[Any, int, int]] = collections.deque()  # (params | None, version, allowance)
    self._allowance = self._admission_limit(start_version)
    self._given = self._taken = 0  # handovers made by the learner / taken by the sampler
    self._round_starts: dict[int, tuple[int, int]] = {0: (self.admitted, stream_position())}  # handover -> (admitted, position)
    self._carried: tuple[int, list[RolloutGroup], int] | None = None
    self.sampler_alive: Callable[[], bool] = lambda: True  # the runtime sets its driver's

  @property
  def first_seq(self) -> int:
    """The start order the sampler's next group gets (it seeds the group's noise)."""
    return self.admitted

  # ---- sampler side ---------------------------------------------------------------------------
  def try_admit(self, sampler_version: int) -> bool:
    with self._cond:
      if self.stop_event.is_set() or self.admitted >= self._allowance:
        return False
      self._unput.add(self.admitted)
      self.admitted += 1
      return True

  def next_round(self, timeout_s: float) -> tuple[Any, int] | None:
    """The sampler, with every group it admitted emitted: the next handover's (params or None,
    version), or None when none came within `timeout_s`."""
    with self._cond:
      if not self._handovers:
        self._cond.wait(timeout_s)
      if not self._handovers or self.stop_event.is_set():
        return None
      params, version, self._allowance = self._handovers.popleft()
      self._taken += 1
      self._round_starts[self._taken] = (self.admitted, self._stream_position())
      for old in [k for k in self._round_starts if k < self._taken - 64]:
        del self._round_starts[old]
      self._cond.notify_all()
      return params, version

  def _depth(self) -> int:
    return len(self._by_seq)

  def put(self, group: RolloutGroup):
    with self._cond:
      self._by_seq[group.seq] = group
      self._unput.discard(group.seq)
      self._cond.notify_all()

  # ---- learner side ---------------------------------------------------------------------------
  def hand_over(self, params, version: int) -> None:
    """After a step: the sampler's next round uses these weights (taken in order, never skipped)."""
    with self._cond:
      self._handovers.append((params, version, self._admission_limit(version)))
      self._given += 1
      self._cond.notify_all()

  def get_batch(self, learner_version: int, timeout_s: float,
                keep: Callable[[RolloutGroup], bool] | None = None) -> list[RolloutGroup]:
    """The next `batch_groups` groups in start order that pass the staleness bound and `keep`."""
    deadline = time.monotonic() + timeout_s
    batch: list[RolloutGroup] = []
    with self._cond:
      while len(batch) < self.batch_groups:
        group = self._by_seq.pop(self._examined, None)
        if group is None:
          self._wait(deadline, timeout_s, learner_version)
          continue
        self._examined += 1
        if self._too_old(group, learner_version):
          self.dropped_stale += 1
        elif keep is not None and not keep(group):
          self.dropped_filtered += 1
        else:
          batch.append(group)
          continue
        self._on_drop(group)
      self.trained += len(batch)
      self._consume(len(batch), learner_version)
    return batch

  def _wait(self, deadline: float, timeout_s: float, learner_version: int) -> None:
    """Waits for the next group; asks for more when the sampler has done all it was given."""
    drained = not self._handovers and self._given == self._taken and not self._unput
    if drained and self.admitted >= self._allowance and self._examined >= self.admitted:
      allowance = self._admission_limit(learner_version)
      if allowance <= self._allowance:
        raise RuntimeError(f"deterministic schedule: step {learner_version} needs group {self._examined}, and "
                           f"every admitted group ({self.admitted}) was examined with nothing freed")
      self._handovers.append((None, learner_version, allowance))
      self._given += 1
      self._cond.notify_all()
    if self.stop_event.is_set():
      raise Stopped("rollout queue stopped")
    remaining = deadline - time.monotonic()
    if remaining <= 0:
      raise QueueTimeout(f"waited {timeout_s:.0f}s for group {self._examined} in start order (admitted "
                         f"{self.admitted}, round {self._taken} of {self._given} handed over); is the sampler "
                         "stuck? (rl.wait_timeout_s)")
    self._cond.wait(min(remaining, 0.5))

  def carry_over(self, timeout_s: float) -> tuple[list[RolloutGroup], int] | None:
    """What a checkpoint of the current version keeps: the groups started before the sampler's
    round of the last handover and not yet examined (scored, in start order), and the prompt
    stream's position at that round's start. Waits (bounded) for the sampler to take that handover
    and for those groups to be scored; None when it cannot (the sampler stopped or is stuck)."""
    deadline = time.monotonic() + timeout_s
    with self._cond:
      target = self._given
      if self._carried is not None and self._carried[0] == target:
        return self._carried[1], self._carried[2]
      while True:
        start = self._round_starts.get(target)
        if start is not None and not any(seq < start[0] for seq in self._unput):
          break
        if self.stop_event.is_set() or not self.sampler_alive() or time.monotonic() > deadline:
          return None
        self._cond.wait(min(deadline - time.monotonic(), 0.5))
      admitted, position = start
      groups = [self._by_seq[seq] for seq in range(self._examined, admitted)]
      self._carried = (target, groups, position)
      return groups, position


def timed_elsewhere(cfg) -> bool:
  """rl.env or rl.agent episodes, multi-agent episodes or whole sampler hosts: an outside program or other
  hosts decide when the run's rollouts advance (Config refuses rl.deterministic with them)."""
  return bool(cfg.rl.env or cfg.rl.agent or cfg.multi_agent.env or cfg.mesh.sampler_hosts)


def describe(cfg) -> str:
  """The start-up line on reproducibility: whether the same command gives the same run, and why."""
  rl, episodes = cfg.rl, timed_elsewhere(cfg)
  if rl.deterministic:
    return ("deterministic: yes (rl.deterministic: each sampler round uses one weight version, batches go in "
            "prompt order); the same seed and config on the same backend and device count give the same run, "
            "with reward functions that depend on their inputs only")
  if rl.max_staleness == 0 and not episodes:
    return "deterministic: yes (rl.max_staleness=0: one batch in flight at a time)"
  why = ("an outside program or other hosts decide when episodes advance" if episodes else
         "thread timing decides which groups make each batch and where weight swaps land; rl.deterministic=true "
         "fixes both")
  return f"deterministic: no ({why})"
