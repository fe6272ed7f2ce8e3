"""The no-learning-signal warning and the rows of completions.jsonl, on groups built by hand."""

import json

import numpy as np

from tunixlike.data import char_tokenizer
from tunixlike.rl import completions_log, signal_guard
from tunixlike.rl.hooks import StepInfo
from tunixlike.rollout import Completion, RolloutGroup


def _completion(tok, text, mask=None, versions=(3,)):
  ids = tok.encode(text, add_special_tokens=False) + [tok.eos_id]
  n = len(ids)
  return Completion(np.asarray(ids, np.int32), np.zeros(n, np.float32),
                    np.resize(np.asarray(versions, np.int32), n), "eos",
                    None if mask is None else np.asarray(mask, np.int32))


def _info(frac, all_zero, groups=4):
  return StepInfo(0, 1, {"frac_reward_zero_std": frac, "groups/all_zero_reward": all_zero}, [None] * groups, [])


def test_the_guard_warns_once_per_stretch_with_what_to_do():
  said = []
  guard = signal_guard.NoSignalGuard(3, said.append)
  for frac in (1.0, 1.0, 0.5, 1.0, 1.0):  # a step with signal starts the count again
    guard(_info(frac, 4))
  assert said == []
  guard(_info(1.0, 4))
  assert len(said) == 1
  assert said[0].startswith("warning: no learning signal for 3 steps in a row: every completion scored 0")
  for words in ("warm_start.max_steps", "data.answer_field", "model.hf_path", "denser reward",
                "rl.no_signal_warn_steps=0"):
    assert words in said[0], words
  for _ in range(5):  # once per stretch, not every step
    guard(_info(1.0, 2))
  assert len(said) == 1
  guard(_info(0.0, 0))
  for _ in range(3):
    guard(_info(1.0, 1))  # some groups scored, all of them equally
  assert len(said) == 2 and "every group's completions scored the same" in said[1]


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
