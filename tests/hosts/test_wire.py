import dataclasses

import numpy as np

from tunixlike.hosts import wire
from tunixlike.rollout import Completion, RolloutGroup


def _group():
  rng = np.random.default_rng(0)

  def completion(n, reason):
    return Completion(token_ids=rng.integers(0, 50, n).astype(np.int32), logprobs=rng.standard_normal(n).astype(np.float32),
                      policy_versions=np.array([3] * (n - 1) + [4], np.int32), finish_reason=reason,
                      loss_mask=np.ones(n, np.int32), sampling_mask=rng.integers(0, 255, (n, 7)).astype(np.uint8),
                      expert_routing=rng.integers(0, 4, (n, 2, 2)).astype(np.int32),
                      prompt_routing=rng.integers(0, 4, (5, 2, 2)).astype(np.int32),
                      step_rewards=np.array([0.5], np.float32), step_ends=np.array([n - 1], np.int32),
                      teacher_logprobs=rng.standard_normal(n).astype(np.float32), text="12")
  return RolloutGroup(prompt_id="train/17", prompt_token_ids=np.arange(6, dtype=np.int32),
                      completions=[completion(4, "eos"), completion(9, "length")],
                      columns={"answer": "42", "stream_index": 17}, prompt_text="1+1=",
                      rewards=np.array([1.0, 0.0], np.float32), term_rewards={"correct": np.array([1.0, np.nan], np.float32)},
                      shaped_rewards=np.array([1.0, -0.1], np.float32), advantages=np.array([0.7, -0.7], np.float32),
                      token_advantages=[np.full(4, 0.7, np.float32), np.full(9, -0.7, np.float32)],
                      reward_metrics={"reward/correct": 0.5}, start_version=3)


def _assert_same(a, b):
  for f in dataclasses.fields(a):
    x, y = getattr(a, f.name), getattr(b, f.name)
    if f.name == "completions":
      for c, d in zip(x, y, strict=True):
        _assert_same(c, d)
    elif isinstance(x, np.ndarray):
      assert x.dtype == y.dtype, f.name
      np.testing.assert_array_equal(x, y)
    elif isinstance(x, dict) and x and isinstance(next(iter(x.values())), np.ndarray):
      assert x.keys() == y.keys()
      for k in x:
        np.testing.assert_array_equal(x[k], y[k])
    elif isinstance(x, list) and x and isinstance(x[0], np.ndarray):
      for p, q in zip(x, y, strict=True):
        np.testing.assert_array_equal(p, q)
    else:
      assert x == y, (f.name, x, y)


def test_every_field_of_the_data_contract_crosses_exactly():
  group = _group()
  back = wire.decode(wire.encode(group))
  _assert_same(group, back)
  assert back.min_version == 3 and back.admitted_version == 3


def test_optional_fields_stay_absent():
  c = Completion(token_ids=np.array([1, 2], np.int32), logprobs=np.zeros(2, np.float32),
                 policy_versions=np.zeros(2, np.int32), finish_reason="eos")
  group = RolloutGroup(prompt_id=5, prompt_token_ids=np.array([1], np.int32), completions=[c])
  _assert_same(group, wire.decode(wire.encode(group)))
