"""Several policies trained in one run on episodes: each learner on its own turns, each synced on its own.

    coordinator thread (+ one driver thread per policy)        main thread (learners)
    admit episode -> turns on each policy's driver -> env ->  EpisodeQueue.get_batch({p: L_p})
          ^                                                  -> per policy: its turns' groups, advantages,
          +---- update_params(p, weights, L_p) <------------     one optimizer step, weight sync

A batch is `batch_episodes` whole episodes (every turn of every agent). Each policy takes one
optimizer step on the groups of its own turns in the batch (a policy with none skips, and its
admissions are given back); the batch's one-sample turns of a policy (e.g. every proposer turn,
all from the same prompt) are pooled into one group for the advantage estimator, so a
group-relative advantage has a baseline. The episode queue bounds each policy's staleness; `max_staleness=0` is the synchronous
loop: one batch of episodes in flight at a time.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Sequence

import numpy as np

from tunixlike.learner import group_advantages
from tunixlike.multi_agent.buffer import EpisodeQueue
from tunixlike.multi_agent.coordinator import Episode, EpisodeCoordinator
from tunixlike.rl import loop
from tunixlike.rl.policy import Policy
from tunixlike.rollout import RolloutGroup


def set_advantages(groups: Sequence[RolloutGroup], cfg: group_advantages.AdvantageConfig) -> None:
  """Advantages of one policy's turn groups in a batch. A group of several samples is its own
  baseline; the one-sample turns of the batch are pooled into one group for the estimator (every
  proposer turn has the same prompt, so the pool is a GRPO group of the batch's proposals)."""
  singles = [g for g in groups if g.group_size == 1]
  for g in groups:
    if g.group_size > 1:
      group_advantages.set_advantages(g, cfg)
  if not singles:
    return
  if len(singles) == 1:  # no baseline to compare with: no gradient from it
    g = singles[0]
    g.shaped_rewards, g.advantages, g.token_advantages = g.rewards.astype(np.float32), np.zeros(1, np.float32), None
    return
  pool = RolloutGroup(prompt_id=None, prompt_token_ids=singles[0].prompt_token_ids,
                      completions=[g.completions[0] for g in singles],
                      rewards=np.concatenate([g.rewards for g in singles]).astype(np.float32))
  group_advantages.set_advantages(pool, cfg)
  for i, g in enumerate(singles):
    g.shaped_rewards, g.advantages = pool.shaped_rewards[i:i + 1], pool.advantages[i:i + 1]
    g.token_advantages = None if pool.token_advantages is None else [pool.token_advantages[i]]


class MultiAgentRuntime:
  """Runs `num_steps` learner steps over episodes; see the module docstring.

  `make_coordinator(sink, may_start_episode)` builds the `EpisodeCoordinator` (not running) whose
  drivers start from `policies[p]`'s weights and version.
  """

  def __init__(self, policies: dict[str, Policy], make_coordinator: Callable[..., EpisodeCoordinator], *,
               batch_episodes: int, max_staleness: int, advantages: group_advantages.AdvantageConfig,
               wait_timeout_s: float, counts: dict[str, int] | None = None):
    self.policies, self.advantages, self.wait_timeout_s = policies, advantages, wait_timeout_s
    self.stop_event = threading.Event()
    self.queue = EpisodeQueue(tuple(policies), batch_episodes, max_staleness, self.stop_event,
                              start_versions={p: pol.version for p, pol in policies.items()}, counts=counts)
    self.coordinator = make_coordinator(sink=self.queue.put, may_start_episode=self.queue.try_admit)
    differ = set(self.coordinator.policies) ^ set(policies)
    if differ:
      raise ValueError(f"the coordinator's policies {self.coordinator.policies} and the learners' "
                       f"{tuple(policies)} differ in {sorted(differ)}")
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self.episode_wall_s: collections.deque[float] = collections.deque(maxlen=4096)  # admission to end
    self.turn_tokens = {p: collections.deque(maxlen=4096) for p in policies}  # completion lengths per policy
    self.episode_tokens: collections.deque[int] = collections.deque(maxlen=4096)  # per trained episode

  # ---- the sampling side, as the loop drives it (rl/loop.py) -----------------------------------
  def _coordinate(self) -> None:
    try:
      self.coordinator.run(max_wall_s=float("inf"))
    except BaseException as e:  # re-raised on the learner thread
      self._error = e
      self.stop_event.set()

  def start_sampling(self) -> None:
    self._thread = threading.Thread(target=self._coordinate, name="multi-agent-coordinator", daemon=True)
    self._thread.start()

  def check(self) -> None:
    if self._error is not None:
      raise RuntimeError(f"multi-agent sampling failed: {self._error!r}") from self._error

  def sample_inline(self) -> None:
    """Sync mode without a coordinator thread: run episodes in this thread until a batch is ready."""
    deadline = time.monotonic() + self.wait_timeout_s
    while self.queue.depth() < self.queue.batch_groups:
      if time.monotonic() > deadline:
        raise TimeoutError(f"no batch of episodes within rl.wait_timeout_s={self.wait_timeout_s}")
      if not self.coordinator.advance():
        time.sleep(0.001)  # env calls still running

  def stop_sampling(self) -> None:
    self.stop_event.set()
    self.coordinator.stop()
    if self._thread is not None:
      self._thread.join(self.wait_timeout_s)
    else:
      self.coordinator.close()

  def versions(self) -> dict[str, int]:
    return {p: pol.version for p, pol in self.policies.items()}

  def next_batch(self) -> list[Episode]:
    """The next batch of episodes for the learners' current versions (waits up to wait_timeout_s)."""
    return self.queue.get_batch(self.versions(), self.wait_timeout_s)

  def train_batch(self, episodes: list[Episode]) -> dict[str, float]:
    """One step of each policy with turns in `episodes`; returns the step's metrics."""
    episodes = sorted(episodes, key=lambda e: e.seq)  # deterministic, whatever order they finished in
    metrics: dict[str, float] = {}
    t0 = time.monotonic()
    for name, policy in self.policies.items():
      groups = [g for e in episodes for g in e.groups_of(name)]
      if not groups:
        self.queue.step_skipped(len(episodes), [name])
        continue
      set_advantages(groups, self.advantages)
      self.turn_tokens[name].extend(c.num_tokens for g in groups for c in g.completions)
      version = policy.version
      out = policy.train(groups)
      if out.get("skipped"):
        self.queue.step_skipped(len(episodes), [name])
      synced = policy.sync_weights()
      self.coordinator.update_params(name, synced.params, synced.version)
      sync_ms = synced.ms
      rewards = np.concatenate([g.rewards for g in groups])
      lags = [version - int(c.policy_versions.min()) for g in groups for c in g.completions if c.num_tokens]
      metrics.update({f"{name}/loss": float(out.get("loss", 0.0)), f"{name}/reward": float(rewards.mean()),
                      f"{name}/turns": float(len(groups)),
                      f"{name}/staleness_max": float(max(lags, default=0)), f"{name}/sync_ms": sync_ms,
                      f"{name}/version": float(policy.version)})
    metrics["learner/step_s"] = time.monotonic() - t0  # every policy's train step and weight sync
    walls = np.array([e.wall_s for e in episodes])
    self.episode_wall_s.extend(walls.tolist())
    self.episode_tokens.extend(e.num_tokens for e in episodes)
    metrics.update({"episodes/finished_done": float(np.mean([e.finish_reason == "done" for e in episodes])),
                    "episodes/wall_s_median": float(np.median(walls)),
                    "episodes/wall_s_p90": float(np.percentile(walls, 90))})
    return metrics

  def run(self, num_steps: int, on_step: Callable[[int, dict], None] = lambda step, m: None, *,
          threaded: bool = True) -> dict[str, float]:
    """Trains `num_steps` batches (the loop of `rl/loop.py`, as the single-policy runtime); returns
    the last step's metrics with `wall_s` and `episodes_per_s`. `threaded=False` (max_staleness 0)
    runs the episodes of each batch in this thread first: the synchronous loop that the threaded
    runtime at staleness 0 must reproduce."""
    trained = [0]

    def train(step: int, episodes: list[Episode], wait_s: float) -> dict[str, float]:
      metrics = self.train_batch(episodes)
      trained[0] += len(episodes)
      on_step(step, metrics)
      return metrics

    out = loop.run_steps(num_steps, self, self.next_batch, train,
                         threaded=threaded, max_staleness=self.queue.max_staleness)
    return {**out, "episodes_per_s": trained[0] / out["wall_s"]}
