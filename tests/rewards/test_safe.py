import math
import threading

import numpy as np

from tunixlike import rewards
from tunixlike.rewards import SafeReward


def test_good_function_passes_through():
  fn = SafeReward(lambda p, c, **_: [len(x) for x in c], name="len", timeout_s=10.0)
  assert fn(["", ""], ["ab", "abc"]) == ([2.0, 3.0], 0)
  assert fn([], []) == ([], 0)
  assert fn.failures == 0


def test_exception_is_isolated_to_the_bad_sample():
  def picky(prompts, completions, *, answer, **_):
    return [1.0 / int(c) for c in completions]  # "x" raises ValueError, "0" ZeroDivisionError

  fn = SafeReward(picky, name="picky", timeout_s=5)
  scores, failed = fn(["p"] * 4, ["2", "x", "4", "0"], answer=["a"] * 4)
  assert scores == [0.5, 0.0, 0.25, 0.0] and failed == 2 and fn.failures == 2


def test_timeout_scores_zero_and_never_hangs():
  release, finished = threading.Event(), threading.Event()

  def stuck(prompts, completions, **_):
    release.wait(30)
    finished.set()
    return [1.0] * len(completions)

  fn = SafeReward(stuck, name="stuck", timeout_s=0.2)
  assert fn(["p"] * 3, ["a", "b", "c"]) == ([0.0, 0.0, 0.0], 3)
  assert not finished.is_set()  # the scores came back while the call was still stuck
  assert fn.failures == 3
  release.set()


def test_nan_and_junk_values_score_zero_and_none_is_skipped():
  fn = SafeReward(lambda p, c, **_: [1.0, math.nan, None, "x", math.inf, 2], name="junk", timeout_s=10.0)
  assert fn([""] * 6, ["c"] * 6) == ([1.0, 0.0, None, 0.0, 0.0, 2.0], 3)


def test_wrong_number_of_values_scores_zero():
  assert SafeReward(lambda p, c, **_: [1.0], name="short", timeout_s=10.0)([""] * 3, ["c"] * 3) == ([0.0] * 3, 3)
  assert SafeReward(lambda p, c, **_: 1.0, name="scalar", timeout_s=10.0)([""] * 2, ["c"] * 2) == ([0.0] * 2, 2)


def test_combined_reward_reports_failures_per_function():
  @rewards.register("test_always_raises")
  def always_raises(prompts, completions, **_):
    raise RuntimeError("boom")

  reward = rewards.CombinedReward([("exact_match", 1.0), ("test_always_raises", 1.0)], timeout_s=5)
  total, metrics = reward(["p", "p"], ["1", "2"], answer=["1", "1"])
  assert total.tolist() == [1.0, 0.0]
  assert metrics["rewards/test_always_raises/failures"] == 2.0
  assert metrics["rewards/exact_match/failures"] == 0.0


def test_as_score_accepts_finite_numbers_only():
  """One rule for reward values and PRM results: text (str or bytes) is never parsed as a number."""
  from tunixlike.rewards.safe import as_score
  assert as_score(1) == 1.0 and as_score(0.25) == 0.25 and as_score(True) == 1.0
  for bad in (None, "1.0", b"1.0", float("nan"), float("inf"), [1.0], object()):
    assert as_score(bad) is None, bad


def test_a_bool_is_a_pass_or_fail_score():
  """Documented (docs/data_and_rewards.md): True scores 1.0 and False 0.0, Python's or numpy's, as TRL reads them."""
  fn = SafeReward(lambda p, c, **_: [True, False, np.bool_(True), np.bool_(False)], name="passed", timeout_s=10.0)
  assert fn(["p"] * 4, ["a", "b", "c", "d"]) == ([1.0, 0.0, 1.0, 0.0], 0)
  assert fn.failures == 0
