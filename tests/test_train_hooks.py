"""`tunixlike.train(hooks=...)`: the user's periodic work on the RL loop, in a real tiny run."""

import json
import os

import pytest

import tunixlike

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "addition_grpo.py:size=tiny")
FAST = {"rl.num_steps": 5, "rl.prompts_per_step": 4, "warm_start.max_steps": 0, "data.num_eval_examples": 8,
        "log.progress_bar": False, "log.tensorboard": False}


def test_hooks_record_steps_log_a_metric_and_stop_the_run_early(tmp_path):
  seen, evens = [], []

  def record(info):  # every step: adds a metric, logged with the step's own
    seen.append((info.step, info.version))
    info.metrics["my/groups_trained"] = len(info.trained)

  def stop_at_four(info):  # every 2nd version
    evens.append(info.version)
    if info.version >= 4:
      info.stop()

  summary = tunixlike.train(tunixlike.load_config(TINY, FAST), str(tmp_path / "run"),
                            hooks=[record, {"fn": stop_at_four, "every": 2}])
  assert seen == [(0, 1), (1, 2), (2, 3), (3, 4)]  # stopped after version 4 of 5
  assert evens == [2, 4]
  assert summary["stopped_by_hook"] and not summary["preempted"]
  assert 0.0 <= summary["eval/accuracy_after"] <= 1.0  # the final eval ran
  records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert [(r["step"], r["my/groups_trained"]) for r in records if "my/groups_trained" in r] == [
      (0, 4), (1, 4), (2, 4), (3, 4)]
  assert max(r["step"] for r in records) == 4  # the final eval is logged at the last version


@pytest.mark.parametrize("hooks, message", [
    ([print, 3], r"hooks\[1\]: 3 is not a function of StepInfo"),
    ([{"fn": print, "every": 0}], r"hooks\[0\]: every=0 must be an int >= 1"),
    ([{"fn": print, "evry": 2}], r"hooks\[0\]: expected \{'fn': function, 'every': N\}, got keys \['evry', 'fn'\]"),
])
def test_bad_hooks_are_refused_before_the_run_starts(tmp_path, hooks, message):
  with pytest.raises(ValueError, match=message):
    tunixlike.train(tunixlike.load_config(TINY, FAST), str(tmp_path / "run"), hooks=hooks)
  assert not (tmp_path / "run").exists()
