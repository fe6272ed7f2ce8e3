"""Multi-agent episodes over one rollout driver per policy: no turn waits for another episode's.

    records -> EpisodeCoordinator -> Turn requests -> RolloutDriver of that turn's policy (own thread,
               ^     (env on workers)                 own engine, params and version)
               +------------- finished turn group <-----------+
    finished episode (every turn of every agent, rewards filled) -> sink

Each policy samples on its own `RolloutDriver` (continuous batching over its own decode slots), so a
turn holds a slot only while it decodes: an episode waiting on the env or on another policy's turn
holds none, and one slow turn delays only its own episode (the straggler control of episode-level
async). Every token records the version of the policy that produced it; `update_params(policy, ...)`
swaps one policy's weights between two of its generate calls (soft pause), so a partial episode
continues with the new weights and its earlier tokens keep their versions.

Admission is per episode (`may_start_episode(versions)`, asked with every policy's sampler version,
e.g. `EpisodeQueue.try_admit`); an episode leaves as
an `Episode` with one `RolloutGroup` per turn taken (prompt, samples, env rewards), the unit the
episode-level buffer admits, bounds and trains. An env that raises or times out ends only its own
episode (finish "aborted", `failure_reward` for every sample); a turn too long for its policy's
context, or more than `max_turns` turns, ends it as "length" (counted). An env asking for a policy
the run does not have, or for a group size its sampler does not make, stops the run with an error
naming it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from tunixlike.multi_agent.env import Turn, check_rewards, check_turn
from tunixlike.rewards.envs.runner import EnvRunner
from tunixlike.rollout import RolloutGroup
from tunixlike.sampler.driver import PromptRequest, RolloutDriver

_log = logging.getLogger(__name__)

EPISODE_FINISH = ("done", "length", "aborted")
# The coordinator's loop sleeps this long when no env call, turn or episode moved: short next to a turn's
# decode, so that a finished turn's next one starts at once (the drivers' own loops sleep sampler.idle_wait_s).
_IDLE_WAIT_S = 0.002


@dataclasses.dataclass
class Episode:
  """A finished episode: its turns in order, each a group of one policy's samples with rewards."""

  seq: int  # start order
  record: dict[str, Any]
  turns: list[Turn]
  groups: list[RolloutGroup]  # groups[i] holds the samples of turns[i]; rewards filled
  finish_reason: str  # one of EPISODE_FINISH
  start_versions: dict[str, int]  # each policy's sampler version when the episode was admitted
  admitted_at: float = 0.0  # time.monotonic() at admission
  wall_s: float = 0.0  # from admission until it left for the sink

  @property
  def admitted_version(self) -> dict[str, int]:
    return self.start_versions

  def groups_of(self, policy: str) -> list[RolloutGroup]:
    return [g for t, g in zip(self.turns, self.groups) if t.agent == policy]

  def min_version(self, policy: str) -> int | None:
    """Version of the policy's oldest token in the episode (None: it took no turn)."""
    versions = [g.min_version for g in self.groups_of(policy) if g.num_tokens]
    return min(versions) if versions else None

  @property
  def num_tokens(self) -> int:
    return sum(g.num_tokens for g in self.groups)


@dataclasses.dataclass
class CoordinatorStats:
  episodes: int = 0
  turns: int = 0
  aborted: int = 0  # env raised, timed out or returned something malformed
  truncated: int = 0  # a turn too long for its context, or more than max_turns turns
  env_timeouts: int = 0


@dataclasses.dataclass
class _Live:
  seq: int
  record: dict[str, Any]
  env: Any
  start_versions: dict[str, int]
  started: float
  finish: str = "done"
  turns: list[Turn] = dataclasses.field(default_factory=list)
  groups: list[RolloutGroup] = dataclasses.field(default_factory=list)


class _TurnSource:
  """A policy driver's prompt source: turn requests queued by the coordinator (None = none yet)."""

  def __init__(self):
    self._queue: collections.deque[PromptRequest] = collections.deque()

  def put(self, request: PromptRequest) -> None:
    self._queue.append(request)

  def __iter__(self):
    return self

  def __next__(self) -> PromptRequest | None:
    try:
      return self._queue.popleft()
    except IndexError:
      return None


