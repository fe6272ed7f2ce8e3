"""GRPO with LoRA on GSM8K for a local Hugging Face model (e.g. Qwen2.5-0.5B-Instruct you downloaded).

Run (TPU/GPU):
  python -m tunixlike.train --config configs/gsm8k_grpo.py \
      --config.model.hf_path=/path/to/Qwen2.5-0.5B-Instruct \
      --workdir runs/gsm8k
Variant `:size=tiny` runs on CPU in the tests with a tiny random checkpoint they create.
"""

from tunixlike import config


def get_config(arg: str | None = None):
  variant = config.parse_arg(arg, size=("default", "tiny"))
  c = config.default_config_dict()
  c.data.task = "gsm8k"
  c.data.max_prompt_length = 256  # question + template; longer prompts are dropped and counted
  c.data.num_eval_examples = 256
  c.sampler.max_prefill_length = 256
  c.sampler.max_new_tokens = 512  # step-by-step reasoning
  c.sampler.max_concurrent_decodes = 64
  c.sampler.temperature = 1.0
  c.model.dtype = "bfloat16"  # compute in bf16 on TPU/GPU; master weights stay fp32
  c.algo.group_size = 8
  c.algo.loss = "dapo"  # clip-higher and token-level aggregation help long reasoning
  c.algo.overlong_buffer = 64  # soft penalty on the last 64 tokens before the length limit
  c.rl.prompts_per_step = 16
  c.rl.num_steps = 500
  c.rl.max_staleness = 2
  c.optim.learning_rate = 1e-5  # LoRA on a pretrained model: small steps
  c.optim.warmup_steps = 10
  c.lora.rank = 16
  c.lora.alpha = 32.0
  c.eval.every_steps = 50
  if variant.size == "tiny":  # CPU test: a tiny random checkpoint, a couple of steps
    c.model.dtype = "float32"
    c.data.max_prompt_length = 512  # character tokenizer: one token per character
    c.sampler.max_prefill_length = 512
    c.sampler.max_new_tokens = 8
    c.sampler.max_concurrent_decodes = 16
    c.data.num_eval_examples = 8
    c.data.train_size = 512  # a couple of steps read a few dozen problems
    c.algo.group_size = 4
    c.algo.overlong_buffer = 2
    c.rl.prompts_per_step = 4
    c.rl.num_steps = 2
    c.rl.max_staleness = 1
    c.lora.rank = 4
    c.optim.learning_rate = 1e-3
    c.eval.every_steps = 0
  return c
