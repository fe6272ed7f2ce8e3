"""Rollouts from the sampler hosts to the learner hosts, with the learner's admission control.

Each learner host keeps its own `RolloutQueue` (its share of every batch: prompts_per_step / L
groups) with the staleness rule, and publishes through the coordination service's key-value store
the one number the rule needs from it, `admissions_freed()`. A sampler host applies the same rule
remotely: ticket t of learner host l (sampler host i of S owns the tickets t = i, i + S, ...) may
start at sampler version v only while t < (max_staleness + v + 1) * batch_groups + freed_l, so the
admissions of all sampler hosts together never exceed what the learner's own queue would admit
(a slow sampler host can only leave some unused). Before a group starts, its start version is
written (the learner counts it as running and waits for it as for a local one); when it is scored,
the group itself (`wire.encode`) goes to the learner host it was admitted for. The learner host's
inbox thread moves both into its queue. The learner publishes `stop` at the end of the run.

A sampler host that dies or hangs stops sending its heartbeat (written while it admits work, at
most once a second); the learner host's inbox then fails within `silence_timeout_s` (a run's
`mesh.host_timeout_s`, as is the admission's `timeout_s`), naming the host (`check()`, which the
learner's loop calls between steps).

Every read is a round trip to the coordination service (in process 0), which costs CPU on both
ends: an idle inbox backs off from `poll_s` to `max_poll_s` between reads, heartbeats are read
twice per `HEARTBEAT_S`, and a sampler host reads a learner host's admission state at most every
`STATE_MAX_AGE_S` (a state that old only admits less: its `freed` only grows).
"""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import Sequence

from tunixlike.hosts import kv, wire
from tunixlike.rl.queue import RolloutQueue
from tunixlike.rollout import RolloutGroup

PREFIX = "tunixlike/rollouts"


def _state_key(learner: int) -> str:
  return f"{PREFIX}/state/{learner}"


def _alive_key(sampler: int) -> str:
  return f"{PREFIX}/alive/{sampler}"


HEARTBEAT_S = 1.0
STATE_MAX_AGE_S = 0.05


class LearnerInbox:
  """Learner host side: sampler hosts' admissions and groups into `queue`; the admission state out."""

  def __init__(self, queue: RolloutQueue, learner: int, *, sampler_hosts: Sequence[int], silence_timeout_s: float,
               poll_s: float = 0.005, max_poll_s: float = 0.04):
    self.queue, self.learner, self.poll_s, self.max_poll_s = queue, learner, poll_s, max_poll_s
    self.silence_timeout_s = silence_timeout_s
    self._heard: dict[int, tuple[bytes | None, float]] = {h: (None, time.monotonic()) for h in sampler_hosts}
    self._heartbeats_read = float("-inf")
    self.first_ticket = queue.admitted  # a resumed run: the groups before it are trained or dropped
    self.received = 0
    self._stop = threading.Event()
    self._errors: list[BaseException] = []
    self._published = None
    self._thread = threading.Thread(target=self._loop, daemon=True, name=f"inbox-{learner}")

  def start(self) -> "LearnerInbox":
    self.publish()
    self._thread.start()
    return self

  def publish(self, *, stop: bool = False) -> None:
    state = {"freed": self.queue.admissions_freed(), "first": self.first_ticket, "stop": stop}
    if state != self._published:
      kv.put(_state_key(self.learner), json.dumps(state).encode())
      self._published = state

  def poll(self) -> int:
    """Moves what has arrived into the queue; returns the number of groups."""
    for _, value in kv.take_all(f"{PREFIX}/started/{self.learner}/"):
      self.queue.admitted_elsewhere(int(value))
    n = 0
    for _, value in kv.take_all(f"{PREFIX}/groups/{self.learner}/"):
      self.queue.put(wire.decode(value))
      n += 1
    self.received += n
    self.publish()
    self._check_heartbeats()
    return n

  def _check_heartbeats(self) -> None:
    now = time.monotonic()
    if now - self._heartbeats_read < HEARTBEAT_S / 2:
      return
    self._heartbeats_read = now
    for host, (beat, since) in self._heard.items():
      current = kv.try_get(_alive_key(host))  # None: no heartbeat yet (or a refused one, which changes nothing)
      if current is not None and current != beat:
        self._heard[host] = (current, now)
      elif now - since > self.silence_timeout_s:
        raise kv.HostTimeout(f"sampler host {host} sent nothing for more than {self.silence_timeout_s:g} s "
                             "(silence_timeout_s): it died or hangs", host)

  def _loop(self):
    wait = self.poll_s
    while not self._stop.is_set():
      try:
        if self.poll():
          wait = self.poll_s
        else:  # nothing came: wait longer before the next read, up to max_poll_s
          self._stop.wait(wait)
          wait = min(2 * wait, self.max_poll_s)
      except BaseException as e:  # noqa: BLE001 - surfaced by check()
        self._errors.append(e)
        self.queue.stop_event.set()
        return

  def check(self) -> None:
    if self._errors:
      raise self._errors[0]

  @property
  def error(self) -> BaseException | None:
    """What stopped the inbox (a silent sampler host), or None."""
    return self._errors[0] if self._errors else None

  def close(self) -> None:
    """Tells the sampler hosts the run is over and stops the thread."""
    self._stop.set()
    self._thread.join(timeout=10)
    self.publish(stop=True)


