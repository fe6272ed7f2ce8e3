"""Self-play: a proposer policy writes 2-digit addition problems, a solver policy answers them.

Both policies start from the main job's warm start (configs/addition_grpo.py: the solver's format is
the addition task's, the answer least-significant digit first), then train on whole episodes, each
its own learner, sampler and version: the solver earns 1 per correct answer, the proposer
1 - |2p - 1| for the solver's solve rate p on its problem (docs/multi_agent.md). The evals measure the
solver on the addition task's held-out problems.
Run: python -m tunixlike.train --config configs/self_play.py --workdir runs/self_play
Variants: :size=tiny (the test-suite size).
"""

from tunixlike import config


def get_config(arg: str | None = None):
  variant = config.parse_arg(arg, size=("default", "tiny"))
  c = config.load("addition_grpo")  # the main job's task, model, warm start and sampler
  c.multi_agent.env = "self_play"
  c.multi_agent.policies = ({"name": "proposer", "group_size": 1},  # one problem per episode
                            {"name": "solver", "group_size": 4})  # 4 attempts: a GRPO group, and the solve rate
  c.multi_agent.episodes_per_step = 32  # 32 problems and 128 answers a step: 8 gave no measurable change in 40 steps
  c.multi_agent.eval_policy = "solver"
  # The main job's 5e-4 took the solver's held-out accuracy from 0.23 to 0.05 in 50 steps here (it
  # learns the proposer's few problems); at 1.25e-4 it ended at 0.19 and 0.23 in two runs
  # (docs/multi_agent.md#from-a-config).
  c.optim.learning_rate = 1.25e-4
  c.optim.share_prompts = False  # a batch's turns have many prompts: a row per completion
  c.rl.num_steps = 200  # about 20 s of RL on 2 CPU cores after the warm start's 50 s
  c.eval.every_steps = 50
  c.checkpoint.every_steps = 50
  if variant.size == "tiny":  # the end-to-end tests: a few steps, no warm start
    c.rl.num_steps = 3
    c.warm_start.max_steps = 0
    c.multi_agent.episodes_per_step = 4
    c.data.num_eval_examples = 16
    c.data.train_size = 256
  return c
