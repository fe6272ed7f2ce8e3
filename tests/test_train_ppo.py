"""The tiny PPO config end to end through `python -m tunixlike.train`: value-loss metrics and evals."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_tiny_ppo_config_runs_end_to_end(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  proc = subprocess.run([sys.executable, "-m", "tunixlike.train", "--config", "configs/addition_ppo.py:size=tiny",
                         "--config.log.progress_bar=false", "--config.log.tensorboard=false",
                         "--config.data.num_eval_examples=16", f"--workdir={tmp_path}"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl") if l.strip()]
  steps = [r for r in records if "loss" in r]
  evals = [r for r in records if "eval/accuracy" in r]
  assert [r["step"] for r in steps] == [0, 1, 2]
  for r in steps:  # the tiny run may see only zero rewards: a zero-initialised critic then has no error
    assert math.isfinite(r["vf_loss"]) and r["vf_loss"] >= 0 and 0 <= r["vf_clip_frac"] <= 1
    assert math.isfinite(r["value_mean"]) and math.isfinite(r["return_mean"])
  assert [r["step"] for r in evals] == [0, 3] and all(r["eval/num_prompts"] == 16 for r in evals)
  assert "held-out accuracy" in proc.stdout + proc.stderr
