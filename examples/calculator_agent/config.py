"""Async GRPO of an agent written with the `openai` client (agent.py) on 2-digit addition.

The agent's loop runs in its own code; the policy is served to it by the run's OpenAI-compatible
server, and every request it makes is recorded token for token for training (docs/agents.md).
Paths starting with ./ are relative to this file.
Run: python -m tunixlike.train --config examples/calculator_agent/config.py --workdir runs/agent
Variants: :size=tiny (the test-suite size).
"""

from tunixlike import config


def get_config(arg: str | None = None):
  variant = config.parse_arg(arg, size=("default", "tiny"))
  c = config.default_config_dict()
  c.data.digits = 2  # the main job's task (configs/addition_grpo.py), asked by an agent
  c.data.max_prompt_length = 16
  c.sampler.max_prefill_length = 64  # a conversation grows by a turn and a tool result per request
  c.sampler.max_new_tokens = 8  # = max_tokens of agent.py's requests (the server clamps a request to this limit)
  c.rl.agent = "./agent.py:run_episode"
  c.rl.env_max_turns = 3  # requests per episode, = MAX_TURNS in agent.py
  c.warm_start.max_steps = 1500  # as configs/addition_grpo.py: the agent starts from a model that can add
  c.warm_start.eval_every = 5
  c.optim.schedule = "cosine"
  c.optim.learning_rate = 5e-4  # configs/addition_grpo.py's tuned rate
  c.sampler.temperature = 1.0  # tuned here too (the library's 0.7 is for any user's task)
  c.rl.num_steps = 300
  c.eval.every_steps = 100
  if variant.size == "tiny":  # the end-to-end test: a couple of steps only
    c.rl.num_steps = 3
    c.rl.prompts_per_step = 8
    c.warm_start.max_steps = 20
    c.data.num_eval_examples = 64
  return c
