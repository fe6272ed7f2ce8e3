"""The optax optimizer: AdamW with a learning-rate schedule and global-norm gradient clipping."""

from __future__ import annotations

import optax

from tunixlike.learner.config import OptimConfig


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
  """Linear warmup (0 -> lr over warmup_steps), then constant or cosine to 0 at total_steps."""
  if cfg.learning_rate is None:
    raise ValueError("optim.learning_rate is None: a run chooses it at start-up by what it starts from "
                     "(`rl.starting_point`); elsewhere set it, e.g. OptimConfig(learning_rate=2e-4)")
  if cfg.schedule == "cosine":
    if not cfg.total_steps:  # a run value (OptimConfig checks it against warmup_steps once it is set)
      raise ValueError("rl.num_steps: the cosine schedule decays to 0 at the run's last step, but "
                       "OptimConfig.total_steps was not set from it")
    return optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps, cfg.total_steps)
  if cfg.warmup_steps:
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps), optax.constant_schedule(cfg.learning_rate)],
        [cfg.warmup_steps])
  return optax.constant_schedule(cfg.learning_rate)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  """With optim.updates_per_batch = K, optax counts K updates per RL step: the schedule (warm-up,
  cosine end) is read at count // K, so it stays in RL steps."""
  parts = []
  if cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip))
  schedule, k = make_schedule(cfg), cfg.updates_per_batch
  lr = schedule if k == 1 else (lambda count: schedule(count // k))
  parts.append(optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
  return optax.chain(*parts)
