"""Prompts for the sampler, numbered by their place in the data stream so a resume loses none."""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from tunixlike.rewards.loader import NOT_COLUMNS  # a record's own fields: the request carries them itself
from tunixlike.rollout import RolloutGroup
from tunixlike.sampler.driver import PromptRequest


class PromptStream:
  """Prompt records -> PromptRequests for the driver, numbered by their index in the data stream.

  `stream_index` orders a batch deterministically whatever order rewards finish in. A checkpoint
  stores `position` (the next index) and `outstanding` (indices handed out but neither trained nor
  dropped: in flight at the time); resuming replays the outstanding prompts first, so no prompt is
  skipped or trained twice.

  `kept`: stream indices a checkpoint kept the rollouts of (`rl/in_flight.py`): outstanding, not replayed.

  `shard=(i, n)`: `pipe` is shard i of n of the data (a sampler host's, mesh.sampler_hosts) and its
  k-th prompt gets `stream_index` k * n + i, so indices of different shards never collide
  (`position` counts this shard's prompts; `outstanding` and `replay` are stream indices).
  """

  def __init__(self, pipe, position: int = 0, replay: Sequence[int] = (), shard: tuple[int, int] = (0, 1),
               kept: Sequence[int] = ()):
    self._pipe = pipe
    self._shard, self._shards = shard
    self._lock = threading.Lock()
    kept = set(kept)
    self._replay = [i for i in replay if i not in kept]
    self.replayed = len(self._replay)
    self.position = position
    self._it = iter(pipe)
    if position:
      self._it.set_state({"next_index": position})
    self.outstanding: set[int] = kept

  def _record_at(self, index: int) -> dict:
    it = iter(self._pipe)
    it.set_state({"next_index": index})
    return next(it)

  def __iter__(self):
    return self

  def __next__(self) -> PromptRequest:
    with self._lock:
      if self._replay:
        index = self._replay.pop(0)
        r = self._record_at(index // self._shards)
      else:
        r = next(self._it)
        index, self.position = self.position * self._shards + self._shard, self.position + 1
      self.outstanding.add(index)
    return request_for(r, stream_index=index)

  def done(self, groups: Sequence[RolloutGroup]):
    with self._lock:
      for g in groups:
        self.outstanding.discard(g.columns["stream_index"])

  def state(self) -> dict[str, Any]:
    with self._lock:
      return {"position": self.position, "outstanding": sorted(self.outstanding | set(self._replay))}


def request_for(record: dict, **extra) -> PromptRequest:
  """A pipeline record as a request; its other columns (and `extra`) reach the reward functions."""
  columns = {k: v for k, v in record.items() if k not in NOT_COLUMNS}
  return PromptRequest(prompt_id=record["id"], token_ids=np.asarray(record["prompt_token_ids"], np.int32),
                       columns={**columns, **extra}, prompt_text=record["prompt_text"])


def requests_for(records) -> list[PromptRequest]:
  return [request_for(r) for r in records]
