"""The guard against unlearning: the rule on evaluations, the best evaluation, and a run it stops."""

import pathlib
import threading

import pytest

import tunixlike
from tunixlike.rl import unlearning

TINY = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "addition_grpo.py") + ":size=tiny"


def test_stops_only_when_the_last_evals_all_lie_below_the_start_by_the_margin():
  check = lambda evals, patience=2: unlearning.check(evals, margin=0.05, patience=patience)
  assert check({0: 0.20}) is None and check({0: 0.20, 20: 0.0}) is None  # one eval is not a trend
  assert check({0: 0.20, 20: 0.10, 40: 0.16}) is None  # 0.16 is within 5 points
  assert check({0: 0.20, 20: 0.10, 40: 0.30, 60: 0.14}) is None  # not in a row
  problem = check({0: 0.20, 20: 0.30, 40: 0.10, 60: 0.0})
  assert problem == ("held-out accuracy fell more than eval.unlearn_margin=0.05 below the RL stage's start (0.200 "
                     "at step 0) in the last 2 evals (eval.unlearn_evals): 0.100 at step 40, 0.000 at step 60; the "
                     "run is unlearning its task")
  assert check({0: 0.20, 20: 0.10, 40: 0.0}, patience=0) is None  # 0 turns the guard off
  assert check({0: 0.20, 20: 0.10, 40: 0.0}, patience=3) is None


def test_the_best_eval_is_the_newest_of_equal_ones():
  assert unlearning.best({}) is None
  assert unlearning.best({0: 0.2, 20: 0.5, 40: 0.5, 60: 0.1}) == (40, 0.5)


@pytest.mark.slow
def test_a_run_whose_held_out_accuracy_falls_stops_and_names_the_best_checkpoint(tmp_path):
  """A verifier that passes everything until step 1 and nothing after: the evals at steps 2 and 4 lie
  below the start (1.0 at step 0), so the run stops after the one at step 4, without saving it."""
  broken = threading.Event()

  def correct(completions, **_):
    return [0.0 if broken.is_set() else 1.0 for _ in completions]

  overrides = {"rl.num_steps": 8, "eval.every_steps": 2, "warm_start.max_steps": 0, "data.num_eval_examples": 8,
               "rl.prompts_per_step": 4, "log.progress_bar": False, "log.tensorboard": False}
  workdir = tmp_path / "run"
  with pytest.raises(unlearning.Unlearning) as e:
    tunixlike.train(tunixlike.load_config(TINY, overrides), str(workdir), rewards=[correct],
                    hooks=[lambda info: broken.set() if info.step >= 1 else None])
  assert str(e.value).startswith(
      "held-out accuracy fell more than eval.unlearn_margin=0.05 below the RL stage's start (1.000 at step 0) in "
      "the last 2 evals (eval.unlearn_evals): 0.000 at step 2, 0.000 at step 4; the run is unlearning its task: "
      f"stopped. The best held-out accuracy was 1.000 at step 0 ({workdir / 'checkpoints' / '0'}): export it with "
      f"`python -m tunixlike.export --workdir {workdir} --best --out DIR`")
  assert "a lower optim.learning_rate than this run's 0.0005 (the export records it" in str(e.value)
  assert "eval.unlearn_evals=0 turns this guard off" in str(e.value)
  steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert 4 not in steps and 0 in steps  # the unlearned state is not saved; the best is kept
