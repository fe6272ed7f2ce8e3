import math

import pytest

from tunixlike import rewards


def test_registry():
  assert {"exact_match", "gsm8k_accuracy", "answer_format", "length_penalty", "stopped"} <= set(rewards.names())
  with pytest.raises(KeyError, match="unknown reward function 'nope'"):
    rewards.get("nope")

  @rewards.register("test_constant")
  def constant(prompts, completions, **_):
    return [0.25] * len(completions)

  assert rewards.get("test_constant") is constant
  assert "test_constant" in rewards.names()
  with pytest.raises(ValueError, match="already registered"):
    rewards.register("test_constant")(lambda p, c, **_: [])


def test_exact_match():
  fn = rewards.get("exact_match")
  assert fn(["1+2="] * 4, ["3", " 3\n", "30", ""], answer=["3"] * 4) == [1.0, 1.0, 0.0, 0.0]
  with pytest.raises(ValueError, match="column 'answer' has 1 values for 2"):
    fn(["a", "b"], ["1", "2"], answer=["1"])


def test_gsm8k_accuracy_and_format():
  comps = ["#### 18", "The answer is 17", "I think 18", "", "x" * 100_000]
  assert rewards.get("gsm8k_accuracy")([""] * 5, comps, answer=["18"] * 5) == [1.0, 0.0, 1.0, 0.0, 0.0]
  assert rewards.get("answer_format")([""] * 5, comps) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_length_penalty_in_tokens():
  # DAPO soft overlong: max 10 tokens, buffer 4 -> free up to 6, linear to -1 at 10, -1 beyond.
  fn = rewards.get("length_penalty", max_length=10, buffer=4)
  got = fn([""] * 6, ["c"] * 6, completion_lengths=[0, 6, 7, 8, 10, 11])
  assert got == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
  linear = rewards.get("length_penalty", max_length=8)
  assert linear([""] * 2, ["c"] * 2, completion_lengths=[2, 8]) == [-0.25, -1.0]
  with pytest.raises(ValueError, match="buffer=20"):
    rewards.get("length_penalty", max_length=10, buffer=20)([""], ["c"], completion_lengths=[1])


def test_stopped():
  assert rewards.get("stopped")([""] * 3, ["a"] * 3, finish_reasons=["eos", "length", "stop"]) == [1.0, 0.0, 1.0]


def test_combined_reward_weights_and_metrics():
  reward = rewards.CombinedReward([("exact_match", 1.0), ("length_penalty", 0.5, {"max_length": 4}), "stopped"],
                                  timeout_s=10.0)
  total, metrics = reward(["p", "p"], ["975", "97"], answer=["975", "975"], completion_lengths=[4, 2],
                          finish_reasons=["eos", "length"])
  # sample 0: 1 + 0.5 * -1 + 1 = 1.5; sample 1: 0 + 0.5 * -0.5 + 0 = -0.25
  assert total.tolist() == [1.5, -0.25]
  assert metrics["rewards/exact_match"] == 0.5
  assert metrics["rewards/length_penalty"] == -0.75
  assert metrics["rewards/stopped"] == 0.5
  assert metrics["rewards/total"] == pytest.approx(0.625)
  assert metrics["rewards/exact_match/failures"] == 0.0
  with pytest.raises(ValueError, match=r"rewards\[0\]\.fn='nope': not a registered name"):
    rewards.CombinedReward(["nope"], timeout_s=10.0)
  with pytest.raises(ValueError, match="repeat"):
    rewards.CombinedReward(["stopped", "stopped"], timeout_s=10.0)
  with pytest.raises(ValueError, match="weight=nan"):
    rewards.RewardSpec("stopped", math.nan)
