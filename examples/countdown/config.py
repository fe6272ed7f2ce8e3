"""Async GRPO on Countdown: reach the target from three numbers with + - * / and parentheses.

A user dataset (train.jsonl / test.jsonl, written by make_data.py) and user rewards (rewards.py):
the example of docs/own_data.md. Paths starting with ./ are relative to this file.
Run: python -m tunixlike.train --config examples/countdown/config.py --workdir runs/countdown
Variants: :size=tiny (the test-suite size).
"""

from tunixlike import config


def get_config(arg: str | None = None):
  variant = config.parse_arg(arg, size=("default", "tiny"))
  c = config.default_config_dict()
  c.data.task = None  # not a built-in task: the prompts come from data.train
  c.data.train = "./train.jsonl"  # 1725 problems; make_data.py writes them
  c.data.eval = "./test.jsonl"  # 200 problems never seen in train (None would carve a split from train)
  c.data.prompt_field = "problem"  # the column holding the prompt text, e.g. "3 5 7 to 22:"
  c.data.num_eval_examples = 200  # all of test.jsonl
  c.data.max_prompt_length = 24  # prompts are at most 13 tokens with <bos>; longer ones are filtered and counted
  c.sampler.max_prefill_length = 32  # the power-of-two bucket above data.max_prompt_length
  c.sampler.max_new_tokens = 20  # a solution has at most 14 characters ("9*9=81,81+9=90"); room for a longer try
  c.data.answer_field = "solution"  # the supervised warm start learns these (one solution per problem)
  c.warm_start.max_steps = 2000  # stops at warm_start.target_accuracy long before (about 750 steps)
  c.warm_start.target_accuracy = 0.15  # RL learns from there
  c.warm_start.eval_every = 25
  c.rewards = [
      dict(fn="./rewards.py:correct", weight=1.0),  # first = the evals' 0/1 accuracy
      dict(fn="./rewards.py:well_formed", weight=0.1),  # small shaping: any line of steps beats junk
  ]
  # Samples nearer the greedy answer than at 1: the updates rank the few solutions the model
  # already weighs, which is what moves its greedy (held-out) answer (docs/benchmarks.md).
  c.sampler.temperature = 0.7
  c.optim.share_prompts = True  # a learner row per group (its prompt once, then its 8 answers): as configs/addition_grpo.py
  # 5e-4 (the addition job's rate) first unlearned the warm start (held-out 16% -> 9.5% at step 100)
  # before it relearned; 2e-4 with a 20-step warm-up (no full-size first Adam steps) rose steadily.
  c.optim.learning_rate = 2e-4
  c.optim.warmup_steps = 20
  c.optim.schedule = "cosine"  # ends on a plateau instead of swinging between evals, as configs/addition_grpo.py
  c.rl.num_steps = 800  # held-out accuracy still rose at 600 (docs/benchmarks.md)
  c.eval.every_steps = 200  # a held-out curve, not just two points
  if variant.size == "tiny":  # the end-to-end test: a couple of steps only (the default model is already tiny)
    c.warm_start.max_steps = 4
    c.warm_start.eval_every = 2
    c.rl.num_steps = 3
    c.optim.warmup_steps = 0  # cosine needs it under rl.num_steps, which tests set as low as 1
    c.rl.prompts_per_step = 8
    c.data.num_eval_examples = 16
    c.eval.every_steps = 2  # an eval mid-run too, whose line the test finds on the console
  return c
