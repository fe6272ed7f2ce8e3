"""Admission: the one loop every driver starts its groups with.

A group is admitted when nothing holds admission (a hold or a drain swap waits: `closed`), the
staleness bound allows it (`may_start(version)`, e.g. `RolloutQueue.try_admit`, asked once per
group with the version it would be sampled with) and the source has a prompt. The admitted group
gets the next start order (`seq`, which seeds its noise) and stays `in_flight` until its driver
emits it. What a group is (G samples, G environment episodes, G agent episodes) is the episode
strategy's: it passes `make_group`, and asks again while it has room.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import numpy as np

from tunixlike.sampler.driver_api import DriverError, DriverStats, PromptRequest
from tunixlike.sampler.engine import PromptError
from tunixlike.sampler.engine_api import EngineAPI


class Admission:
  """Prompts from `source` (None = nothing yet, try later; exhaustion ends it) become groups."""

  def __init__(self, engine: EngineAPI, source: Iterable[PromptRequest | None], *, stats: DriverStats,
               may_start: Callable[[int], bool] | None, closed: Callable[[], bool], first_seq: int):
    self.engine, self.config = engine, engine.config
    self._source: Iterator = iter(source)
    self._may_start = may_start or (lambda version: True)
    self._closed = closed
    self.stats = stats
    self.next_seq = int(first_seq)
    self.exhausted = False
    self.in_flight: dict[int, Any] = {}  # seq -> a group admitted and not yet emitted

  def admit(self, version: int, make_group: Callable[[int, PromptRequest, np.ndarray], Any]) -> Any | None:
    """The next group, `make_group(seq, request, prompt_ids)`, if admission allows and the source has one."""
    if self.exhausted or self._closed() or not self._may_start(version):
      return None
    try:
      request = next(self._source)
    except StopIteration:
      self.exhausted = True
      return None
    if request is None:
      return None
    group = make_group(self.next_seq, request, self.check_prompt(request))
    self.next_seq += 1
    self.in_flight[group.seq] = group
    return group

  def take_back(self, group) -> None:
    """A group admitted by an earlier run (a checkpoint kept it in flight)."""
    if group.seq >= self.next_seq:
      raise DriverError(f"resumed group {group.seq} starts after first_seq={self.next_seq}")
    self.in_flight[group.seq] = group

  def done(self, seq: int) -> None:
    """The group left the driver."""
    del self.in_flight[seq]

  def groups(self) -> list:
    """Groups admitted and not emitted, in start order."""
    return sorted(self.in_flight.values(), key=lambda g: g.seq)

  def check_prompt(self, request: PromptRequest) -> np.ndarray:
    """The request's prompt ids (the last `max_prefill_length` if too long and truncation is on)."""
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
