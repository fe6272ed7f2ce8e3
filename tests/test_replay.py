"""`python -m tunixlike.replay`: a free-running run's record (WORKDIR/schedule.jsonl) rerun step by step,
equal to the record; a record that does not match is reported at its first differing step."""

import json
import os
import signal
import subprocess
import sys

import pytest

from test_resume import ROOT, checkpoint_steps, steps_in, wait_for

# The tiny main job with a reward every group varies on ("stopped": a completion that ended), so the
# weights move at every step, at staleness 2: thread timing decides batches and swap points.
CONFIG = """
import os
from tunixlike import config

def get_config(arg=None):
  c = config.load(os.path.join({root!r}, "configs", "addition_grpo.py"), "size=tiny")
  c.rewards = [dict(fn="stopped")]
  c.warm_start.max_steps = 0
  c.rl.max_staleness = 2
  c.data.num_eval_examples = 8
  c.checkpoint.every_steps = 3
  c.log.replay_every = 3
  c.log.progress_bar = False
  c.log.tensorboard = False
  return c
"""


def train(tmp_path, workdir, steps, *extra):
  path = tmp_path / "config.py"
  path.write_text(CONFIG.format(root=ROOT))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  return subprocess.Popen([sys.executable, "-m", "tunixlike.train", f"--config={path}", f"--config.rl.num_steps={steps}",
                           *extra, f"--workdir={workdir}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def replay(workdir, *flags):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  proc = subprocess.run([sys.executable, "-m", "tunixlike.replay", f"--workdir={workdir}", *flags], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else None, proc.stderr


@pytest.mark.slow
def test_a_free_running_run_replays_bit_for_bit_and_a_changed_record_is_caught(tmp_path):
  workdir = str(tmp_path / "run")
  proc = train(tmp_path, workdir, 8)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0 and "deterministic: no (thread timing" in out, out[-3000:]
  records = steps_in(f"{workdir}/schedule.jsonl")
  assert [r["step"] for r in records if "step" in r] == list(range(8))
  assert len({r["checksum"] for r in records if "step" in r}) == 8  # the weights moved at every step
  assert 0 in checkpoint_steps(workdir)  # kept for the replay, beside the latest ones

  status, summary, err = replay(workdir)
  assert status == 0 and summary == {"steps": 8, "first_difference": None, "detail": None, "from_step": 0}, err[-3000:]
  status, summary, _ = replay(workdir, "--until=3")
  assert status == 0 and summary["steps"] == 3
  # Replay points every 3 steps (log.replay_every): the sampler drained there, and the checkpoint kept.
  assert [r["replay_point"] for r in records if "replay_point" in r] == [3, 6]
  assert {0, 3, 6} <= set(checkpoint_steps(workdir))
  status, summary, err = replay(workdir, "--from-checkpoint")
  assert status == 0 and summary == {"steps": 2, "first_difference": None, "detail": None, "from_step": 6}, err[-3000:]
  status, summary, err = replay(workdir, "--from-checkpoint", "--until=5")
  assert status == 0 and summary["from_step"] == 3 and summary["steps"] == 2, err[-3000:]

  # A record that does not match (here a reward as scored at step 5): the replay names that step.
  lines = open(f"{workdir}/schedule.jsonl").read().splitlines()
  at = next(i for i, line in enumerate(lines) if json.loads(line).get("step") == 5)
  record = json.loads(lines[at])
  seq = str(record["batch"][0])
  record["rewards"][seq]["rewards"] = [1.0 - r for r in record["rewards"][seq]["rewards"]]
  lines[at] = json.dumps(record)
  open(f"{workdir}/schedule.jsonl", "w").write("\n".join(lines) + "\n")
  status, summary, err = replay(workdir)
  assert status == 1 and summary["first_difference"] == 5 and summary["steps"] == 6, err[-3000:]
  assert "differs from the record at step 5: " in err


@pytest.mark.slow
def test_a_resumed_run_replays_from_the_checkpoint_it_resumed_from(tmp_path):
  workdir = str(tmp_path / "run")
  proc = train(tmp_path, workdir, 9)
  wait_for(lambda: 3 in checkpoint_steps(workdir) and len(steps_in(f"{workdir}/prompts.jsonl")) >= 5, 300, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait(30)
  proc = train(tmp_path, workdir, 9)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  segments = [r["segment"] for r in steps_in(f"{workdir}/schedule.jsonl") if "segment" in r]
  assert segments[0] == 0 and len(segments) == 2
  status, summary, err = replay(workdir, "--from-checkpoint")  # the replay point at 6
  assert status == 0 and summary["from_step"] == 6 and summary["steps"] == 3, err[-3000:]
  status, summary, err = replay(workdir, "--from-checkpoint", f"--until={segments[1] + 1}")  # where it resumed
  assert status == 0 and summary["from_step"] == segments[1] and summary["steps"] == 1, err[-3000:]
  status, summary, err = replay(workdir)  # from the start, across the resume
  assert status == 0 and summary["steps"] == 9 and summary["first_difference"] is None, err[-3000:]
