"""The no-learning-signal and truncation warnings, and the rows of completions.jsonl, on groups built by hand."""

import json

import numpy as np

from tunixlike.data import char_tokenizer
from tunixlike.rl import completions_log, signal_guard, truncation_guard
from tunixlike.rl.hooks import StepInfo
from tunixlike.rollout import Completion, RolloutGroup


def _completion(tok, text, mask=None, versions=(3,)):
  ids = tok.encode(text, add_special_tokens=False) + [tok.eos_id]
  n = len(ids)
  return Completion(np.asarray(ids, np.int32), np.zeros(n, np.float32),
                    np.resize(np.asarray(versions, np.int32), n), "eos",
                    None if mask is None else np.asarray(mask, np.int32))


def _info(frac, all_zero=0, solved=0, groups=4, step=0):
  metrics = {"frac_reward_zero_std": frac, "groups/all_zero_reward": all_zero, "groups/all_solved": solved}
  return StepInfo(step, step + 1, metrics, [None] * groups, [])


def test_the_guard_warns_on_a_window_not_a_streak_and_says_the_groups_all_failed():
  """The run that unlearned its task: most steps had no signal, but never many in a row."""
  said = []
  guard = signal_guard.NoSignalGuard(5, 0.6, said.append)
  for frac in (1.0, 1.0, 0.5, 1.0):  # a full window is needed first
    guard(_info(frac, all_zero=round(4 * frac)))
  assert said == []
  guard(_info(1.0, all_zero=4))  # 18 of the 20 groups of the last 5 steps had no signal, 2 in a row
  assert len(said) == 1
  assert said[0].startswith("warning: little learning signal: 18 of the 20 groups of the last 5 steps had no "
                            "reward variance")
  for words in ("most failed every time (18 of 20 groups scored 0 throughout)", "warm_start.max_steps",
                "data.answer_field", "model.hf_path", "denser reward", "lower optim.learning_rate",
                "rl.no_signal_warn_steps=0"):
    assert words in said[0], words
  for _ in range(5):  # once per stretch, not every step
    guard(_info(1.0, all_zero=4))
  assert len(said) == 1
  for _ in range(3):  # the share drops below 0.6 (8 of 20) ...
    guard(_info(0.0))
  for _ in range(3):  # ... and rises again: a new stretch, a new warning
    guard(_info(1.0, all_zero=4))
  assert len(said) == 2


def test_the_guard_says_when_the_groups_were_solved_or_scored_alike():
  said = []
  guard = signal_guard.NoSignalGuard(3, 0.6, said.append)
  for _ in range(3):  # every group solved by every completion: too easy, not "never succeeds"
    guard(_info(1.0, solved=4))
  assert len(said) == 1 and "most were solved every time (12 of 12 groups all correct)" in said[0]
  assert "sampler.group_size" in said[0] and "never" not in said[0] and "warm start" not in said[0]
  guard = signal_guard.NoSignalGuard(3, 0.6, said.append)
  for _ in range(3):  # the same nonzero score for everyone
    guard(_info(1.0, all_zero=1, solved=1))
  assert len(said) == 2 and "the reward cannot tell the completions apart" in said[1]


def test_the_truncation_warning_says_once_what_limit_would_fit():
  said = []
  guard = truncation_guard.TruncationGuard(8, 0.05, said.append, longest_answer=11)
  guard.check(0.05, "the held-out answers")  # not more than the share
  assert said == []
  guard.check(13 / 60, "the held-out answers at step 0")
  assert said == ["warning: 22% of the held-out answers at step 0 hit "
                  "sampler.max_new_tokens=8 (finish reason 'length'): they were cut before they ended and score "
                  "as wrong; the data's longest answer is 11 tokens with its end: set sampler.max_new_tokens=13 "
                  "(rl.truncated_warn_share=0 silences this)"]
  guard(StepInfo(3, 4, {"completions/truncated": 0.5}, [], []))
  assert len(said) == 1  # once per run
  rl_guard = truncation_guard.TruncationGuard(8, 0.05, said.append)  # no answer column to size from
  rl_guard(StepInfo(3, 4, {"completions/truncated": 0.5}, [], []))
  assert said[-1].startswith("warning: 50% of the completions of RL step 3 hit sampler.max_new_tokens=8")
  assert "raise sampler.max_new_tokens (e.g. to 16)" in said[-1]
  fits = truncation_guard.TruncationGuard(18, 0.05, said.append, longest_answer=15)
  fits.check(1.0, "the held-out answers at step 0")
  assert said[-1].startswith("warning: 100% of the held-out answers at step 0 hit sampler.max_new_tokens=18")
  assert "the data's longest answer (15 tokens with its end) fits, so these completions run on" in said[-1]
  assert truncation_guard.fitting_limit([3, 11, 7]) == 13 and truncation_guard.fitting_limit([40]) == 50
  assert truncation_guard.fitting_limit([]) is None


def test_completion_rows_carry_rewards_per_term_and_the_chain_of_an_episode():
  tok = char_tokenizer.build()
  single = RolloutGroup("p1", np.asarray(tok.encode("1+2="), np.int32), [_completion(tok, "3"), _completion(tok, "4")],
                        prompt_text="1+2=")
  single.rewards = np.asarray([1.1, 0.1], np.float32)
  single.term_rewards = {"correct": np.asarray([1.0, 0.0], np.float32),
                         "format": np.asarray([1.0, np.nan], np.float32)}
  single.advantages = np.asarray([0.7, -0.7], np.float32)
  # An agent chain: the model's turn, a tool result it did not write, the model's answer.
  chain = _completion(tok, "2+2 RESULT 4 ok", mask=[1] * 3 + [0] * 10 + [1] * 3, versions=(3, 3, 4))
  episode = RolloutGroup("p2", np.asarray(tok.encode("q"), np.int32), [chain], prompt_text="q")
  episode.rewards = np.asarray([1.0], np.float32)
  rows = completions_log.completion_rows([single, episode], tok, step=7)
  assert len(rows) == 3
  first, second, third = rows
  assert first == {"step": 7, "prompt_id": "p1", "prompt": "1+2=", "completion": "3", "reward": np.float32(1.1).item(),
                   "rewards": {"correct": 1.0, "format": 1.0}, "advantage": np.float32(0.7).item(), "num_tokens": 2,
                   "finish_reason": "eos", "versions": [3, 3]}
  assert second["rewards"] == {"correct": 0.0, "format": None}  # skipped: null, not 0
  assert "segments" not in first
  assert third["loss_mask_spans"] == [(0, 3), (13, 16)]
  assert [s["trained"] for s in third["segments"]] == [True, False, True]
  assert "".join(s["text"] for s in third["segments"]) == "2+2 RESULT 4 ok<eos>"
  assert third["segments"][1]["text"] == " RESULT 4 "
  assert third["versions"] == [3, 4]
  json.dumps(rows)  # a JSON line each
  table = completions_log.markdown(rows)
  assert table.count("\n") == 4 and "correct=1, format=1" in table and "format=-" in table
