"""The worked example of docs/own_data.md, run end to end through the CLI from another directory."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_countdown_example_trains_a_few_steps_through_the_cli(tmp_path):
  env = {**os.environ}
  out = subprocess.run([sys.executable, "-m", "tunixlike.train", "--config",
                        os.path.join(ROOT, "examples", "countdown", "config.py:size=tiny"),
                        "--config.log.progress_bar=false", "--workdir", str(tmp_path / "run")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  steps = [r for r in records if "rewards/correct" in r]
  assert len(steps) == 3
  for r in steps:
    assert r["rewards/correct/failures"] == 0 and r["rewards/well_formed/failures"] == 0
    assert 0.0 <= r["rewards/correct"] <= 1.0
  evals = [r for r in records if "eval/accuracy" in r]
  assert [r["step"] for r in evals] == [0, 2, 3] and evals[0]["eval/num_prompts"] == 16
  # Every eval, the one mid-run too, is a line on the console, not only a record in metrics.jsonl.
  for r in evals:
    assert f"eval at step {r['step']}: accuracy {r['eval/accuracy']:.3f} on 16 held-out prompts" in out.stdout
  # The supervised warm start on the solution column ran first, its held-out loss falling.
  warm = [r for r in records if "warm_start/step" in r]
  assert [r["warm_start/step"] for r in warm] == [0, 2, 4]
  assert warm[-1]["warm_start/eval_loss"] < warm[0]["warm_start/eval_loss"]
  assert [r["warm_start/steps"] for r in records if "warm_start/steps" in r] == [4]
