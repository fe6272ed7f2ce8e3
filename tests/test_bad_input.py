"""Bad input through the CLI: a clear line naming the problem and exit status 2, or a counted fallback."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config", "configs/addition_grpo.py:size=tiny", "--config.warm_start.max_steps=0",
        "--config.log.progress_bar=false", "--config.log.tensorboard=false", "--config.data.num_eval_examples=8",
        "--config.checkpoint.every_steps=1"]


def train(*args):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  return subprocess.run([sys.executable, "-m", "tunixlike.train", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_unreadable_data_names_the_file(tmp_path):
  (tmp_path / "train.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\nnot json\n')
  (tmp_path / "test.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
  out = train("--config", "configs/addition_grpo.py", "--config.data.task=gsm8k", f"--config.data.path={tmp_path}",
              f"--workdir={tmp_path / 'run'}")
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1].startswith("tunixlike.train: error: ")
  assert "train.jsonl:2" in out.stderr


@pytest.mark.slow
def test_damaged_checkpoint_falls_back_and_incompatible_model_is_named(tmp_path):
  workdir = tmp_path / "run"
  out = train(*TINY, "--config.rl.num_steps=2", f"--workdir={workdir}")
  assert out.returncode == 0, out.stderr[-3000:]
  steps = sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())
  assert steps == [1, 2]
  # Damage the newest checkpoint's arrays: the run resumes from the previous one.
  for root, _, files in os.walk(workdir / "checkpoints" / "2" / "state"):
    for f in files:
      if not f.startswith("_"):
        os.remove(os.path.join(root, f))
  out = train(*TINY, "--config.rl.num_steps=3", f"--workdir={workdir}")
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resumed from" in out.stderr + out.stdout and "at step 1" in out.stderr + out.stdout
  # A model of another shape on the same workdir: the parameter and both shapes are named.
  out = train(*TINY, "--config.rl.num_steps=5", "--config.model.hidden_size=32", f"--workdir={workdir}")
  assert out.returncode == 2, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert "embed_tokens" in last and "64" in last and "32" in last
