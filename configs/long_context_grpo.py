"""Async GRPO whose completions reach 16K tokens: the paged sampler, a packed long learner row, the
blockwise attention and context parallelism over the learner's 4 devices.

A random Qwen2-shaped checkpoint (benchmarks/scale.py --size long: hidden 64, 2 layers, a 65,536-row
embedding for a 1,024-token tokenizer) emits a stop token about once in 65,536 tokens, so most completions
run to the 16,384-token limit; the rewards are then all 0 (no gradient signal, warned about), but every
part of the step runs at that length: docs/learner.md#long-rows-end-to-end.
Run:
  python benchmarks/scale.py --write runs/long_ckpt --size long
  python -m tunixlike.train --config configs/long_context_grpo.py --config.model.hf_path=runs/long_ckpt \
      --workdir runs/long
"""

from tunixlike import config

COMPLETION = 16384


def get_config(arg: str | None = None):
  del arg
  c = config.default_config_dict()
  c.data.digits = 2  # the built-in addition task: its prompts, verifier and eval
  c.data.max_prompt_length = 48  # the model's ChatML template wraps each prompt
  c.data.num_eval_examples = 1  # the evals before and after RL decode up to 16K tokens each
  c.sampler.max_prefill_length = 48
  c.sampler.max_new_tokens = COMPLETION
  c.sampler.kv_layout = "paged"  # blocks as the sequences grow, not a 16K window per slot up front
  c.sampler.steps_per_call = 16  # fewer host round-trips per long completion
  c.sampler.max_concurrent_decodes = 8  # 2 per sampler replica: a group (and the next step's, rl.max_staleness = 1)
  c.algo.group_size = 2
  c.rl.prompts_per_step = 1
  c.rl.num_steps = 3
  c.rl.wait_timeout_s = 3600.0  # a group of two 16K-token completions decodes for many minutes on a CPU
  c.eval.timeout_s = 4 * 3600.0  # so does the held-out greedy completion before and after RL
  c.optim.share_prompts = True  # the group's prompt once, then both answers: one row of ~32.8K tokens
  c.optim.pack_tokens = 2 * COMPLETION + 48  # whole groups per row (one here)
  c.optim.context_parallel = True  # the row's tokens split over the 4 learner devices
  c.log.progress_bar = False
  return c
