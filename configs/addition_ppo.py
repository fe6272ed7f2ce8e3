"""Async PPO with a learned critic on 2-digit addition: the GRPO job of addition_grpo.py, with a
value head on the policy trunk and per-token GAE advantages in place of group baselines.

Run: python -m tunixlike.train --config configs/addition_ppo.py --workdir runs/addition_ppo
Variants: :size=tiny (the test-suite size).
"""

import os

from tunixlike import config


def get_config(arg: str | None = None):
  variant = config.parse_arg(arg, size=("default", "tiny"))
  # Same task, model, warm start and runtime; loaded by path so this file works from any directory.
  c = config.load(os.path.join(os.path.dirname(__file__), "addition_grpo.py"), f"size={variant.size}")
  c.algo.estimator = "ppo"
  c.optim.share_prompts = False  # the critic's values and GAE are per row: a row per completion
  c.algo.gamma = 1.0  # one reward at the end of a short completion: no reason to discount
  c.algo.gae_lambda = 0.95
  c.algo.vf_coef = 0.1  # the value loss shapes the shared trunk; 0.5 (with a random-init head) collapsed to 0%
  c.algo.vf_clip = 0.2
  if variant.size == "default":
    c.rl.num_steps = 300  # the figures: README's results table, docs/benchmarks.md#the-ppo-job
    c.eval.every_steps = 50
  return c