class RemoteAdmission:
  """Sampler host side: `try_admit(version)` by the learner hosts' rule, `send(group)` to the learner
  host it was admitted for. `index` / `num_samplers`: this host among the sampler hosts."""

  def __init__(self, index: int, num_samplers: int, learner_hosts, *, batch_groups: int, max_staleness: int,
               host: int, timeout_s: float):
    self.index, self.num_samplers, self.learners = index, num_samplers, list(learner_hosts)
    self.batch_groups, self.max_staleness, self.host, self.timeout_s = batch_groups, max_staleness, host, timeout_s
    self._tickets: dict[int, int] = {}
    self._reserved: dict[int, collections.deque] = collections.defaultdict(collections.deque)
    self._next = 0
    self._seq = 0
    self.stopped = False  # every learner host has ended its run
    self._finished: set[int] = set()
    self._lock = threading.Lock()
    self._beats, self._last_beat = 0, 0.0
    self._states: dict[int, tuple[dict, float]] = {}  # learner -> (its admission state, when read)

  def heartbeat(self) -> None:
    """Tells the learner hosts this host is alive (`try_admit` calls it; at most once a second)."""
    now = time.monotonic()
    if now - self._last_beat >= HEARTBEAT_S:
      self._beats += 1
      kv.put(_alive_key(self.host), str(self._beats).encode())
      self._last_beat = now

  def _state(self, learner: int) -> dict:
    """Learner host `learner`'s admission state, read at most every STATE_MAX_AGE_S (under the lock)."""
    state, read = self._states.get(learner, (None, float("-inf")))
    if time.monotonic() - read >= STATE_MAX_AGE_S:
      state = json.loads(kv.get(_state_key(learner), timeout_s=self.timeout_s, host=learner, once=False,
                                what=f"sampler host {self.host}: the learner's admission state"))
      self._states[learner] = state, time.monotonic()
    return state

  def poll_stopped(self) -> bool:
    """Whether every learner host has ended its run (read now, not only when admitting)."""
    with self._lock:
      for learner in self.learners:
        if learner not in self._finished and self._state(learner)["stop"]:
          self._finished.add(learner)
      self.stopped = len(self._finished) == len(self.learners)
      return self.stopped

  def try_admit(self, version: int) -> bool:
    """Admits one group at sampler weights `version` for the next learner host that allows it."""
    self.heartbeat()
    with self._lock:
      for k in range(len(self.learners)):
        learner = self.learners[(self._next + k) % len(self.learners)]
        state = self._state(learner)
        if state["stop"]:  # that learner host's run is over; the others may still need groups
          self._finished.add(learner)
          self.stopped = len(self._finished) == len(self.learners)
          continue
        if learner not in self._tickets:  # this host's first ticket of that learner's run
          first = state["first"]
          self._tickets[learner] = first + (self.index - first) % self.num_samplers
        ticket = self._tickets[learner]
        if ticket < (self.max_staleness + version + 1) * self.batch_groups + state["freed"]:
          self._tickets[learner] += self.num_samplers
          self._reserved[version].append(learner)
          kv.put(f"{PREFIX}/started/{learner}/{self.host}/{self._seq}", str(version).encode())
          self._seq += 1
          self._next = (self._next + k + 1) % len(self.learners)
          return True
      return False

  def send(self, group: RolloutGroup) -> int:
    """The scored group to the learner host it was admitted for; returns that host."""
    with self._lock:
      reserved = self._reserved[group.admitted_version]
      if not reserved:
        raise RuntimeError(f"group {group.prompt_id!r} was not admitted at version {group.admitted_version}")
      learner = reserved.popleft()
      key = f"{PREFIX}/groups/{learner}/{self.host}/{self._seq}"
      self._seq += 1
    kv.put(key, wire.encode(group))
    return learner
