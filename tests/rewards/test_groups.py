import numpy as np
import pytest

from tunixlike import rewards
from tunixlike.data import char_tokenizer
from tunixlike.rollout import Completion, RolloutGroup


def _completion(tok, text, finish="eos"):
  ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_id] if finish == "eos" else [])
  n = len(ids)
  return Completion(token_ids=np.array(ids, np.int32), logprobs=np.zeros(n, np.float32),
                    policy_versions=np.zeros(n, np.int32), finish_reason=finish)


def test_score_groups_fills_rewards_from_decoded_tokens():
  tok = char_tokenizer.build()
  groups = [
      RolloutGroup("a", np.array([1, 5], np.int32), [_completion(tok, "975"), _completion(tok, "97", "length")],
                   columns={"answer": "975"}, prompt_text="123+456="),
      RolloutGroup("b", np.array([1, 6], np.int32), [_completion(tok, "1"), _completion(tok, "10")],
                   columns={"answer": "10"}, prompt_text="5+5="),
  ]
  reward = rewards.CombinedReward([("exact_match", 1.0), ("length_penalty", 1.0, {"max_length": 4}),
                                   ("stopped", 0.5)], timeout_s=10.0)
  metrics = rewards.score_groups(reward, groups, tokenizer=tok)
  # lengths in tokens: "975"+eos = 4, "97" = 2, "1"+eos = 2, "10"+eos = 3
  np.testing.assert_allclose(groups[0].rewards, [1 - 1.0 + 0.5, 0 - 0.5 + 0.0])
  np.testing.assert_allclose(groups[1].rewards, [0 - 0.5 + 0.5, 1 - 0.75 + 0.5])
  # Each term's own score per completion, before its weight (what completions.jsonl shows).
  np.testing.assert_allclose(groups[0].term_rewards["exact_match"], [1, 0])
  np.testing.assert_allclose(groups[1].term_rewards["length_penalty"], [-0.5, -0.75])
  np.testing.assert_allclose(groups[1].term_rewards["stopped"], [1, 1])
  assert groups[0].rewards.dtype == np.float32
  assert metrics["rewards/exact_match"] == 0.5
  assert groups[1].reward_metrics == metrics


def test_score_groups_needs_text_or_tokenizer():
  tok = char_tokenizer.build()
  group = RolloutGroup("a", np.array([1], np.int32), [_completion(tok, "1")], columns={"answer": "1"})
  with pytest.raises(ValueError, match="no tokenizer"):
    rewards.score_groups(rewards.CombinedReward(["exact_match"], timeout_s=10.0), [group])
