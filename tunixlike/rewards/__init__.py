"""Rewards: a registry of batch reward functions, verifiers, safe execution and weighted sums.

    fn = rewards.get("gsm8k_accuracy")
    scores = fn(prompts, completions, answer=answers)                  # list[float]
    reward = rewards.CombinedReward([("gsm8k_accuracy", 1.0), ("answer_format", 0.1)],
                                    timeout_s=cfg.rl.reward_timeout_s)
    rewards_n, metrics = reward(prompts, completions, answer=answers, completion_lengths=lengths)
"""

from tunixlike.rewards import basic, math_answer  # noqa: F401  (registers the built-in functions)
from tunixlike.rewards.combine import CombinedReward, RewardSpec
from tunixlike.rewards.groups import score_groups
from tunixlike.rewards.registry import get, names, register
from tunixlike.rewards.safe import SafeReward

__all__ = ["CombinedReward", "RewardSpec", "SafeReward", "get", "names", "register", "math_answer", "score_groups"]
