"""Single-turn rollouts: G samples of each prompt, a sample finished at its first stop, the group
emitted the moment its last sample ends (the episode strategy of a plain `RolloutDriver`).

Refill order: preempted (or checkpoint-kept) samples first, prefilled again with their tokens so far;
then the chunks of a long prompt (one per step, decoding goes on in between); then the pending group
(admitted, not all samples inserted) and new groups while free slots remain. The groups taken at one
refill share one prefill call and one insert call (`Engine.prefill_many` / `insert_many`); with slot
groups (`sampler.slot_groups`) each sample is inserted alone, after the engine may have moved a long
sequence so that long ones stay together (`plan_insert` / `move`).
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Iterator, Sequence

import numpy as np

from tunixlike.rollout import Completion, RolloutGroup
from tunixlike.sampler import kept as kept_lib
from tunixlike.sampler.driver_api import DriverStats, InFlightGroup, PromptRequest, Recorder
from tunixlike.sampler.samples import Group, Sample


class SingleTurn:
  """The `strategy.Episodes` of single-turn GRPO groups; see the module docstring."""

  continues_in_flight = True
  key_turns = 0

  def __init__(self, recorders: Sequence[Recorder] = (), *, static_batching: bool = False):
    """`recorders` watch every token, completion and group. `static_batching=True` waits for all
    slots to empty before refilling (the baseline continuous batching is measured against)."""
    self.recorders = tuple(recorders)
    self.static = static_batching
    self.pending_group: Group | None = None  # admitted, not all samples inserted yet
    self.pending_prefix = None
    self.blocked: Group | None = None  # admitted, its blocks did not fit the paged cache yet
    self.preempted: collections.deque[Sample] = collections.deque()  # to resume, oldest first
    # A long prompt prefilled a chunk per step, between generate calls: (group, chunk steps, version).
    self.prefilling: tuple[Group, Iterator | None, int | None] | None = None

  def bind(self, driver) -> DriverStats:
    self.driver = driver
    self.engine, self.config = driver.engine, driver.config
    self.stats = DriverStats(drafts=driver.drafter is not None)
    return self.stats

  @property
  def is_idle(self) -> bool:
    return self.pending_group is None and self.prefilling is None and not self.preempted

  def prepare(self) -> None:
    pass

  def collected(self) -> None:
    pass

  def close(self) -> None:
    pass

  # ------------------------------------------------------------------ checkpoints (kept.py)

  def resume(self, groups: Sequence[InFlightGroup]) -> None:
    for saved in groups:
      kept_lib.take_back(self, saved)

  def in_flight(self) -> list[InFlightGroup]:
    return kept_lib.snapshot(self)

  # ------------------------------------------------------------------ refill

  def requeue(self, info: Sample) -> None:
    self.preempted.append(info)

  def refill(self, free: list[int]) -> None:
    if not free or (self.static and len(free) < len(self.driver.slots)):
      return
    if not self._resume_preempted(free):
      return
    if self.config.slot_groups > 1:
      self.refill_one_at_a_time(free)
      return
    if not self._prefill_next_chunk():
      return
    batch = self._take_groups(free)
    if not batch:
      self._pend_blocked()
      return
    d = self.driver
    prefixes = self._prefixes([group for group, _ in batch])
    t0 = time.perf_counter()
    d.slots.state = self.engine.insert_many(
        prefixes, d.slots.state, [slots for _, slots in batch],
        keys=[self._sample_keys_of(group, len(slots)) for group, slots in batch],
        max_new_tokens=[self.limit(group) for group, _ in batch])
    self.stats.busy_time_s += time.perf_counter() - t0
    for (group, slots), prefix in zip(batch, prefixes):
      self._started(group, slots, prefix)
    self._pend_blocked()

  def _resume_preempted(self, free: list[int]) -> bool:
    """Prefills preempted (or checkpoint-kept) sequences' prompt and completion so far again into free
    slots, oldest first, as many as fit in one prefill call; they continue with the same noise where
    they stopped. False while some still wait."""
    d = self.driver
    ids, requests = [], []
    for info in itertools.islice(self.preempted, len(free)):
      requests.append((len(info.group.prompt_ids) + len(info.tokens), [free[len(ids)]]))
      if self.engine.fits(d.slots.state, requests) < len(requests):
        break
      ids.append(np.concatenate([info.group.prompt_ids, np.asarray(info.tokens, np.int32)]))
    if ids:
      infos = [self.preempted.popleft() for _ in ids]
      slots = [free.pop(0) for _ in ids]
      t0 = time.perf_counter()
      with d.tracer.span("prefill", cat="sampler", version=d.version, resumed=len(ids)):
        prefixes = self.engine.prefill_many(d.params, ids, version=d.version, max_length=self.config.cache_length)
        d.slots.state = self.engine.insert_many(prefixes, d.slots.state, [[s] for s in slots],
                                                keys=[info.group.keys[info.index][None] for info in infos],
                                                max_new_tokens=[info.max_new for info in infos],
                                                generated=[len(info.tokens) for info in infos])
      self.stats.busy_time_s += time.perf_counter() - t0
      self.stats.prefills += len(ids)
      self.stats.resumed += len(ids)
      for slot, info in zip(slots, infos):
        d.slots[slot] = info
    return not self.preempted

  def _prefill_next_chunk(self) -> bool:
    """Runs the next chunk of the long prompt being prefilled (one per step, so decoding goes on
    in between); True when none is left, the finished group then pending with its prefix."""
    d = self.driver
    pending = self.pending_group
    if (self.prefilling is None and self.pending_prefix is not None
        and self.pending_prefix.version != d.version and self.engine.prefills_in_chunks(len(pending.prompt_ids))):
      self.prefilling, self.pending_group, self.pending_prefix = (pending, None, None), None, None
    if self.prefilling is None:
      return True
    group, steps, version = self.prefilling
    if steps is None or version != d.version:  # not started, or new weights: start with these
      steps, version = self.engine.prefill_steps(d.params, group.prompt_ids, version=d.version), d.version
    t0 = time.perf_counter()
    with d.tracer.span("prefill chunk", cat="sampler", version=version):
      prefix = next(steps)
    self.stats.busy_time_s += time.perf_counter() - t0
    self.stats.prefill_chunks += 1
    if prefix is None:
      self.prefilling = (group, steps, version)
      return False
    self.prefilling = None
    self.pending_group, self.pending_prefix = group, prefix
    self.stats.prefills += 1
    return True

  def _take_groups(self, free: list[int]) -> list[tuple[Group, list[int]]]:
    """Groups to insert now with their slots: the pending group first, then new ones while free
    slots remain (admission is asked per group). Only the last may not fit the slots: it stays
    pending. A group whose blocks do not fit a paged cache ends the batch and waits (`blocked`).
    A new group whose prompt prefills in chunks ends the batch: its chunks run from the next step."""
    batch, requests = [], []
    group = self.pending_group
    while free:
      group = group or self._admit()
      if group is None:
        break
      if group is not self.pending_group and self.engine.prefills_in_chunks(len(group.prompt_ids)):
        self.prefilling = (group, None, None)
        break
      slots = free[:self.config.group_size - group.started]
      requests.append((len(group.prompt_ids), slots))
      if self.engine.fits(self.driver.slots.state, requests) < len(requests):
        if group is not self.pending_group:
          self.blocked = group
        break
      del free[:len(slots)]
      batch.append((group, slots))
      group = None
    return batch

  def _pend_blocked(self) -> None:
    """A group admitted but blocked by the cache's budget goes first at the next refill."""
    if self.blocked is not None:
      self.pending_group, self.pending_prefix, self.blocked = self.blocked, None, None

  def _prefixes(self, groups: list[Group]) -> list:
    """The groups' prefixes: the pending group keeps its own if computed with the current weights
    (a prefix is never reused across weight versions); the others are prefilled in one call."""
    d = self.driver
    prefixes = [None] * len(groups)
    if groups[0] is self.pending_group and self.pending_prefix is not None \
        and self.pending_prefix.version == d.version:
      prefixes[0] = self.pending_prefix
    todo = [i for i, p in enumerate(prefixes) if p is None]
    if todo:
      t0 = time.perf_counter()
      with d.tracer.span("prefill", cat="sampler", version=d.version, prompts=len(todo)):
        fresh = self.engine.prefill_many(d.params, [groups[i].prompt_ids for i in todo], version=d.version)
      self.stats.busy_time_s += time.perf_counter() - t0
      self.stats.prefills += len(todo)
      for i, prefix in zip(todo, fresh):
        prefixes[i] = prefix
    return prefixes

  def refill_one_at_a_time(self, free: list[int]) -> None:
    """Slot groups: one sample per insert, after the engine may have moved a live sequence so that
    long ones stay together (`Engine.plan_insert` / `move`)."""
    d = self.driver
    while free:
      group = self.pending_group or self._admit()
      if group is None:
        return
      if self.pending_group is not group:
        self.pending_group, self.pending_prefix = group, None
      if self.pending_prefix is None or self.pending_prefix.version != d.version:
        # A prefix is never reused across weight versions: recompute it with the current params.
        t0 = time.perf_counter()
        with d.tracer.span("prefill", cat="sampler", version=d.version):
          self.pending_prefix = self.engine.prefill(d.params, group.prompt_ids, version=d.version)
        self.stats.busy_time_s += time.perf_counter() - t0
        self.stats.prefills += 1
      t0 = time.perf_counter()
      slot, move = self.engine.plan_insert(d.slots.state, free)
      if move is not None:
        src, dst = move
        d.slots.move(src, dst, self.stats)
      free.remove(dst if move is not None else slot)
      d.slots.state = self.engine.bulk_insert(self.pending_prefix, d.slots.state, [slot],
                                              keys=self._sample_keys_of(group, 1), max_new_tokens=self.limit(group))
      self.stats.busy_time_s += time.perf_counter() - t0
      self._started(group, [slot], self.pending_prefix)

  def limit(self, group: Group) -> int:
    return group.request.max_new_tokens or self.config.max_new_tokens

  def _sample_keys_of(self, group: Group, count: int) -> np.ndarray:
    """Noise keys of the group's next `count` samples."""
    if group.keys is None:
      noise_id = group.request.noise_id
      group.keys = self.driver.keys.group(group.seq) if noise_id is None else self.driver.keys.of_noise_id(noise_id)
    return group.keys[group.started:group.started + count]

  def _started(self, group: Group, slots: list[int], prefix) -> None:
    """Bookkeeping once the group's next samples are inserted into `slots`: a group not yet fully
    inserted stays pending with its prefix."""
    limit = self.limit(group)
    routing = None if prefix.routing is None else (prefix.routing, prefix.row)
    for i, slot in enumerate(slots):
      self.driver.slots[slot] = Sample(group=group, index=group.started + i, max_new=limit, prompt_routing=routing)
    group.started += len(slots)
    if group.started < self.config.group_size:
      self.pending_group, self.pending_prefix = group, prefix
    elif self.pending_group is group:
      self.pending_group, self.pending_prefix = None, None

  def _admit(self) -> Group | None:
    return self.driver.admission.admit(self.driver.version, self._new_group)

  def _new_group(self, seq: int, request: PromptRequest, ids: np.ndarray) -> Group:
    return Group(seq=seq, request=request, prompt_ids=ids, completions=[None] * self.config.group_size,
                 version=self.driver.version)

  # ------------------------------------------------------------------ results

  def record(self, info: Sample, token: int, logprob: float, version: int, mask) -> None:
    info.tokens.append(token)
    info.logprobs.append(logprob)
    info.versions.append(version)
    if mask is not None:
      info.masks.append(mask)
    for r in self.recorders:
      r.token((info.group.seq, info.index), info.group.prompt_ids, info.tokens, info.group.request)

  def stop_reason(self, info: Sample, token: int, eos: set[int]) -> str | None:
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
    text = self.driver.detokenize(tokens)
    return any(stop in text for stop in self.config.stop_strings)

  def finish(self, slot: int, info: Sample, reason: str) -> None:
    for r in self.recorders:
      r.completion((info.group.seq, info.index), info.group.prompt_ids, info.tokens, info.group.request)
    n = len(info.tokens)
    detokenize = self.driver.detokenize
    completion = Completion(
        token_ids=np.asarray(info.tokens, np.int32),
        logprobs=np.asarray(info.logprobs, np.float32),
        policy_versions=np.asarray(info.versions, np.int32),
        finish_reason=reason,
        loss_mask=np.ones((n,), np.int32),
        sampling_mask=np.stack(info.masks) if info.masks else None,
        expert_routing=np.stack(info.routing).astype(np.int32) if info.routing else None,
        prompt_routing=self._prompt_routing(info),
        text=detokenize(info.tokens) if detokenize else None)
    self.stats.tokens_generated += n - info.kept
    self.stats.completions += 1
    group = info.group
    group.completions[info.index] = completion
    if all(c is not None for c in group.completions):
      self.emit(group)

  def emit(self, group: Group) -> None:
    """A group whose samples are all finished leaves the driver (recorders told first)."""
    req = group.request
    done = RolloutGroup(prompt_id=req.prompt_id, prompt_token_ids=group.prompt_ids.astype(np.int32),
                        completions=list(group.completions), columns=dict(req.columns), prompt_text=req.prompt_text,
                        seq=group.seq, start_version=group.resumed_at)  # the queue re-admitted it then
    for r in self.recorders:
      r.group(group.seq, done)
    self.driver.admission.done(group.seq)
    self.driver.emit(done)

  @staticmethod
  def _prompt_routing(info: Sample) -> np.ndarray | None:
    if info.prompt_routing is None:
      return None
    routing, row = info.prompt_routing
    return np.asarray(routing)[row, :len(info.group.prompt_ids) - 1]
