"""The episode-level buffer: `RolloutQueue`'s admission and staleness rule, per policy, over episodes.

The unit admitted, bounded and trained is the whole episode (every turn of every agent). With
versions v_p of each policy's weights on the sampler and L_p of its learner, an episode is admitted
only while, for every policy p,
    consumed_p + in_flight < (max_staleness + v_p + 1) * batch_episodes,
(consumed_p: episodes of the batches that advanced p), and a batch for learner versions L waits for
every running episode admitted at some v_p <= L_p - max_staleness. So each policy's tokens in a
trained episode are at most `max_staleness` versions behind that policy's learner, whatever the
interleaving of the two policies' turns and updates; an episode that is older anyway is dropped
(counted) and its admission freed.
"""

from __future__ import annotations

import threading
from typing import Callable, Mapping, Sequence

from tunixlike.multi_agent.coordinator import Episode
from tunixlike.rl.queue import RolloutQueue


class EpisodeQueue(RolloutQueue):
  """A bounded episode buffer; `try_admit` and `get_batch` take {policy: version} dicts."""

  def __init__(self, policies: Sequence[str], batch_episodes: int, max_staleness: int,
               stop_event: threading.Event | None = None, on_drop: Callable[[Episode], None] = lambda e: None,
               start_versions: Mapping[str, int] | None = None, counts: dict[str, int] | None = None):
    """`start_versions` and `counts` (`counts()` of the run being resumed): where a resumed run's policies and
    counters are."""
    super().__init__(batch_episodes, max_staleness, stop_event, on_drop, counts=counts)
    self.policies = tuple(policies)
    start = dict(start_versions or {})
    unknown = set(start) - set(self.policies)
    if unknown:
      raise ValueError(f"start_versions names policies {sorted(unknown)} not in {self.policies}")
    self._consumed = {p: start.get(p, 0) * batch_episodes for p in self.policies}

  def _versions(self, versions: Mapping[str, int]) -> tuple[int, ...]:
    missing = [p for p in self.policies if p not in versions]
    if missing:
      raise ValueError(f"versions {dict(versions)} lack policies {missing}")
    return tuple(int(versions[p]) for p in self.policies)

  def _running_key(self, versions: Mapping[str, int]) -> tuple[int, ...]:
    return self._versions(versions)

  def _admissible(self, versions: Mapping[str, int]) -> bool:
    return all(self._consumed[p] + self.in_flight < (self.max_staleness + v + 1) * self.batch_groups
               for p, v in zip(self.policies, self._versions(versions)))

  def _too_old(self, episode: Episode, learner: Mapping[str, int]) -> bool:
    return any(m is not None and m < learner[p] - self.max_staleness
               for p in self.policies for m in [episode.min_version(p)])

  def _last_chance(self, admitted: tuple[int, ...], learner: Mapping[str, int]) -> bool:
    return any(v <= learner[p] - self.max_staleness for p, v in zip(self.policies, admitted))

  def _age(self, episode: Episode):
    return episode.seq

  def _consume(self, episodes: int, learner_version) -> None:
    for p in self.policies:
      self._consumed[p] += episodes

  def step_skipped(self, episodes: int, policies: Sequence[str] | None = None) -> None:
    """The batch did not advance `policies` (default: all; e.g. a policy with no turns in it)."""
    with self._cond:
      for p in self.policies if policies is None else policies:
        self._consumed[p] -= episodes
      self._cond.notify_all()
