"""The rollout driver: keeps every decode slot busy and emits finished groups.

A loop over the engine (`engine_api.EngineAPI`), the same for every kind of rollout: swap weights if
asked, let the episode strategy bring in outside work and start groups (`admission.Admission`, the one
admission loop), reserve the next call's blocks (a paged cache may preempt the youngest sequences,
which go back to the strategy to resume), refill the free slots, generate `steps_per_call` tokens and
collect them per slot (`slots.Slots`). What a group is and what a finished turn does is the episode
strategy's (`strategy.Episodes`): `single_turn.SingleTurn` (the default: G samples per prompt, a
`RolloutGroup` to the sink the moment its last sample ends), `episodes.EnvEpisodes` (environment
episodes) and `agents.driver.AgentEpisodes` (the user's agent code, served over HTTP).

It runs in its own thread beside the learner (`start` / `stop`) and takes, from other threads:
  * `update_params(params, version)`: soft pause, the swap happens between two generate calls;
    in-flight sequences keep their tokens and every token records the version that produced it;
    `drain=True` instead finishes in-flight sequences first, then swaps and resumes;
  * `may_start_group(version)`: admission control (staleness bound), asked before each new group
    with the version of the weights it would be sampled with (e.g. `RolloutQueue.try_admit`).
With `next_round` (rl.deterministic) no weights come from other threads: the driver works in rounds,
and only when it has nothing left to do (every admitted group emitted) does it ask `next_round`
for the next round's weights and version (the same version: more admissions, no swap), so every
swap lands at a point its own progress defines, never where thread timing puts it.
Every wait is bounded; an error in the loop is kept and re-raised by `join` / `check`.

Features that watch what is decoded compose as `recorders` (a `Recorder` each, called on the
sampler thread), e.g. `process_steps.ProcessRewardRecorder`, which hands step prefixes to a process
reward model while decoding goes on. Multi-turn episodes are `episodes.EpisodeDriver`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import numpy as np

from tunixlike import device_turns, trace as trace_lib
from tunixlike.rollout import RolloutGroup
from tunixlike.sampler import drafts as drafts_lib
from tunixlike.sampler.admission import Admission
from tunixlike.sampler.driver_api import (DriverError, DriverStats, DriverTimeout, InFlightGroup, PromptRequest,
                                          Recorder)
from tunixlike.sampler.engine_api import EngineAPI
from tunixlike.sampler.noise import NoiseKeys
from tunixlike.sampler.samples import Sample
from tunixlike.sampler.single_turn import SingleTurn
from tunixlike.sampler.slots import Slots
from tunixlike.sampler.strategy import Episodes

__all__ = ["DriverError", "DriverStats", "DriverTimeout", "InFlightGroup", "PromptRequest", "Recorder",
           "RolloutDriver"]


class RolloutDriver:
  """Continuous batching over an engine, one episode strategy; see the module docstring."""

  # Colocated layout: the runtime sets `device_turns.DeviceTurns`, so that each step's device work
  # takes its turn with the learner's.
  turns = device_turns.NO_TURNS

  def __init__(self, engine: EngineAPI, params, *, source: Iterable[PromptRequest | None],
               sink: Callable[[RolloutGroup], None] | Any, version: int = 0,
               may_start_group: Callable[[int], bool] | None = None,
               detokenize: Callable[[Sequence[int]], str] | None = None,
               static_batching: bool = False, tracer: trace_lib.Tracer = trace_lib.NULL_TRACER,
               recorders: Sequence[Recorder] = (), first_seq: int = 0,
               next_round: Callable[[float], tuple[Any, int] | None] | None = None,
               on_step: Callable[[int | None, int, bool], None] | None = None,
               resume: Sequence[InFlightGroup] = (), drafter: drafts_lib.Drafter | None = None,
               episodes: Episodes | None = None):
    """`source` yields PromptRequests (None = nothing available yet, try later; exhaustion ends it).

    `sink` is a callable or a queue with put(item, timeout). `static_batching=True` waits for all
    slots to empty before refilling (the baseline continuous batching is measured against).
    `recorders` watch every token, completion and group (see `Recorder`). `first_seq`: the start
    order of the first group, which seeds its noise (a resumed deterministic run continues it).
    `next_round(timeout_s)`: rounds (see the module docstring); it returns (params or None, version)
    or None when nothing came within the timeout. `on_step(swapped_to, admitted, generated)` after
    each step that did something: the version it swapped to (or None), the groups it admitted and
    whether it ran a generate call; with the prompts, what a step does follows from these three
    (`rl.schedule` records them to replay a run). `resume`: a checkpoint's `in_flight()` groups,
    continued before any new group is admitted (`first_seq` must come after their start orders).
    `drafter`: sampler.speculative's (default: a new one from the config).
    `episodes`: the episode strategy (default: single-turn groups, `SingleTurn`, with `recorders`
    and `static_batching`, which configure only that default).
    """
    cfg = engine.config
    if cfg.stop_strings and detokenize is None:
      raise ValueError(f"sampler.stop_strings={cfg.stop_strings} needs a detokenize function")
    if episodes is not None and (recorders or static_batching):
      raise ValueError("recorders and static_batching configure the default SingleTurn strategy: pass them to "
                       f"the strategy given as episodes ({type(episodes).__name__})")
    self.engine, self.config = engine, cfg
    self._params, self._version = params, int(version)
    self._sink = sink
    self.detokenize = detokenize
    # sampler.speculative: drafts from the groups' texts; it hears of ended completions as a recorder.
    self.drafter = (drafter or drafts_lib.Drafter.from_config(cfg)) if cfg.speculative else None
    self.tracer = tracer  # spans of prefill / generate on the sampler thread's track
    self.episodes = episodes or SingleTurn(tuple(recorders) + ((self.drafter,) if self.drafter else ()),
                                           static_batching=static_batching)
    self.slots = Slots(engine, self._version)
    self.keys = NoiseKeys(cfg.seed, cfg.group_size, self.episodes.key_turns)
    self._next_round = next_round
    self._on_step = on_step
    self._lock = threading.Lock()
    self._next_params: tuple[Any, int, bool] | None = None
    self._hold_after_swap = False
    self._held = threading.Event()  # set from a hold's swap until `release`: nothing is admitted
    # Held by each step from its device turn to its collected tokens: `in_flight` (another thread's)
    # sees the host state between two steps, every token decoded so far collected.
    self._host_lock = threading.Lock()
    self._stop_event = threading.Event()
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self.stats = self.episodes.bind(self)  # last but admission: the agents' server starts here
    self.admission = Admission(engine, source, stats=self.stats, may_start=may_start_group,
                               closed=self._admission_closed, first_seq=first_seq)
    if resume:
      self.episodes.resume(resume)

  def in_flight(self, timeout_s: float) -> list[InFlightGroup] | None:
    """Every group admitted and not yet emitted, in start order, as it stands between two steps
    (any thread; a checkpoint keeps them). Tokens the device decoded are all collected by then.
    None when the current step did not end within `timeout_s`. Empty for strategies whose groups
    are started again on resume (`continues_in_flight`)."""
    if not self.continues_in_flight:
      return []
    if not self._host_lock.acquire(timeout=timeout_s):
      return None
    try:
      return self.episodes.in_flight()
    finally:
      self._host_lock.release()

  @property
  def continues_in_flight(self) -> bool:
    """Whether a checkpoint continues its groups in flight (multi-turn episodes and agents hold state
    outside the driver, an environment or a conversation: their groups are started again)."""
    return self.episodes.continues_in_flight

  @property
  def params(self):
    """The weights decoding now (the driver thread's)."""
    return self._params

  @property
  def next_seq(self) -> int:
    """The start order the next admitted group gets (a resumed run's `first_seq`)."""
    return self.admission.next_seq

  # ------------------------------------------------------------------ control (any thread)

  def update_params(self, params, version: int, *, drain: bool = False, hold: bool = False) -> None:
    """Swaps weights before the next generate call (drain=True: once in-flight work finished;
    hold=True: drains, then admits nothing until `release()`, so that another thread sees it idle
    with these weights: `wait_held`)."""
    with self._lock:
      self._next_params = (params, int(version), bool(drain or hold))
      self._hold_after_swap = hold

  def wait_held(self, version: int, timeout_s: float) -> bool:
    """Waits (bounded) until the driver swapped to `version` with hold=True; it is idle from then on.
    False at the timeout or when the driver failed (`check` says why)."""
    deadline = time.monotonic() + timeout_s
    while not self._held.wait(min(0.1, max(deadline - time.monotonic(), 0))):
      if self._error is not None or time.monotonic() >= deadline:
        return False
    return self._version == version

  def release(self) -> None:
    """Ends a hold: admission goes on."""
    with self._lock:
      self._held.clear()

  @property
  def version(self) -> int:
    return self._version

  @property
  def is_idle(self) -> bool:
    """No sequence decoding and no admitted group waiting for slots."""
    return self.episodes.is_idle and self.slots.empty

  @property
  def exhausted(self) -> bool:
    return self.admission.exhausted

  def unfinished_requests(self) -> list[PromptRequest]:
    """Requests admitted but not emitted (to re-queue on resume after `stop`)."""
    return [g.request for g in self.admission.groups()]

  # ------------------------------------------------------------------ thread

  def start(self) -> None:
    if self._thread is not None:
      raise DriverError("RolloutDriver.start called twice")
    self._thread = threading.Thread(target=self._thread_main, name="rollout-driver", daemon=True)
    self._thread.start()

  def stop(self, timeout_s: float) -> None:
    """Asks the loop to stop after its current step and waits for it (bounded: a run's
    rl.wait_timeout_s); the episode strategy then ends its outside work."""
    try:
      self._stop_event.set()
      self.join(timeout_s)
    finally:
      self.episodes.close()

  def join(self, timeout_s: float) -> None:
    if self._thread is not None:
      self._thread.join(timeout_s)
      if self._thread.is_alive():
        raise DriverError(f"rollout driver did not stop within {timeout_s} s")
    self.check()

  def check(self) -> None:
    """Re-raises an error from the driver thread (call it from the supervising thread)."""
    if self._error is not None:
      raise DriverError(f"rollout driver failed: {self._error!r}") from self._error

  @property
  def running(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def _thread_main(self) -> None:
    try:
      self.run()
    except BaseException as e:  # handed to the supervisor via check()
      self._error = e

  def run(self, max_wall_s: float | None = None) -> DriverStats:
    """Runs until the source is exhausted and every group is emitted, or `stop` is called."""
    t_end = None if max_wall_s is None else time.monotonic() + max_wall_s
    while not self._stop_event.is_set():
      if t_end is not None and time.monotonic() > t_end:
        raise DriverTimeout(f"rollout driver exceeded max_wall_s={max_wall_s}")
      if self.step():
        continue
      if self.admission.exhausted and self.is_idle and self._next_params is None:
        break
      if self._next_round is not None and self.is_idle:
        self._start_round()
        continue
      self._stop_event.wait(self.config.idle_wait_s)
    return self.stats


  # ------------------------------------------------------------------ one step

  def step(self) -> bool:
    """Swap params if asked, refill slots, run one generate call. Returns False if nothing ran."""
    with contextlib.ExitStack() as held:
      return self._step(held)

  def _step(self, held: contextlib.ExitStack) -> bool:
    seq_before = self.admission.next_seq
    with self.turns.sampler():  # the device work of one step; collecting its tokens is host work
      held.enter_context(self._host_lock)  # taken inside the turn: a learner in its turn never waits on it
      swapped = self._maybe_swap_params()
      self.episodes.prepare()
      for info in self.slots.reserve(self.stats):
        self.episodes.requeue(info)
      self.episodes.refill(self.slots.free())
      admitted = self.admission.next_seq - seq_before
      if self.slots.empty:
        if self._on_step is not None and (swapped is not None or admitted):
          self._on_step(swapped, admitted, False)
        return False
      self.slots.compact(self.stats)
      drafted = None
      if self.drafter is not None:
        width = self.engine.decode_width(self.slots.state)
        if self.drafter.may_pay(sum(isinstance(s, Sample) for s in self.slots), width):
          drafted = self.drafter.drafts(self._draft_requests(), len(self.slots), width)
      t0 = time.perf_counter()
      with self.tracer.span("generate", cat="sampler", version=self._version, verify=drafted is not None):
        if drafted is None:
          self.slots.state, result = self.engine.generate(self._params, self.slots.state)
          host = jax.device_get(result)
        else:
          self.slots.state, host = self.engine.verify(self._params, self.slots.state, drafted[0])
          if host.valid_ks.shape[0] == self.config.steps_per_call:  # a plain call's rows: the paged pool
            drafted = None  # had no blocks for the drafts
            self.stats.verify_fallbacks += 1
      self.stats.busy_time_s += time.perf_counter() - t0
      if self.drafter is not None:
        self.drafter.timed(drafted is not None, width, time.perf_counter() - t0)
    self.stats.generate_calls += 1
    self._count_steps(host, drafted)
    if self.drafter is not None:
      self.stats.draft_s = self.drafter.host_s
    self.slots.collect(host, self.episodes)
    if self._on_step is not None:
      self._on_step(swapped, self.admission.next_seq - seq_before, True)
    return True

  def _draft_requests(self) -> Iterator[drafts_lib.Live]:
    """The live single-turn sequences, for the drafter (other slot kinds decode without drafts)."""
    for s, info in enumerate(self.slots):
      if isinstance(info, Sample):
        yield drafts_lib.Live(s, info.group.seq, info.index, info.group.prompt_ids, info.tokens,
                              info.max_new - len(info.tokens) - 1)

  def _count_steps(self, host, drafted) -> None:
    """Slot steps of a generate call (a verify call's first rows are its verify forwards, draft_tokens
    + 1 positions each), and how each draft fared (the adaptive switch hears of it before the tokens are
    collected)."""
    valid_ks, cfg = host.valid_ks, self.config
    forwards = drafts_lib.step_rows(valid_ks.shape[0], cfg.steps_per_call, cfg.draft_tokens)
    self.stats.total_slot_steps += len(forwards) * valid_ks.shape[1]
    self.stats.live_slot_steps += sum(int(valid_ks[rows].any(0).sum()) for rows in forwards)
    self.stats.decoded_tokens += int(valid_ks.sum())
    if drafted is None:
      return
    self.stats.verify_calls += 1
    tokens, lengths = drafted
    for s in np.flatnonzero(lengths):
      info = self.slots[s]
      n, accepted = drafts_lib.verified(host.tokens_ks[:, s], valid_ks[:, s], tokens[s], cfg.draft_tokens,
                                        sum(r.stop - r.start > 1 for r in forwards))
      self.stats.drafted_tokens += n
      self.stats.accepted_tokens += accepted
      self.drafter.observe(info.group.seq, info.index, n, accepted, len(info.tokens) + int(valid_ks[:, s].sum()))


  def _start_round(self) -> None:
    """Rounds: the next round's weights (None: the same ones, with more admissions) once they come."""
    handover = self._next_round(self.config.idle_wait_s)
    if handover is not None and handover[0] is not None:
      with self._lock:
        self._next_params = (*handover, False)

  def _maybe_swap_params(self) -> int | None:
    """Swaps in the pending weights if it may now; returns their version (None: no swap)."""
    with self._lock:
      pending = self._next_params
      if pending is None:
        return None
      params, version, drain = pending
      if drain and not self.is_idle:
        return None  # admission starts nothing new while a drain swap waits
      self._next_params = None
      hold, self._hold_after_swap = self._hold_after_swap, False
    self._params, self._version = params, version
    self.slots.state = self.engine.set_version(self.slots.state, version)
    self.stats.param_swaps += 1
    if hold:
      self._held.set()
    return version


  def _admission_closed(self) -> bool:
    with self._lock:
      return self._held.is_set() or (self._next_params is not None and self._next_params[2])

  def emit(self, group: RolloutGroup) -> None:
    """Hands a finished group to the sink (a bounded queue: waits, checking for stop)."""
    put = getattr(self._sink, "put", None)
    if put is None:
      self._sink(group)
      self.stats.groups_emitted += 1
      return
    while True:  # a bounded queue applies back-pressure; keep checking for stop
      try:
        put(group, timeout=max(self.config.idle_wait_s, 0.05))
        self.stats.groups_emitted += 1
        return
      except queue.Full:
        if self._stop_event.is_set():  # the run is over: nothing will take it
          return
