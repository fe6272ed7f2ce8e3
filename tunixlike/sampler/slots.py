"""The decode slots: the engine's decode state and, per slot, what decodes there (an occupant of
the episode strategy's kind, or None when free), kept in step as sequences are inserted, moved,
preempted and finished; and the collection of each generate call's tokens into the occupants."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from tunixlike.sampler.driver_api import DriverError, DriverStats
from tunixlike.sampler.engine_api import EngineAPI


class Slots:
  """`engine.max_concurrent_decodes` slots; `slots[i]` is slot i's occupant (None: free)."""

  def __init__(self, engine: EngineAPI, version: int):
    self.engine = engine
    self.state = engine.init_decode_state(version)
    self._infos: list[Any | None] = [None] * engine.max_concurrent_decodes

  def __len__(self) -> int:
    return len(self._infos)

  def __iter__(self) -> Iterator[Any | None]:
    return iter(self._infos)

  def __getitem__(self, slot: int) -> Any | None:
    return self._infos[slot]

  def __setitem__(self, slot: int, info: Any | None) -> None:
    self._infos[slot] = info

  def free(self) -> list[int]:
    return [i for i, s in enumerate(self._infos) if s is None]

  @property
  def empty(self) -> bool:
    return all(s is None for s in self._infos)

  def reserve(self, stats: DriverStats) -> list[Any]:
    """Blocks for every live sequence's next call (a paged cache; the youngest are preempted when
    the pool runs dry): the preempted occupants, their slots freed."""
    self.state, preempted = self.engine.reserve(self.state)
    out = []
    for slot in preempted:
      out.append(self._infos[slot])
      self._infos[slot] = None
      stats.preemptions += 1
    return out

  def compact(self, stats: DriverStats) -> None:
    """Follows the engine's moves of live sequences to other slots (a paged cache packs them low)."""
    self.state, moves = self.engine.compact_slots(self.state)
    for src, dst in moves:
      self._infos[dst], self._infos[src] = self._infos[src], None
    stats.moves += len(moves)

  def move(self, src: int, dst: int, stats: DriverStats) -> None:
    """Moves the live sequence of slot `src` to the free slot `dst` (slot groups' `plan_insert`)."""
    self.state = self.engine.move(self.state, src, dst)
    self._infos[dst], self._infos[src] = self._infos[src], None
    stats.moves += 1

  def release(self, slot: int) -> None:
    """Stops decoding `slot` now and frees it."""
    self.state = self.engine.release(self.state, slot)
    self._infos[slot] = None

  def collect(self, host, episodes) -> None:
    """Hands a generate call's tokens (`host`, fetched) to the occupants through the episode
    strategy; a turn that ends frees its slot and goes to `episodes.finish`."""
    tokens_ks, logprobs_ks, valid_ks = host.tokens_ks, host.logprobs_ks, host.valid_ks
    version = int(host.version)
    eos = set(self.engine.config.eos_ids)
    for s, info in enumerate(self._infos):
      if info is None:
        continue
      finish = None
      for k in np.flatnonzero(valid_ks[:, s]):
        if finish is not None:  # decoded past a host-side stop string in this call: dropped
          continue
        token = int(tokens_ks[k, s])
        episodes.record(info, token, float(logprobs_ks[k, s]), version,
                        None if host.mask_ksw is None else host.mask_ksw[k, s])
        if host.routing_kslk is not None:
          info.routing.append(host.routing_kslk[k, s])
        finish = episodes.stop_reason(info, token, eos)
      if finish is None:
        if host.done_s[s]:
          raise DriverError(f"slot {s}: the device reports it done but the host saw no stop")
        continue
      self._infos[s] = None
      episodes.finish(s, info, finish)  # first: EnvEpisodes parks the slot's KV before release frees it
      if finish == "stop" and not host.done_s[s]:
        self.state = self.engine.release(self.state, s)
    self.state = self.engine.mark_finished(self.state, host.done_s)
    episodes.collected()
