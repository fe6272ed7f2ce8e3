"""eval.timeout_s bounds a held-out evaluation: past it the error names the key (long completions on
a slow device need it raised), within it the evaluation finishes."""

import numpy as np
import pytest

from tunixlike import rewards
from tunixlike.rl import evaluate as eval_lib
from tunixlike.sampler.driver import DriverError, PromptRequest


def _requests(tokenizer, n=6):
  return [PromptRequest(prompt_id=i, token_ids=np.asarray(tokenizer.encode(f"{i}+{i}="), np.int32)) for i in range(n)]


def nonempty(completions):
  return [1.0 if c.strip() else 0.0 for c in completions]


def test_an_evaluation_past_eval_timeout_s_names_the_key(make_engine, tokenizer):
  engine = make_engine(max_new_tokens=8)
  params, reward = engine.load_params(), rewards.CombinedReward([nonempty], timeout_s=10.0)
  with pytest.raises(DriverError, match=r"eval\.timeout_s=1e-06: the held-out evaluation of 6 prompts"):
    eval_lib.evaluate(engine, params, _requests(tokenizer), reward, tokenizer, timeout_s=1e-6)
  out = eval_lib.evaluate(engine, params, _requests(tokenizer), reward, tokenizer, timeout_s=600)
  assert out["eval/num_prompts"] == 6
