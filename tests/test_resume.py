"""Crash recovery and preemption, as a user meets them: the CLI in a subprocess, killed and resumed."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config", "configs/addition_grpo.py:size=tiny", "--config.warm_start.max_steps=0",
        "--config.log.progress_bar=false", "--config.log.tensorboard=false", "--config.data.num_eval_examples=8",
        "--config.checkpoint.every_steps=2", "--config.rl.max_staleness=1"]


def start(workdir, steps):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  return subprocess.Popen([sys.executable, "-m", "tunixlike.train", *ARGS, f"--config.rl.num_steps={steps}",
                           f"--workdir={workdir}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def wait_for(predicate, timeout_s, proc):
  deadline = time.monotonic() + timeout_s
  while not predicate():
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.2)


def steps_in(path):
  if not os.path.exists(path):
    return []
  return [json.loads(l) for l in open(path) if l.strip()]


def checkpoint_steps(workdir):
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(x) for x in os.listdir(d) if x.isdigit()) if os.path.isdir(d) else []


@pytest.mark.slow
def test_sigkill_then_resume_continues_steps_and_data_exactly(tmp_path):
  workdir = str(tmp_path / "run")
  proc = start(workdir, steps=12)
  wait_for(lambda: len(checkpoint_steps(workdir)) >= 1 and len(steps_in(f"{workdir}/prompts.jsonl")) >= 3,
           300, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait(30)
  saved = checkpoint_steps(workdir)
  assert saved, "no checkpoint survived the kill"

  proc = start(workdir, steps=12)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  assert f"at step {saved[-1]}" in out and "regenerating" in out

  log = steps_in(f"{workdir}/prompts.jsonl")
  assert [r["step"] for r in log] == list(range(12))  # steps continue; lost steps redone once
  trained = [i for r in log for i in r["trained"]]
  dropped = [i for r in log for i in r["dropped"]]
  assert len(trained) == len(set(trained)) == 12 * 8  # no prompt trained twice
  final = json.load(open(f"{workdir}/checkpoints/12/meta/metadata"))
  accounted = set(trained) | set(dropped) | set(final["stream"]["outstanding"])
  assert accounted == set(range(final["stream"]["position"]))  # none skipped
  assert final["counters"]["groups_regenerated"] > 0


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero_then_resumes(tmp_path):
  workdir = str(tmp_path / "run")
  proc = start(workdir, steps=200)
  wait_for(lambda: len(steps_in(f"{workdir}/prompts.jsonl")) >= 1, 300, proc)
  t0 = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out[-3000:]
  assert time.monotonic() - t0 < 60
  assert "checkpoint saved" in out
  reached = checkpoint_steps(workdir)[-1]
  assert 1 <= reached < 200
  proc = start(workdir, steps=reached + 2)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  assert f"at step {reached}" in out
  assert [r["step"] for r in steps_in(f"{workdir}/prompts.jsonl")] == list(range(reached + 2))
