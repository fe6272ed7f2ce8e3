"""Held-out evaluation with the sampler: greedy (or sampled) completions scored by a 0/1 verifier.

`reward` is the task's correctness reward alone (exact match, GSM8K answer check), not the shaped
training reward: accuracy = mean score over all completions; pass@k = fraction of prompts with at
least one correct completion among its k samples.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from tunixlike.rewards.groups import score_groups
from tunixlike.rollout import RolloutGroup, truncated_share
from tunixlike.sampler.config import SamplerConfig
from tunixlike.sampler.driver import DriverError, DriverTimeout, PromptRequest, RolloutDriver
from tunixlike.sampler.engine import Engine


def eval_sampler_config(train: SamplerConfig, *, samples: int = 1, temperature: float = 0.0) -> SamplerConfig:
  """The training sampler's settings with greedy decoding (or `temperature`) and `samples` per prompt."""
  return dataclasses.replace(train, temperature=temperature, top_k=0, top_p=1.0, group_size=samples,
                             record_sampling_mask=False)


def generate(engine: Engine, params, requests: Sequence[PromptRequest], *, version: int = 0,
             detokenize: Callable | None = None, timeout_s: float | None = None) -> list[RolloutGroup]:
  """Runs the driver synchronously over `requests`; returns groups in request order. Past
  `timeout_s` (eval.timeout_s) it raises, naming the key."""
  groups: list[RolloutGroup] = []
  driver = RolloutDriver(engine, params, source=iter(requests), sink=groups.append, version=version,
                         detokenize=detokenize)
  try:
    driver.run(max_wall_s=timeout_s)
  except DriverTimeout:
    raise DriverError(f"eval.timeout_s={timeout_s:g}: the held-out evaluation of {len(requests)} prompts "
                      f"did not finish ({len(groups)} done); raise eval.timeout_s for long completions") from None
  order = {r.prompt_id: i for i, r in enumerate(requests)}
  return sorted(groups, key=lambda g: order[g.prompt_id])


def evaluate(engine: Engine, params, requests: Sequence[PromptRequest], reward, tokenizer, *,
             version: int = 0, examples: list | None = None, timeout_s: float | None = None) -> dict[str, Any]:
  """Accuracy (and pass@k when the engine samples k > 1 per prompt) on `requests`.

  `eval/reward_failures` counts completions the verifier failed on (raised or timed out): they
  score 0, so an accuracy next to many failures measures the verifier, not the policy.
  `eval/truncated` is the share of completions cut at sampler.max_new_tokens (finish reason "length").
  `examples`: a list that gets one dict per completion (prompt, completion, score, finish reason).
  """
  groups = generate(engine, params, requests, version=version, detokenize=tokenizer.decode, timeout_s=timeout_s)
  metrics = score_groups(reward, groups, tokenizer=tokenizer)
  if examples is not None:
    examples.extend(example_rows(groups, tokenizer))
  correct_ng = np.stack([g.rewards for g in groups]) >= 0.5
  k = correct_ng.shape[1]
  out = {"eval/accuracy": float(correct_ng.mean()), "eval/num_prompts": len(groups),
         "eval/reward_failures": int(sum(v for name, v in metrics.items() if name.endswith("/failures"))),
         "eval/mean_completion_tokens": float(np.mean([c.num_tokens for g in groups for c in g.completions])),
         "eval/truncated": truncated_share(groups)}
  if k > 1:
    out[f"eval/pass@{k}"] = float(correct_ng.any(axis=1).mean())
  return out


def example_rows(groups: Sequence[RolloutGroup], tokenizer) -> list[dict[str, Any]]:
  """One JSON-ready dict per scored completion: what a person reads to see what the model says."""
  rows = []
  for g in groups:
    for i, c in enumerate(g.completions):
      rows.append({"prompt_id": str(g.prompt_id), "prompt": g.prompt_text,
                   "completion": c.text if c.text is not None else tokenizer.decode(c.token_ids),
                   "score": float(g.rewards[i]), "finish_reason": c.finish_reason, "num_tokens": c.num_tokens})
  return rows
