"""Sampler and learner side by side: the async RL loop.

    driver thread (sampler submesh)    reward pool (threads)        main thread (learner submesh)
    admit -> prefill/insert/generate -> score group -> queue.put -> get_batch -> train step
          ^                                                                         |
          +------------- update_params(version) <- device_put weight sync ----------+

The learner never waits for more than the staleness bound requires (admission control in
`RolloutQueue`), and the sampler keeps decoding while the learner trains. `max_staleness=0` is the
synchronous baseline: the same code, one batch in flight. In the colocated layout (`mesh.layout`)
the train step with its weight sync and the driver's calls take turns on the shared devices
(`device_turns.DeviceTurns`). With `rl.deterministic` the queue is a `lockstep.LockstepQueue`: the
weights go to it, not to the driver, which takes them when its round is done. An error in any thread
stops everything and is re-raised in the main thread with its original traceback; every wait has a
timeout.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

from tunixlike import device_turns
from tunixlike.rl.collapse import CollapseDetector
from tunixlike.rl.config import RuntimeConfig
from tunixlike.rl.hooks import Hooks, StepInfo
from tunixlike.rl import loop
from tunixlike.rl.queue import RolloutQueue
from tunixlike.rollout import RolloutGroup, truncated_share

if TYPE_CHECKING:
  from tunixlike.rl.policy import Policy


class Driver(Protocol):
  """What the runtime needs of a rollout driver (`sampler.driver.RolloutDriver` and its subclasses)."""

  stats: Any

  def start(self) -> None: ...
  def step(self) -> bool: ...
  def check(self) -> None: ...
  def stop(self, timeout_s: float) -> None: ...
  def update_params(self, params, version: int, *, drain: bool = False) -> None: ...


class NonFiniteLoss(FloatingPointError):
  pass


def _has_variance(group: RolloutGroup) -> bool:
  return float(np.ptp(group.rewards)) > 1e-6


def _all_solved(group: RolloutGroup) -> bool:
  """Every completion correct by the first reward (its group mean, `accuracy`, is 1) and nothing else
  tells them apart: a solved prompt, no gradient."""
  return group.reward_metrics.get("accuracy", 0.0) >= 1.0 and not _has_variance(group)


class RewardStage:
  """The driver's sink: each finished group is scored on a pool of reward threads (`score(group)`
  fills its rewards and advantages), then put into the queue. A scoring crash (not a failing reward
  fn: those score 0) stops the queue and is re-raised by `check`."""

  def __init__(self, score: Callable[[RolloutGroup], None], queue: RolloutQueue, workers: int):
    self._score, self._queue = score, queue
    self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="reward")
    self._errors: list[BaseException] = []
    self._idle = threading.Condition()
    self._held: dict[int, RolloutGroup] = {}  # id -> a group submitted and not yet in the queue

  def __call__(self, group: RolloutGroup) -> None:
    with self._idle:
      self._held[id(group)] = group
    self._pool.submit(self._score_and_enqueue, group)

  def held(self) -> list[RolloutGroup]:
    """The finished groups not yet in the queue (scoring, or waiting for a reward thread)."""
    with self._idle:
      return list(self._held.values())

  def wait_idle(self, timeout_s: float) -> bool:
    """Waits (bounded) until every group handed in is in the queue."""
    with self._idle:
      return self._idle.wait_for(lambda: not self._held or self._errors, timeout_s) and not self._errors

  def _score_and_enqueue(self, group: RolloutGroup):
    try:
      self._score(group)
      self._queue.put(group)
    except BaseException as e:
      self._errors.append(e)
      self._queue.stop_event.set()
    finally:
      with self._idle:
        del self._held[id(group)]
        self._idle.notify_all()

  def check(self) -> None:
    if self._errors:
      raise self._errors[0]

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)


class AsyncRuntime:
  """Runs `num_steps` learner steps (default `cfg.num_steps`; a resumed run: those left) from the
  policy's version, with the driver in its own thread.

  Built in this order, each part handed to the next: the `queue` (admission from the policy's
  version); the `rewards` stage that feeds it; the `driver` (not started), whose sink is `rewards`
  and which asks `queue.try_admit` before each group; then this loop. After each step it calls
  `policy.sync_weights()` and hands the weights with their version to the driver. Periodic work
  (metrics, evals, checkpoints, preemption) goes in `self.hooks`; `request_stop()` ends the run
  after the current step. `collapse` flags a collapsed policy in the metrics (`collapse`: 1).
  `turns` (the colocated layout; the driver's too) makes the train step with its weight sync and
  the sampler's calls alternate on the devices. With whole sampler hosts the driver is
  `hosts.learner_host.RemoteSampling` and there is no reward stage here (`rewards` None): the
  sampler hosts score what they send.
  """

  def __init__(self, cfg: RuntimeConfig, *, queue: RolloutQueue, rewards: RewardStage | None, driver: Driver,
               policy: Policy, collapse: CollapseDetector | None = None, num_steps: int | None = None,
               turns: device_turns.DeviceTurns | None = None):
    self.cfg, self.queue, self.rewards, self.driver, self.policy = cfg, queue, rewards, driver, policy
    self._collapse = collapse
    self.num_steps = cfg.num_steps if num_steps is None else num_steps
    self.hooks = Hooks()
    self._stop_requested = False
    self.stop_event = queue.stop_event
    self.preempted = False
    self.stopped_by_hook = False  # a hook called `info.stop()`
    self.turns = device_turns.NO_TURNS if turns is None else turns
    self.learner_busy_s = 0.0
    self.sync_ms: list[float] = []
    self.on_batch: Callable[[list[RolloutGroup]], None] = lambda groups: None  # as the learner takes a batch
    # Versions whose weights the sampler takes drained and then holds until released (replay points).
    self.hold_at: Callable[[int], bool] = lambda version: False

  def request_stop(self, *, finish: bool = False) -> None:
    """Stop after the current step: a preemption (`preempted`: the run resumes later) or, with
    `finish=True` (a hook's `info.stop()`), the end of the run (the final eval and checkpoint follow)."""
    self._stop_requested = True
    self.stopped_by_hook = finish

  # ---- the sampling side, as the loop drives it (rl/loop.py) -----------------------------------
  def start_sampling(self) -> None:
    self.driver.start()

  def check(self) -> None:
    self.driver.check()
    if self.rewards is not None:
      self.rewards.check()

  def sample_inline(self) -> None:
    """Sync mode without a sampler thread: decode in this thread until a batch is ready."""
    deadline = time.monotonic() + self.cfg.wait_timeout_s
    while self.queue.depth() < self.cfg.prompts_per_step:
      self.check()
      if time.monotonic() > deadline:
        raise TimeoutError(f"sync mode: no full batch within rl.wait_timeout_s={self.cfg.wait_timeout_s}")
      if not self.driver.step():
        time.sleep(0.001)  # everything decoded; rewards still being scored

  def stop_sampling(self) -> None:
    self.stop_event.set()
    self.driver.stop(timeout_s=self.cfg.wait_timeout_s)
    if self.rewards is not None:
      self.rewards.close()

  # ---- the loop (main thread) -------------------------------------------------------------
  def run(self, *, threaded: bool = True) -> dict[str, float]:
    """`threaded=False` steps the sampler in this thread (needs max_staleness=0): the reference
    synchronous loop that the threaded runtime at staleness 0 must reproduce exactly."""
    cfg = self.cfg
    keep = _has_variance if cfg.dynamic_sampling else None
    self.begin()

    def should_stop() -> bool:
      if self._stop_requested:
        self.preempted = not self.stopped_by_hook
      return self._stop_requested

    def next_batch() -> list[RolloutGroup]:
      groups = self.queue.get_batch(self.policy.version, cfg.wait_timeout_s, keep=keep)
      self.on_batch(groups)
      return groups

    out = loop.run_steps(self.num_steps, self, next_batch, self.train, threaded=threaded,
                         max_staleness=cfg.max_staleness, should_stop=should_stop, before_stop=self._settle)
    return {**out, "preempted": self.preempted, "stopped_by_hook": self.stopped_by_hook}

  def _settle(self) -> None:
    """rl.deterministic: what the final checkpoint keeps is taken while the sampler still runs."""
    if self.cfg.deterministic:
      self.queue.carry_over(self.cfg.wait_timeout_s)

  def begin(self) -> None:
    """Where the step metrics' rates count from (`run` calls it; a replay steps `train` itself)."""
    self._t_start = time.monotonic()
    self._tokens_before = self.driver.stats.tokens_generated
    self._busy_before = self.driver.stats.busy_time_s
    self._draft_before = self.driver.stats.draft_s
    self._nonfinite_in_a_row = 0

  def train(self, step: int, groups: list[RolloutGroup], wait_s: float) -> dict[str, float]:
    """One learner step on a batch of groups, the weight sync, the step's metrics and its hooks."""
    cfg = self.cfg
    # Deterministic batch order (start order), whatever order the reward pool finished in.
    groups.sort(key=lambda g: g.columns.get("stream_index", 0))
    version = self.policy.version
    batch = self.policy.assemble(groups)  # host work: the sampler may still use the devices
    with self.turns.learner():
      t1 = time.monotonic()  # after the turn's wait: that is the sampler's device time
      metrics = self.policy.train_batch(batch)
      train_s = time.monotonic() - t1
      synced = self.policy.sync_weights()
      if cfg.deterministic:  # the sampler swaps when its round is done (rl/lockstep.py)
        self.queue.hand_over(synced.params, synced.version)
      elif self.hold_at(synced.version):  # a replay point: the sampler drains and waits for the checkpoint
        self.driver.update_params(synced.params, synced.version, hold=True)
      else:
        self.driver.update_params(synced.params, synced.version, drain=cfg.sync_mode == "drain")
    self.learner_busy_s += train_s
    self.sync_ms.append(synced.ms)
    if not math.isfinite(float(metrics.get("loss", 0.0))) or metrics.get("skipped", 0):
      self._nonfinite_in_a_row += 1
      self.queue.step_skipped(len(groups))  # the same version needs a new batch: admit one
      if self._nonfinite_in_a_row >= cfg.max_nonfinite_steps:
        raise NonFiniteLoss(f"non-finite loss at step {version} ({self._nonfinite_in_a_row} in a row; "
                            "rl.max_nonfinite_steps): lower optim.learning_rate or check the data")
    else:
      self._nonfinite_in_a_row = 0
    collapsed = self._collapse.check(metrics) if self._collapse is not None else None
    metrics["collapse"] = float(collapsed is not None)
    wall = time.monotonic() - self._t_start
    stats = self.driver.stats
    lags = np.array([version - g.min_version for g in groups])
    rewards = np.concatenate([g.rewards for g in groups]).astype(np.float64)  # float32's sums can overflow
    metrics.update({
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
        # GRPO's advantages are 0 in a group whose rewards are all equal: no gradient from it.
        "frac_reward_zero_std": float(np.mean([not _has_variance(g) for g in groups])),
        "groups/all_zero_reward": int(sum(not np.any(g.rewards) for g in groups)),
        "groups/all_solved": int(sum(_all_solved(g) for g in groups)),
        "completions/truncated": truncated_share(groups),
        "staleness/min": int(lags.min()), "staleness/mean": float(lags.mean()),
        "staleness/max": int(lags.max()), "learner/step_s": train_s, "learner/wait_s": wait_s,
        "learner/busy_frac": self.learner_busy_s / wall,
        "sampler/busy_frac": (stats.busy_time_s - self._busy_before) / wall,
        "sampler/tokens_per_s": (stats.tokens_generated - self._tokens_before) / wall,
        "sampler/slot_occupancy": stats.slot_occupancy, "sampler/preemptions": stats.preemptions,
        **({"sampler/draft_acceptance": stats.draft_acceptance, "sampler/tokens_per_decode_step":
            stats.tokens_per_decode_step, "sampler/verify_calls": stats.verify_calls,
            "sampler/draft_frac": (stats.draft_s - self._draft_before) / wall} if stats.drafts else {}),
        "sync/ms": synced.ms, "deterministic": int(cfg.deterministic),
        "nonfinite_in_a_row": self._nonfinite_in_a_row, **self.queue.stats(),
    })
    for name in sorted({k for g in groups for k in g.reward_metrics}):
      values = [g.reward_metrics[name] for g in groups if name in g.reward_metrics]
      metrics[name] = float(np.mean(values)) if "failures" not in name else float(np.sum(values))
    self.hooks.run(StepInfo(version, self.policy.version, metrics, groups, self.queue.take_dropped(),
                            collapse=collapsed, stop=lambda: self.request_stop(finish=True)))
    return metrics
