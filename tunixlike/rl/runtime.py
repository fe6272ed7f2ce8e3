"""Sampler and learner side by side: the async RL loop.

    driver thread (sampler submesh)    reward pool (threads)        main thread (learner submesh)
    admit -> prefill/insert/generate -> score group -> queue.put -> get_batch -> train step
          ^                                                                         |
          +------------- update_params(version) <- device_put weight sync ----------+

The learner never waits for more than the staleness bound requires (admission control in
`RolloutQueue`), and the sampler keeps decoding while the learner trains. `max_staleness=0` is the
synchronous baseline: the same code, one batch in flight. In the colocated layout (`mesh.layout`)
the train step with its weight sync and the driver's calls take turns on the shared devices
(`device_turns.DeviceTurns`). An error in any thread stops everything and is re-raised in the main
thread with its original traceback; every wait has a timeout.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from tunixlike import device_turns
from tunixlike.rl.collapse import CollapseDetector
from tunixlike.rl.config import RuntimeConfig
from tunixlike.rl.hooks import Hooks, StepInfo
from tunixlike.rl.queue import RolloutQueue, Stopped
from tunixlike.rollout import RolloutGroup

if TYPE_CHECKING:
  from tunixlike.rl.policy import Policy


class NonFiniteLoss(FloatingPointError):
  pass


def _has_variance(group: RolloutGroup) -> bool:
  return float(np.ptp(group.rewards)) > 1e-6


class AsyncRuntime:
  """Runs `num_steps` learner steps (default `cfg.num_steps`; a resumed run: those left) from the
  learner's version, with the driver in its own thread."""

  def __init__(self, cfg: RuntimeConfig, *, driver_factory: Callable[..., Any], policy: Policy,
               score: Callable[[RolloutGroup], None], collapse: CollapseDetector | None = None,
               queue_counts: dict[str, int] | None = None, num_steps: int | None = None,
               turns: device_turns.DeviceTurns | None = None):
    """`driver_factory(sink, may_start_group)` builds the RolloutDriver (not started).

    `score(group)` is the reward stage (runs in the reward pool): it fills `group.rewards` and the
    advantages. Periodic work (metrics, evals, checkpoints, preemption) goes in `self.hooks`;
    `request_stop()` ends the run after the current step. `collapse` flags a collapsed policy in
    the metrics (`collapse`: 1). The queue's admission starts from the policy's version;
    `queue_counts` (a checkpoint's `queue.counts()`) continues its counters. `turns` (the colocated
    layout) makes the train step with its weight sync and the sampler's calls alternate on the devices.
    """
    self.cfg, self.policy, self._score, self._collapse = cfg, policy, score, collapse
    self.num_steps = cfg.num_steps if num_steps is None else num_steps
    self.hooks = Hooks()
    self._stop_requested = False
    self._dropped: list[RolloutGroup] = []
    self.stop_event = threading.Event()
    self.queue = RolloutQueue(cfg.prompts_per_step, cfg.max_staleness, self.stop_event,
                              on_drop=self._dropped.append, start_version=policy.version, counts=queue_counts)
    self.preempted = False
    self.stopped_by_hook = False  # a hook called `info.stop()`
    self._errors: list[BaseException] = []
    self._pool = concurrent.futures.ThreadPoolExecutor(cfg.reward_workers, thread_name_prefix="reward")
    self.driver = driver_factory(sink=self._on_group,
                                 may_start_group=lambda: self.queue.try_admit(self.driver.version))
    self.turns = device_turns.NO_TURNS if turns is None else turns
    self.driver.turns = self.turns
    self.learner_busy_s = 0.0
    self.sync_ms: list[float] = []

  def request_stop(self, *, finish: bool = False) -> None:
    """Stop after the current step: a preemption (`preempted`: the run resumes later) or, with
    `finish=True` (a hook's `info.stop()`), the end of the run (the final eval and checkpoint follow)."""
    self._stop_requested = True
    self.stopped_by_hook = finish

  # ---- sampler side (driver thread, reward pool) ----------------------------------------------
  def _on_group(self, group: RolloutGroup):
    self._pool.submit(self._score_and_enqueue, group)

  def _score_and_enqueue(self, group: RolloutGroup):
    try:
      self._score(group)
      self.queue.put(group)
    except BaseException as e:  # a scoring crash (not a failing reward fn: those score 0) stops the run
      self._fail(e)

  def _fail(self, e: BaseException):
    self._errors.append(e)
    self.stop_event.set()

  def _check(self):
    self.driver.check()
    if self._errors:
      raise self._errors[0]

  def _step_sampler_inline(self, deadline: float):
    """Sync mode without a sampler thread: decode in this thread until a batch is ready."""
    while self.queue.depth() < self.cfg.prompts_per_step:
      self._check()
      if time.monotonic() > deadline:
        raise TimeoutError(f"sync mode: no full batch within rl.wait_timeout_s={self.cfg.wait_timeout_s}")
      if not self.driver.step():
        time.sleep(0.001)  # everything decoded; rewards still being scored

  # ---- learner side (main thread) -------------------------------------------------------------
  def run(self, *, threaded: bool = True) -> dict[str, float]:
    """`threaded=False` steps the sampler in this thread (needs max_staleness=0): the reference
    synchronous loop that the threaded runtime at staleness 0 must reproduce exactly."""
    cfg = self.cfg
    if not threaded and cfg.max_staleness != 0:
      raise ValueError("run(threaded=False) is the synchronous loop: it needs max_staleness=0")
    keep = _has_variance if cfg.dynamic_sampling else None
    t_start = time.monotonic()
    tokens_before = self.driver.stats.tokens_generated
    busy_before = self.driver.stats.busy_time_s
    nonfinite_in_a_row = 0
    last: dict[str, float] = {}
    if threaded:
      self.driver.start()
    try:
      for _ in range(self.num_steps):
        if self._stop_requested:
          self.preempted = not self.stopped_by_hook
          break
        self._check()
        t0 = time.monotonic()
        if not threaded:
          self._step_sampler_inline(t0 + cfg.wait_timeout_s)
        groups = self.queue.get_batch(self.policy.version, cfg.wait_timeout_s, keep=keep)
        self._check()
        wait_s = time.monotonic() - t0
        # Deterministic batch order (start order), whatever order the reward pool finished in.
        groups.sort(key=lambda g: g.columns.get("stream_index", 0))
        version = self.policy.version
        batch = self.policy.assemble(groups)  # host work: the sampler may still use the devices
        with self.turns.learner():
          t1 = time.monotonic()  # after the turn's wait: that is the sampler's device time
          metrics = self.policy.train_batch(batch)
          train_s = time.monotonic() - t1
          params, sync_ms = self.policy.sampler_weights()
          self.driver.update_params(params, self.policy.version, drain=cfg.sync_mode == "drain")
        self.learner_busy_s += train_s
        self.sync_ms.append(sync_ms)
        if not math.isfinite(float(metrics.get("loss", 0.0))) or metrics.get("skipped", 0):
          nonfinite_in_a_row += 1
          self.queue.step_skipped(len(groups))  # the same version needs a new batch: admit one
          if nonfinite_in_a_row >= cfg.max_nonfinite_steps:
            raise NonFiniteLoss(f"non-finite loss at step {version} ({nonfinite_in_a_row} in a row; "
                                "rl.max_nonfinite_steps): lower optim.learning_rate or check the data")
        else:
          nonfinite_in_a_row = 0
        collapsed = self._collapse.check(metrics) if self._collapse is not None else None
        metrics["collapse"] = float(collapsed is not None)
        wall = time.monotonic() - t_start
        stats = self.driver.stats
        lags = np.array([version - g.min_version for g in groups])
        rewards = np.concatenate([g.rewards for g in groups])
        metrics.update({
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            # GRPO's advantages are 0 in a group whose rewards are all equal: no gradient from it.
            "frac_reward_zero_std": float(np.mean([not _has_variance(g) for g in groups])),
            "groups/all_zero_reward": int(sum(not np.any(g.rewards) for g in groups)),
            "staleness/min": int(lags.min()), "staleness/mean": float(lags.mean()),
            "staleness/max": int(lags.max()), "learner/step_s": train_s, "learner/wait_s": wait_s,
            "learner/busy_frac": self.learner_busy_s / wall,
            "sampler/busy_frac": (stats.busy_time_s - busy_before) / wall,
            "sampler/tokens_per_s": (stats.tokens_generated - tokens_before) / wall,
            "sampler/slot_occupancy": stats.slot_occupancy, "sampler/preemptions": stats.preemptions,
            "sync/ms": sync_ms,
            "nonfinite_in_a_row": nonfinite_in_a_row, **self.queue.stats(),
        })
        for name in sorted({k for g in groups for k in g.reward_metrics}):
          values = [g.reward_metrics[name] for g in groups if name in g.reward_metrics]
          metrics[name] = float(np.mean(values)) if "failures" not in name else float(np.sum(values))
        dropped, self._dropped[:] = list(self._dropped), []
        self.hooks.run(StepInfo(version, self.policy.version, metrics, groups, dropped, collapse=collapsed,
                                stop=lambda: self.request_stop(finish=True)))
        last = metrics
    except Stopped:
      self._check()  # the original error of the thread that stopped the run
      raise
    finally:
      self.stop_event.set()
      self.driver.stop(timeout_s=cfg.wait_timeout_s)
      self._pool.shutdown(wait=False, cancel_futures=True)
    self._check()
    wall = time.monotonic() - t_start
    return {**last, "wall_s": wall, "preempted": self.preempted, "stopped_by_hook": self.stopped_by_hook}
