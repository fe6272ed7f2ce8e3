"""The rollout driver: keeps every decode slot busy and emits finished GRPO groups.

A loop over the engine: refill free slots from the prompt source (G slots per prompt; the groups
admitted at one refill are prefilled in one call and inserted in one more, `Engine.prefill_many` /
`insert_many`), generate `steps_per_call` tokens, collect the tokens per slot, end a completion at an EOS
id, a stop string or its length limit, refill the slot at once, and hand a `RolloutGroup` to the
sink the moment its last completion ends.

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

import collections
import contextlib
import dataclasses
import functools
import itertools
import queue
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tunixlike import device_turns, trace as trace_lib
from tunixlike.rollout import Completion, RolloutGroup
from tunixlike.sampler import drafts as drafts_lib
from tunixlike.sampler.engine import Engine, PromptError


@dataclasses.dataclass
class PromptRequest:
  """One prompt to sample G completions of."""

  prompt_id: Any
  token_ids: np.ndarray  # int [P]
  columns: dict[str, Any] = dataclasses.field(default_factory=dict)
  prompt_text: str | None = None
  max_new_tokens: int | None = None  # None = sampler.max_new_tokens
  # Seeds the group's sampling noise instead of its start order (a caller whose requests may
  # arrive in any order, e.g. multi-agent turns, keeps its samples reproducible this way).
  noise_id: int | None = None


@dataclasses.dataclass
class _Group:
  seq: int  # start order: seeds the group's sampling noise
  request: PromptRequest
  prompt_ids: np.ndarray  # after truncation
  completions: list[Completion | None]
  started: int = 0  # samples inserted so far
  keys: np.ndarray | None = None  # [group_size, 2] noise keys of its samples (made when first inserted)
  version: int = 0  # the sampler's version when it was admitted
  resumed_at: int | None = None  # a group continued from a checkpoint: the version the driver resumed at


@dataclasses.dataclass
class _Slot:
  group: _Group
  index: int  # sample index within the group
  max_new: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  masks: list[np.ndarray] = dataclasses.field(default_factory=list)
  # Keep Routing: experts of each token's forward ([L, k] per token) and the prefill's for the prompt.
  routing: list[np.ndarray] = dataclasses.field(default_factory=list)
  # The prefix this slot was filled from: its prefill's routing (device int32 [rows, bucket, L, k]) and row.
  prompt_routing: tuple[Any, int] | None = None
  kept: int = 0  # tokens it came back with from a checkpoint (`InFlightGroup`), not decoded by this run


@dataclasses.dataclass
class InFlightGroup:
  """A group admitted but not emitted, as a checkpoint keeps it (`RolloutDriver.in_flight`) and a
  resumed driver continues it (`RolloutDriver(resume=...)`): each sample is a finished `Completion`
  or its tokens so far, with their logprobs, versions (and sampling masks), which the resumed driver
  prefills after the prompt and goes on decoding with the same noise (`fold_in(key, n)` for token n)."""

  seq: int
  request: PromptRequest
  prompt_ids: np.ndarray  # int32 [P], after truncation
  keys: np.ndarray  # uint32 [group_size, 2]: the samples' noise keys
  version: int  # the sampler's version when it was admitted
  samples: list[Completion | dict[str, np.ndarray]]  # a dict: tokens, logprobs, versions (, masks)

  @property
  def kept_tokens(self) -> int:
    return sum(s.num_tokens if isinstance(s, Completion) else len(s["tokens"]) for s in self.samples)


class Recorder(Protocol):
  """Work on what a driver decodes, composed into it (`RolloutDriver(recorders=[...])`).

  Called on the sampler thread, so it must not block. `key` = (group start order, sample index)
  names one completion; `tokens` is what it has sampled so far (read, do not keep: it grows).
  """

  def token(self, key: tuple[int, int], prompt_ids: np.ndarray, tokens: Sequence[int],
            request: PromptRequest) -> None:
    """After each sampled token of completion `key`."""

  def completion(self, key: tuple[int, int], prompt_ids: np.ndarray, tokens: Sequence[int],
                 request: PromptRequest) -> None:
    """When completion `key` ends (its last token was passed to `token` first)."""

  def group(self, seq: int, group: RolloutGroup) -> None:
    """Just before the group that started `seq`-th leaves the driver."""


@dataclasses.dataclass
class DriverStats:
  tokens_generated: int = 0  # tokens kept in completions
  live_slot_steps: int = 0  # sum over decode steps of slots holding a live sequence
  total_slot_steps: int = 0  # decode steps x slots
  generate_calls: int = 0
  moves: int = 0  # live sequences moved to another slot (slot groups' plan_insert, a paged cache's compact_slots)
  prefills: int = 0
  completions: int = 0
  groups_emitted: int = 0
  truncated_prompts: int = 0
  param_swaps: int = 0
  prefill_chunks: int = 0  # chunks of long prompts run between generate calls
  preemptions: int = 0  # sequences whose blocks a paged cache took back (each resumed later)
  resumed: int = 0  # preempted (or checkpoint-kept) sequences prefilled again and decoding
  tokens_kept: int = 0  # tokens of sequences continued from a checkpoint (`resume`), not decoded again
  verify_calls: int = 0  # generate calls whose steps verified drafts (sampler.speculative)
  drafted_tokens: int = 0  # draft tokens verified
  accepted_tokens: int = 0  # draft tokens accepted (emitted as drafted)
  decoded_tokens: int = 0  # tokens the decode calls emitted (preempted or stop-string tails included)
  drafts: bool = False  # the driver drafts (sampler.speculative): its step metrics include the drafts'
  busy_time_s: float = 0.0  # time in prefill / insert / generate (incl. fetching results)

  @property
  def slot_occupancy(self) -> float:
    return self.live_slot_steps / self.total_slot_steps if self.total_slot_steps else 0.0

  @property
  def tokens_per_decode_step(self) -> float:
    """Tokens per live slot and model forward: 1 for plain decoding, more as drafts are accepted."""
    return self.decoded_tokens / self.live_slot_steps if self.live_slot_steps else 0.0

  @property
  def draft_acceptance(self) -> float:
    return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


class DriverError(RuntimeError):
  pass


class DriverTimeout(DriverError):
  """`run(max_wall_s=...)` ran out of time."""


# Groups whose noise keys are made by one device call. Fetching keys waits for the device queue
# (prefills, generate calls) to drain, so it is done once per block of groups, not once per group.
_KEY_BLOCK = 64


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _sample_keys(base, first_seq, group_size: int, num_groups: int, turns: int = 0):
  """Noise keys [num_groups, group_size, 2] of the groups started `first_seq`, `first_seq + 1`, ...:
  each depends on its group's start order and its sample index, not on its slot. With `turns`
  (multi-turn episodes) one key per policy turn: [num_groups, group_size, turns, 2]."""
  def group_keys(seq):
    group_key = jax.random.fold_in(base, seq)
    keys = jax.vmap(lambda i: jax.random.fold_in(group_key, i))(jnp.arange(group_size))
    if turns:
      keys = jax.vmap(lambda k: jax.vmap(lambda t: jax.random.fold_in(k, t))(jnp.arange(turns)))(keys)
    return keys
  return jax.vmap(group_keys)(first_seq + jnp.arange(num_groups))


class RolloutDriver:
  """Continuous batching over an `Engine`; see the module docstring."""

  # Colocated layout: the runtime sets `device_turns.DeviceTurns`, so that each step's device work
  # takes its turn with the learner's.
  turns = device_turns.NO_TURNS
  # Multi-turn episodes and agents hold state outside the driver (an environment, a conversation):
  # their groups in flight are started again on resume, not continued.
  continues_in_flight = True

  def __init__(self, engine: Engine, params, *, source: Iterable[PromptRequest | None],
               sink: Callable[[RolloutGroup], None] | Any, version: int = 0,
               may_start_group: Callable[[int], bool] | None = None,
               detokenize: Callable[[Sequence[int]], str] | None = None,
               static_batching: bool = False, tracer: trace_lib.Tracer = trace_lib.NULL_TRACER,
               recorders: Sequence[Recorder] = (), first_seq: int = 0,
               next_round: Callable[[float], tuple[Any, int] | None] | None = None,
               on_step: Callable[[int | None, int, bool], None] | None = None,
               resume: Sequence[InFlightGroup] = (), drafter: drafts_lib.Drafter | None = None):
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
    """
    cfg = engine.config
    if cfg.stop_strings and detokenize is None:
      raise ValueError(f"sampler.stop_strings={cfg.stop_strings} needs a detokenize function")
    self.engine, self.config = engine, cfg
    self._params, self._version = params, int(version)
    self._source: Iterator = iter(source)
    self._sink = sink
    self._may_start = may_start_group or (lambda version: True)
    self._detokenize = detokenize
    self._static = static_batching
    # sampler.speculative: drafts from the groups' texts; it hears of ended completions as a recorder.
    self._drafter = (drafter or drafts_lib.Drafter.from_config(cfg)) if cfg.speculative else None
    self._recorders = tuple(recorders) + ((self._drafter,) if self._drafter else ())
    self.tracer = tracer  # spans of prefill / generate on the sampler thread's track
    self._state = engine.init_decode_state(self._version)
    self._slots: list[_Slot | None] = [None] * engine.max_concurrent_decodes
    self._pending_group: _Group | None = None  # admitted, not all samples inserted yet
    self._pending_prefix = None
    self._blocked: _Group | None = None  # admitted, its blocks did not fit the paged cache yet
    self._preempted: collections.deque[_Slot] = collections.deque()  # to resume, oldest first
    # A long prompt prefilled a chunk per step, between generate calls: (group, chunk steps, version).
    self._prefilling: tuple[_Group, Iterator | None, int | None] | None = None
    self._in_flight: dict[int, _Group] = {}
    self._next_seq = int(first_seq)
    self._next_round = next_round
    self._on_step = on_step
    self._exhausted = False
    self._base_key = jax.random.PRNGKey(cfg.seed)
    self._key_blocks: dict[int, np.ndarray] = {}  # block -> keys of its groups (the latest few), see _KEY_BLOCK
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
    self.stats = DriverStats(drafts=self._drafter is not None)
    for group in resume:
      self._continue(group)

  def _continue(self, saved: InFlightGroup) -> None:
    """Takes a checkpoint's group back: finished samples as they are, the others queued to be
    prefilled with their tokens so far (as a paged cache's preempted sequences are)."""
    if saved.seq >= self._next_seq:
      raise DriverError(f"resumed group {saved.seq} starts after first_seq={self._next_seq}")
    group = _Group(seq=saved.seq, request=saved.request, prompt_ids=np.asarray(saved.prompt_ids, np.int32),
                   completions=[None] * self.config.group_size, started=self.config.group_size,
                   keys=np.asarray(saved.keys, np.uint32), version=saved.version, resumed_at=self._version)
    self._in_flight[group.seq] = group
    for i, sample in enumerate(saved.samples):
      if isinstance(sample, Completion):
        group.completions[i] = sample
        self._retell(group, i, sample.token_ids, finished=True)
        continue
      info = _Slot(group=group, index=i, max_new=self._limit(group), tokens=[int(t) for t in sample["tokens"]],
                   logprobs=[float(x) for x in sample["logprobs"]], versions=[int(v) for v in sample["versions"]],
                   masks=list(sample["masks"]) if sample.get("masks") is not None else [])
      info.kept = len(info.tokens)
      self.stats.tokens_kept += info.kept
      self._retell(group, i, info.tokens, finished=False)
      self._preempted.append(info)
    if all(c is not None for c in group.completions):  # emitted now: no step of its own (a replay's record has none)
      del self._in_flight[group.seq]
      self._emit(self._rollout_group(group))

  def _retell(self, group: _Group, index: int, tokens, finished: bool) -> None:
    """Recorders see a kept sample's tokens as they saw them before the checkpoint: one `token` call
    per token on one growing list (as decoding calls them), then `completion` if it had finished."""
    key = (group.seq, index)
    for r in self._recorders:
      so_far: list[int] = []
      for token in tokens:
        so_far.append(int(token))
        r.token(key, group.prompt_ids, so_far, group.request)
      if finished:
        r.completion(key, group.prompt_ids, so_far, group.request)

  def in_flight(self, timeout_s: float) -> list[InFlightGroup] | None:
    """Every group admitted and not yet emitted, in start order, as it stands between two steps
    (any thread; a checkpoint keeps them). Tokens the device decoded are all collected by then.
    None when the current step did not end within `timeout_s`."""
    if not self.continues_in_flight:
      return []
    if not self._host_lock.acquire(timeout=timeout_s):
      return None
    try:
      slots = {(s.group.seq, s.index): s for s in [*self._slots, *self._preempted] if s is not None}
      out = []
      for group in sorted(self._in_flight.values(), key=lambda g: g.seq):
        if group.keys is None:
          self._sample_keys_of(group, 0)  # makes them
        samples = []
        for i, done in enumerate(group.completions):
          info = slots.get((group.seq, i))
          if done is not None:
            samples.append(done)
          else:
            samples.append({"tokens": np.asarray(info.tokens if info else [], np.int32),
                            "logprobs": np.asarray(info.logprobs if info else [], np.float32),
                            "versions": np.asarray(info.versions if info else [], np.int32),
                            **({"masks": np.stack(info.masks)} if info is not None and info.masks else {})})
        out.append(InFlightGroup(seq=group.seq, request=group.request, prompt_ids=group.prompt_ids,
                                 keys=group.keys.copy(), version=group.version, samples=samples))
      return out
    finally:
      self._host_lock.release()

  @property
  def next_seq(self) -> int:
    """The start order the next admitted group gets (a resumed run's `first_seq`)."""
    return self._next_seq

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
    return (self._pending_group is None and self._prefilling is None and not self._preempted
            and all(s is None for s in self._slots))

  @property
  def exhausted(self) -> bool:
    return self._exhausted

  def unfinished_requests(self) -> list[PromptRequest]:
    """Requests admitted but not emitted (to re-queue on resume after `stop`)."""
    return [g.request for g in sorted(self._in_flight.values(), key=lambda g: g.seq)]

  # ------------------------------------------------------------------ thread

  def start(self) -> None:
    if self._thread is not None:
      raise DriverError("RolloutDriver.start called twice")
    self._thread = threading.Thread(target=self._thread_main, name="rollout-driver", daemon=True)
    self._thread.start()

  def stop(self, timeout_s: float = 60.0) -> None:
    """Asks the loop to stop after its current step and waits for it (bounded)."""
    self._stop_event.set()
    self.join(timeout_s)

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
      if self._exhausted and self.is_idle and self._next_params is None:
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
    seq_before = self._next_seq
    with self.turns.sampler():  # the device work of one step; collecting its tokens is host work
      held.enter_context(self._host_lock)  # taken inside the turn: a learner in its turn never waits on it
      swapped = self._maybe_swap_params()
      self._prepare()
      self._reserve()
      self._refill()
      if not any(s is not None for s in self._slots):
        if self._on_step is not None and (swapped is not None or self._next_seq > seq_before):
          self._on_step(swapped, self._next_seq - seq_before, False)
        return False
      self._state, moves = self.engine.compact_slots(self._state)
      for src, dst in moves:
        self._slots[dst], self._slots[src] = self._slots[src], None
      self.stats.moves += len(moves)
      drafted = None
      if self._drafter is not None:
        width = self.engine.decode_width(self._state)
        if self._drafter.may_pay(sum(isinstance(s, _Slot) for s in self._slots), width):
          drafted = self._drafter.drafts(self._draft_requests(), len(self._slots), width)
      t0 = time.perf_counter()
      with self.tracer.span("generate", cat="sampler", version=self._version, verify=drafted is not None):
        if drafted is None:
          self._state, result = self.engine.generate(self._params, self._state)
          host = jax.device_get(result)
        else:
          self._state, host = self.engine.verify(self._params, self._state, drafted[0])
      self.stats.busy_time_s += time.perf_counter() - t0
      if self._drafter is not None:
        self._drafter.timed(drafted is not None, width, time.perf_counter() - t0)
    self.stats.generate_calls += 1
    self._count_steps(host, drafted)
    self._collect(host)
    if self._on_step is not None:
      self._on_step(swapped, self._next_seq - seq_before, True)
    return True

  def _draft_requests(self) -> Iterator[drafts_lib.Live]:
    """The live single-turn sequences, for the drafter (other slot kinds decode without drafts)."""
    for s, info in enumerate(self._slots):
      if isinstance(info, _Slot):
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
      info = self._slots[s]
      n, accepted = drafts_lib.verified(host.tokens_ks[:, s], valid_ks[:, s], tokens[s], cfg.draft_tokens,
                                        sum(r.stop - r.start > 1 for r in forwards))
      self.stats.drafted_tokens += n
      self.stats.accepted_tokens += accepted
      self._drafter.observe(info.group.seq, info.index, n, accepted, len(info.tokens) + int(valid_ks[:, s].sum()))

  def _prepare(self) -> None:
    """Runs before slots are refilled: subclasses bring in other work (EpisodeDriver: env results)."""

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
        return None  # _refill starts nothing new while a drain swap waits
      self._next_params = None
      hold, self._hold_after_swap = self._hold_after_swap, False
    self._params, self._version = params, version
    self._state = self.engine.set_version(self._state, version)
    self.stats.param_swaps += 1
    if hold:
      self._held.set()
    return version

  def _reserve(self) -> None:
    """Blocks for every live sequence's next call (a paged cache; the youngest are preempted when
    the pool runs dry and resumed first at the next refills)."""
    self._state, preempted = self.engine.reserve(self._state)
    for slot in preempted:
      self._requeue_preempted(self._slots[slot])
      self._slots[slot] = None
      self.stats.preemptions += 1

  def _requeue_preempted(self, info: _Slot) -> None:
    self._preempted.append(info)

  def _resume_preempted(self, free: list[int]) -> bool:
    """Prefills preempted (or checkpoint-kept) sequences' prompt and completion so far again into free
    slots, oldest first, as many as fit in one prefill call; they continue with the same noise where
    they stopped. False while some still wait."""
    ids, requests = [], []
    for info in itertools.islice(self._preempted, len(free)):
      requests.append((len(info.group.prompt_ids) + len(info.tokens), [free[len(ids)]]))
      if self.engine.fits(self._state, requests) < len(requests):
        break
      ids.append(np.concatenate([info.group.prompt_ids, np.asarray(info.tokens, np.int32)]))
    if ids:
      infos = [self._preempted.popleft() for _ in ids]
      slots = [free.pop(0) for _ in ids]
      t0 = time.perf_counter()
      with self.tracer.span("prefill", cat="sampler", version=self._version, resumed=len(ids)):
        prefixes = self.engine.prefill_many(self._params, ids, version=self._version, max_length=self.config.cache_length)
        self._state = self.engine.insert_many(prefixes, self._state, [[s] for s in slots],
                                              keys=[info.group.keys[info.index][None] for info in infos],
                                              max_new_tokens=[info.max_new for info in infos],
                                              generated=[len(info.tokens) for info in infos])
      self.stats.busy_time_s += time.perf_counter() - t0
      self.stats.prefills += len(ids)
      self.stats.resumed += len(ids)
      for slot, info in zip(slots, infos):
        self._slots[slot] = info
    return not self._preempted

  def _admission_closed(self) -> bool:
    with self._lock:
      return self._held.is_set() or (self._next_params is not None and self._next_params[2])

  def _refill(self) -> None:
    free = [i for i, s in enumerate(self._slots) if s is None]
    if not free or (self._static and len(free) < len(self._slots)):
      return
    if not self._resume_preempted(free):
      return
    if self.engine.config.slot_groups > 1:
      self._refill_one_at_a_time(free)
      return
    if not self._prefill_next_chunk():
      return
    batch = self._take_groups(free)
    if not batch:
      self._pend_blocked()
      return
    prefixes = self._prefixes([group for group, _ in batch])
    t0 = time.perf_counter()
    self._state = self.engine.insert_many(
        prefixes, self._state, [slots for _, slots in batch],
        keys=[self._sample_keys_of(group, len(slots)) for group, slots in batch],
        max_new_tokens=[self._limit(group) for group, _ in batch])
    self.stats.busy_time_s += time.perf_counter() - t0
    for (group, slots), prefix in zip(batch, prefixes):
      self._started(group, slots, prefix)
    self._pend_blocked()

  def _prefill_next_chunk(self) -> bool:
    """Runs the next chunk of the long prompt being prefilled (one per step, so decoding goes on
    in between); True when none is left, the finished group then pending with its prefix."""
    pending = self._pending_group
    if (self._prefilling is None and self._pending_prefix is not None
        and self._pending_prefix.version != self._version and self.engine.prefills_in_chunks(len(pending.prompt_ids))):
      self._prefilling, self._pending_group, self._pending_prefix = (pending, None, None), None, None
    if self._prefilling is None:
      return True
    group, steps, version = self._prefilling
    if steps is None or version != self._version:  # not started, or new weights: start with these
      steps, version = self.engine.prefill_steps(self._params, group.prompt_ids, version=self._version), self._version
    t0 = time.perf_counter()
    with self.tracer.span("prefill chunk", cat="sampler", version=version):
      prefix = next(steps)
    self.stats.busy_time_s += time.perf_counter() - t0
    self.stats.prefill_chunks += 1
    if prefix is None:
      self._prefilling = (group, steps, version)
      return False
    self._prefilling = None
    self._pending_group, self._pending_prefix = group, prefix
    self.stats.prefills += 1
    return True

  def _take_groups(self, free: list[int]) -> list[tuple[_Group, list[int]]]:
    """Groups to insert now with their slots: the pending group first, then new ones while free
    slots remain (admission is asked per group). Only the last may not fit the slots: it stays
    pending. A group whose blocks do not fit a paged cache ends the batch and waits (`_blocked`).
    A new group whose prompt prefills in chunks ends the batch: its chunks run from the next step."""
    batch, requests = [], []
    group = self._pending_group
    while free:
      group = group or self._admit()
      if group is None:
        break
      if group is not self._pending_group and self.engine.prefills_in_chunks(len(group.prompt_ids)):
        self._prefilling = (group, None, None)
        break
      slots = free[:self.config.group_size - group.started]
      requests.append((len(group.prompt_ids), slots))
      if self.engine.fits(self._state, requests) < len(requests):
        if group is not self._pending_group:
          self._blocked = group
        break
      del free[:len(slots)]
      batch.append((group, slots))
      group = None
    return batch

  def _pend_blocked(self) -> None:
    """A group admitted but blocked by the cache's budget goes first at the next refill."""
    if self._blocked is not None:
      self._pending_group, self._pending_prefix, self._blocked = self._blocked, None, None

  def _prefixes(self, groups: list[_Group]) -> list:
    """The groups' prefixes: the pending group keeps its own if computed with the current weights
    (a prefix is never reused across weight versions); the others are prefilled in one call."""
    prefixes = [None] * len(groups)
    if groups[0] is self._pending_group and self._pending_prefix is not None \
        and self._pending_prefix.version == self._version:
      prefixes[0] = self._pending_prefix
    todo = [i for i, p in enumerate(prefixes) if p is None]
    if todo:
      t0 = time.perf_counter()
      with self.tracer.span("prefill", cat="sampler", version=self._version, prompts=len(todo)):
        fresh = self.engine.prefill_many(self._params, [groups[i].prompt_ids for i in todo], version=self._version)
      self.stats.busy_time_s += time.perf_counter() - t0
      self.stats.prefills += len(todo)
      for i, prefix in zip(todo, fresh):
        prefixes[i] = prefix
    return prefixes

  def _refill_one_at_a_time(self, free: list[int]) -> None:
    """Slot groups: one sample per insert, after the engine may have moved a live sequence so that
    long ones stay together (`Engine.plan_insert` / `move`)."""
    while free:
      group = self._pending_group or self._admit()
      if group is None:
        return
      if self._pending_group is not group:
        self._pending_group, self._pending_prefix = group, None
      if self._pending_prefix is None or self._pending_prefix.version != self._version:
        # A prefix is never reused across weight versions: recompute it with the current params.
        t0 = time.perf_counter()
        with self.tracer.span("prefill", cat="sampler", version=self._version):
          self._pending_prefix = self.engine.prefill(self._params, group.prompt_ids, version=self._version)
        self.stats.busy_time_s += time.perf_counter() - t0
        self.stats.prefills += 1
      t0 = time.perf_counter()
      slot, move = self.engine.plan_insert(self._state, free)
      if move is not None:
        src, dst = move
        self._state = self.engine.move(self._state, src, dst)
        self._slots[dst], self._slots[src] = self._slots[src], None
        self.stats.moves += 1
      free.remove(dst if move is not None else slot)
      self._state = self.engine.bulk_insert(self._pending_prefix, self._state, [slot],
                                            keys=self._sample_keys_of(group, 1), max_new_tokens=self._limit(group))
      self.stats.busy_time_s += time.perf_counter() - t0
      self._started(group, [slot], self._pending_prefix)

  def _limit(self, group: _Group) -> int:
    return group.request.max_new_tokens or self.config.max_new_tokens

  def _sample_keys_of(self, group: _Group, count: int) -> np.ndarray:
    """Noise keys of the group's next `count` samples."""
    if group.keys is None:
      noise_id = group.request.noise_id
      group.keys = (self._group_keys(group.seq) if noise_id is None
                    else np.asarray(_sample_keys(self._base_key, noise_id, self.config.group_size, 1))[0])
    return group.keys[group.started:group.started + count]

  def _started(self, group: _Group, slots: list[int], prefix) -> None:
    """Bookkeeping once the group's next samples are inserted into `slots`: a group not yet fully
    inserted stays pending with its prefix."""
    limit = self._limit(group)
    routing = None if prefix.routing is None else (prefix.routing, prefix.row)
    for i, slot in enumerate(slots):
      self._slots[slot] = _Slot(group=group, index=group.started + i, max_new=limit, prompt_routing=routing)
    group.started += len(slots)
    if group.started < self.config.group_size:
      self._pending_group, self._pending_prefix = group, prefix
    elif self._pending_group is group:
      self._pending_group, self._pending_prefix = None, None

  _key_turns = 0  # EpisodeDriver: a key per policy turn

  def _group_keys(self, seq: int) -> np.ndarray:
    block, i = divmod(seq, _KEY_BLOCK)
    if block not in self._key_blocks:
      if len(self._key_blocks) >= 4:  # groups of neighbouring blocks interleave (multi-turn): keep a few
        del self._key_blocks[min(self._key_blocks)]
      keys = _sample_keys(self._base_key, block * _KEY_BLOCK, self.config.group_size, _KEY_BLOCK,
                          self._key_turns)
      self._key_blocks[block] = np.asarray(keys)
    return self._key_blocks[block][i]

  def _admit(self) -> _Group | None:
    """Starts the next group if admission allows and the source has one."""
    if self._exhausted or self._admission_closed() or not self._may_start(self._version):
      return None
    try:
      request = next(self._source)
    except StopIteration:
      self._exhausted = True
      return None
    if request is None:
      return None
    ids = self._check_prompt(request)
    group = _Group(seq=self._next_seq, request=request, prompt_ids=ids,
                   completions=[None] * self.config.group_size, version=self._version)
    self._next_seq += 1
    self._in_flight[group.seq] = group
    return group

  def _check_prompt(self, request: PromptRequest) -> np.ndarray:
    if not isinstance(request, PromptRequest):
      raise TypeError(f"prompt source yielded {type(request).__name__}, expected PromptRequest")
    ids = np.asarray(request.token_ids)
    if ids.ndim != 1 or len(ids) == 0:
      raise PromptError(f"prompt {request.prompt_id!r}: token_ids must be a non-empty 1-D sequence, "
                        f"got shape {ids.shape}")
    limit = self.engine.max_prefill_length
    if len(ids) > limit:
      if not self.config.truncate_long_prompts:
        raise PromptError(f"prompt {request.prompt_id!r} has {len(ids)} tokens > sampler.max_prefill_length="
                          f"{limit} (SamplerConfig.truncate_long_prompts=True keeps its last {limit})")
      ids = ids[-limit:]  # the end holds the question and the generation cue
      self.stats.truncated_prompts += 1
    m = request.max_new_tokens
    if m is not None and not 1 <= m <= self.config.max_new_tokens:
      raise PromptError(f"prompt {request.prompt_id!r}: max_new_tokens={m} outside [1, "
                        f"sampler.max_new_tokens={self.config.max_new_tokens}]")
    return ids

  # ------------------------------------------------------------------ results

  def _collect(self, host) -> None:
    tokens_ks, logprobs_ks, valid_ks = host.tokens_ks, host.logprobs_ks, host.valid_ks
    version = int(host.version)
    eos = set(self.config.eos_ids)
    for s, info in enumerate(self._slots):
      if info is None:
        continue
      finish = None
      for k in np.flatnonzero(valid_ks[:, s]):
        if finish is not None:  # decoded past a host-side stop string in this call: dropped
          continue
        token = int(tokens_ks[k, s])
        self._record(info, token, float(logprobs_ks[k, s]), version,
                     None if host.mask_ksw is None else host.mask_ksw[k, s])
        if host.routing_kslk is not None:
          info.routing.append(host.routing_kslk[k, s])
        finish = self._stop_reason(info, token, eos)
      if finish is None:
        if host.done_s[s]:
          raise DriverError(f"slot {s}: the device reports it done but the host saw no stop")
        continue
      self._finish(s, info, finish)  # first: EpisodeDriver parks the slot's KV before release frees it
      if finish == "stop" and not host.done_s[s]:
        self._state = self.engine.release(self._state, s)
    self._state = self.engine.mark_finished(self._state, host.done_s)

  def _record(self, info: _Slot, token: int, logprob: float, version: int, mask) -> None:
    """Appends one sampled token to what the slot is producing (EpisodeDriver: to the episode)."""
    info.tokens.append(token)
    info.logprobs.append(logprob)
    info.versions.append(version)
    if mask is not None:
      info.masks.append(mask)
    for r in self._recorders:
      r.token((info.group.seq, info.index), info.group.prompt_ids, info.tokens, info.group.request)

  def _stop_reason(self, info: _Slot, token: int, eos: set[int]) -> str | None:
    """Why the slot's sequence ends at `token` (eos / stop / length), or None to go on."""
    if token in eos:
      return "eos"
    if self._hit_stop_string(info.tokens):
      return "stop"
    if len(info.tokens) >= info.max_new:
      return "length"
    return None

  def _hit_stop_string(self, tokens: list[int]) -> bool:
    if not self.config.stop_strings:
      return False
    text = self._detokenize(tokens)
    return any(stop in text for stop in self.config.stop_strings)

  def _finish(self, slot: int, info: _Slot, reason: str) -> None:
    for r in self._recorders:
      r.completion((info.group.seq, info.index), info.group.prompt_ids, info.tokens, info.group.request)
    n = len(info.tokens)
    completion = Completion(
        token_ids=np.asarray(info.tokens, np.int32),
        logprobs=np.asarray(info.logprobs, np.float32),
        policy_versions=np.asarray(info.versions, np.int32),
        finish_reason=reason,
        loss_mask=np.ones((n,), np.int32),
        sampling_mask=np.stack(info.masks) if info.masks else None,
        expert_routing=np.stack(info.routing).astype(np.int32) if info.routing else None,
        prompt_routing=self._prompt_routing(info),
        text=self._detokenize(info.tokens) if self._detokenize else None)
    self._slots[slot] = None
    self.stats.tokens_generated += n - info.kept
    self.stats.completions += 1
    group = info.group
    group.completions[info.index] = completion
    if all(c is not None for c in group.completions):
      del self._in_flight[group.seq]
      self._emit(self._rollout_group(group))

  def _rollout_group(self, group: _Group) -> RolloutGroup:
    """A group whose samples are all finished, as it leaves the driver (recorders told first)."""
    req = group.request
    done = RolloutGroup(prompt_id=req.prompt_id, prompt_token_ids=group.prompt_ids.astype(np.int32),
                        completions=list(group.completions), columns=dict(req.columns), prompt_text=req.prompt_text,
                        seq=group.seq, start_version=group.resumed_at)  # the queue re-admitted it then
    for r in self._recorders:
      r.group(group.seq, done)
    return done

  @staticmethod
  def _prompt_routing(info: _Slot) -> np.ndarray | None:
    if info.prompt_routing is None:
      return None
    routing, row = info.prompt_routing
    return np.asarray(routing)[row, :len(info.group.prompt_ids) - 1]

  def _emit(self, group: RolloutGroup) -> None:
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
