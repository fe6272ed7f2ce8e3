"""rl.deterministic as a user meets it: the CLI killed (SIGKILL in the RL stage and during a
checkpoint write, SIGTERM) and resumed with the same command ends with the parameters, metrics and
trained prompts of a run never stopped."""

import os
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from test_resume import checkpoint_steps, start, steps_in, wait_for
from tunixlike.rl import schedule

STEPS = 10
DETERMINISTIC = ("--config.rl.deterministic=true", "--config.rl.max_staleness=2")

def finish(workdir):
  proc = start(workdir, STEPS, *DETERMINISTIC)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  return out


def learned(workdir):
  """What a run ends with: its steps' metrics (timings left out), trained prompts and final weights."""
  metrics = [schedule.without_timing(r) for r in steps_in(f"{workdir}/metrics.jsonl")]
  prompts = steps_in(f"{workdir}/prompts.jsonl")
  with ocp.PyTreeCheckpointer() as reader:
    state = reader.restore(os.path.join(workdir, "checkpoints", str(STEPS), "state"))
  return metrics, prompts, state["params"]


@pytest.mark.slow
def test_a_run_killed_and_resumed_ends_identical_to_one_never_stopped(tmp_path):
  reference = str(tmp_path / "uninterrupted")
  out = finish(reference)
  assert "deterministic: yes (rl.deterministic" in out

  chaos = str(tmp_path / "chaos")
  proc = start(chaos, STEPS, *DETERMINISTIC)  # SIGKILL in the RL stage, between checkpoints
  wait_for(lambda: 2 in checkpoint_steps(chaos) and len(steps_in(f"{chaos}/prompts.jsonl")) >= 3, 300, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait(30)
  proc = start(chaos, STEPS, *DETERMINISTIC)  # SIGKILL while a checkpoint is being written
  ckpts = os.path.join(chaos, "checkpoints")
  wait_for(lambda: any("tmp" in name for name in os.listdir(ckpts)) and len(checkpoint_steps(chaos)) >= 2, 300, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait(30)
  proc = start(chaos, STEPS, *DETERMINISTIC)  # SIGTERM: a checkpoint at the current step, exit 0
  before = len(steps_in(f"{chaos}/prompts.jsonl"))
  wait_for(lambda: len(steps_in(f"{chaos}/prompts.jsonl")) > before, 300, proc)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0 and "checkpoint saved" in out, out[-3000:]
  out = finish(chaos)
  assert "finished ones kept" in out or "regenerating 0 prompts" in out, out[-3000:]

  (m1, p1, w1), (m2, p2, w2) = learned(reference), learned(chaos)
  assert m1 == m2 and p1 == p2
  leaves1, leaves2 = jax.tree.leaves(w1), jax.tree.leaves(w2)
  assert len(leaves1) == len(leaves2) > 0
  for a, b in zip(leaves1, leaves2):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