class EpisodeCoordinator:
  """Runs episodes of a `MultiAgentEnv` over `drivers` (policy name -> a RolloutDriver factory)."""

  def __init__(self, make_driver: dict[str, Callable[[Iterable, Callable], RolloutDriver]], *,
               make_env: Callable[[], Any], records: Iterable[dict[str, Any]],
               encode: Callable[[str], Sequence[int]], detokenize: Callable[[Sequence[int]], str],
               sink: Callable[[Episode], None], max_episodes_in_flight: int = 16,
               max_turns: int, step_timeout_s: float, wait_timeout_s: float,
               may_start_episode: Callable[[dict[str, int]], bool] = lambda versions: True,
               failure_reward: float = 0.0, env_workers: int = 8, lockstep: bool = False, emit_groups_of: int = 1,
               first_seq: int = 0):
    """`make_driver[p](source, sink)` builds policy p's driver over that prompt source and group sink.
    `encode(text)` gives a turn prompt's ids (with BOS if the model expects one). `max_turns`,
    `step_timeout_s` and `wait_timeout_s` (how long `close` waits for each driver's thread): a run passes
    `rl.env_max_turns`, `rl.env_step_timeout_s` and `rl.wait_timeout_s`.

    Two baselines the benchmark measures episode-level async against: `lockstep=True` holds every
    turn until all live episodes have their next turn ready (each turn waits for its batch: the
    synchronous loop); `emit_groups_of=n` sends finished episodes on only in whole groups of n
    consecutive ones (each group waits for its slowest episode: group-level async). `first_seq`: the start
    order of the first episode (a resumed run's, so that its episodes' sampling noise is new)."""
    if not make_driver:
      raise ValueError("EpisodeCoordinator needs at least one policy")
    self._sources = {p: _TurnSource() for p in make_driver}
    self.drivers = {p: make(self._sources[p], self._turn_done) for p, make in make_driver.items()}
    self.policies = tuple(self.drivers)
    self._samples = {p: d.config.group_size for p, d in self.drivers.items()}
    self._make_env, self._records, self._encode, self._detokenize = make_env, iter(records), encode, detokenize
    self._sink, self._may_start = sink, may_start_episode
    self._max_in_flight, self._max_turns, self._failure_reward = max_episodes_in_flight, max_turns, failure_reward
    self._wait_timeout_s = wait_timeout_s
    self._runner = EnvRunner(num_workers=env_workers, timeout_s=step_timeout_s, name="multi-agent-env")
    self._tickets: dict[int, tuple[_Live, str]] = {}  # env call -> (episode, "turn" | "rewards")
    self._live: dict[int, _Live] = {}
    self._finished_turns: collections.deque[RolloutGroup] = collections.deque()  # from driver threads
    self._lockstep, self._emit_groups_of = lockstep, emit_groups_of
    self._held: list[tuple[str, PromptRequest]] = []  # lockstep: turns waiting for the others
    self._turns_out = 0  # turn requests given to drivers and not yet returned
    self._finished: dict[int, Episode] = {}  # finished, waiting for the rest of their group (emit_groups_of)
    self._next_seq = first_seq
    self._exhausted = False
    self._stop = threading.Event()
    self.stats = CoordinatorStats()

  # ------------------------------------------------------------------ control

  def update_params(self, policy: str, params, version: int) -> None:
    """Policy `policy`'s new weights, swapped in between two of its generate calls (soft pause)."""
    self.drivers[policy].update_params(params, version)

  def versions(self) -> dict[str, int]:
    return {p: d.version for p, d in self.drivers.items()}

  @property
  def in_flight(self) -> int:
    return len(self._live)

  @property
  def next_seq(self) -> int:
    """The start order the next episode gets (a checkpoint keeps it: `first_seq` of the resumed run)."""
    return self._next_seq

  def run(self, max_episodes: int | None = None, max_wall_s: float = 3600.0) -> CoordinatorStats:
    """Starts the policy drivers, runs episodes until the records are exhausted (or `max_episodes`
    finished, or `stop`), then stops the drivers. Errors of any thread are raised here."""
    for d in self.drivers.values():
      d.start()
    t_end = time.monotonic() + max_wall_s
    try:
      while not self._stop.is_set():
        if time.monotonic() > t_end:
          raise TimeoutError(f"multi-agent episodes exceeded max_wall_s={max_wall_s}")
        for d in self.drivers.values():
          d.check()
        worked = self.step()
        if max_episodes is not None and self.stats.episodes >= max_episodes:
          break
        if self._exhausted and not self._live:
          break
        if not worked:
          self._stop.wait(_IDLE_WAIT_S)
    finally:
      self.close()
    return self.stats

  def advance(self) -> bool:
    """One round with no driver threads (the synchronous loop): each policy driver's step, then
    the coordinator's. False if nothing ran."""
    worked = False
    for d in self.drivers.values():
      worked = d.step() or worked
    return self.step() or worked

  def close(self) -> None:
    """Stops the drivers' threads (if started) and the env workers."""
    try:
      for d in self.drivers.values():
        d.stop(self._wait_timeout_s)
    finally:
      self._runner.close()

  def stop(self) -> None:
    self._stop.set()

  # ------------------------------------------------------------------ one step

  def step(self) -> bool:
    worked = self._start_episodes()
    while self._finished_turns:
      self._after_turn(self._finished_turns.popleft())
      worked = True
    for ticket, value, error in self._runner.poll():
      live, what = self._tickets.pop(ticket)
      worked = True
      if error is not None:
        self._fail(live, error)
      elif what == "turn":
        self._next_turn(live, value)
      else:
        self._finish(live, value)
    if self._held and not self._tickets and not self._turns_out:  # lockstep: every live episode is ready
      for agent, request in self._held:
        self._sources[agent].put(request)
      self._turns_out += len(self._held)
      self._held = []
    return worked

  def _start_episodes(self) -> bool:
    started = False
    while not self._exhausted and len(self._live) < self._max_in_flight and self._may_start(self.versions()):
      try:
        record = next(self._records)
      except StopIteration:
        self._exhausted = True
        break
      live = _Live(seq=self._next_seq, record=dict(record), env=self._make_env(), start_versions=self.versions(),
                   started=time.monotonic())
      self._next_seq += 1
      self._live[live.seq] = live
      self._tickets[self._runner.submit(live.env.reset, dict(record))] = (live, "turn")
      started = True
    return started

  def _next_turn(self, live: _Live, turn) -> None:
    """The env's answer to reset / step: the next turn goes to its policy's driver, or the episode ends."""
    if turn is None:
      self._ask_rewards(live, "done")
      return
    turn = check_turn(turn, self.policies, self._samples)  # a config error: stops the run
    ids = np.asarray(self._encode(turn.prompt), np.int32)
    driver = self.drivers[turn.agent]
    if len(live.turns) >= self._max_turns or len(ids) > driver.engine.max_prefill_length:
      self.stats.truncated += 1
      self._ask_rewards(live, "length")
      return
    live.turns.append(turn)
    index = len(live.turns) - 1
    request = PromptRequest(prompt_id=(live.seq, index), token_ids=ids, prompt_text=turn.prompt,
                            max_new_tokens=self._limit(turn, driver), noise_id=live.seq * self._max_turns + index)
    if self._lockstep:
      self._held.append((turn.agent, request))
    else:
      self._sources[turn.agent].put(request)
      self._turns_out += 1

  @staticmethod
  def _limit(turn: Turn, driver: RolloutDriver) -> int | None:
    """The turn's token limit, capped by its policy's sampler.max_new_tokens."""
    return None if turn.max_new_tokens is None else min(turn.max_new_tokens, driver.config.max_new_tokens)

  def _turn_done(self, group: RolloutGroup) -> None:
    """A policy driver's sink (its thread): the coordinator's step takes it from here."""
    self._finished_turns.append(group)

  def _after_turn(self, group: RolloutGroup) -> None:
    seq, index = group.prompt_id
    self._turns_out -= 1
    live = self._live[seq]
    live.groups.append(group)
    assert len(live.groups) == index + 1, (seq, index, len(live.groups))
    self.stats.turns += 1
    texts = [c.text if c.text is not None else self._detokenize(c.token_ids) for c in group.completions]
    self._tickets[self._runner.submit(live.env.step, texts)] = (live, "turn")

  def _ask_rewards(self, live: _Live, reason: str) -> None:
    live.finish = reason
    self._tickets[self._runner.submit(live.env.rewards)] = (live, "rewards")

  def _fail(self, live: _Live, error: BaseException) -> None:
    if isinstance(error, TimeoutError):
      self.stats.env_timeouts += 1
    _log.warning("multi-agent episode %d aborted: %r", live.seq, error)
    live.finish = "aborted"
    live.turns = live.turns[:len(live.groups)]  # a turn asked for but not sampled is not kept
    self._finish(live, [[self._failure_reward] * len(g.completions) for g in live.groups])

  def _finish(self, live: _Live, rewards) -> None:
    if live.finish != "aborted":
      try:
        rewards = check_rewards(rewards, live.turns)
      except (TypeError, ValueError) as e:
        self._fail(live, e)
        return
    self.stats.aborted += live.finish == "aborted"
    for group, r in zip(live.groups, rewards):
      group.rewards = np.asarray(r, np.float32)
    del self._live[live.seq]
    self.stats.episodes += 1
    self._finished[live.seq] = Episode(seq=live.seq, record=live.record, turns=list(live.turns),
                                       groups=list(live.groups), finish_reason=live.finish,
                                       start_versions=live.start_versions, admitted_at=live.started)
    first = live.seq - live.seq % self._emit_groups_of
    group = range(first, first + self._emit_groups_of)
    if all(s in self._finished for s in group):
      now = time.monotonic()
      for s in group:
        episode = self._finished.pop(s)
        episode.wall_s = now - episode.admitted_at
        self._sink(episode)
