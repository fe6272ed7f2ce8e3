"""Crash recovery and preemption, as a user meets them: the CLI in a subprocess, killed and resumed."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config", "configs/addition_grpo.py:size=tiny", "--config.warm_start.max_steps=0",
        "--config.log.progress_bar=false", "--config.log.tensorboard=false", "--config.data.num_eval_examples=8",
        "--config.checkpoint.every_steps=2", "--config.rl.max_staleness=1"]


def start(workdir, steps, *extra, compile_cache=True):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  if not compile_cache:  # compiles everything, as a first run does (tests/conftest.py sets the cache)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
  return subprocess.Popen([sys.executable, "-m", "tunixlike.train", *ARGS, f"--config.rl.num_steps={steps}",
                           *extra, f"--workdir={workdir}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
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
  wait_for(lambda: max(checkpoint_steps(workdir), default=0) >= 1 and len(steps_in(f"{workdir}/prompts.jsonl")) >= 3,
           300, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait(30)
  saved = checkpoint_steps(workdir)
  assert saved, "no checkpoint survived the kill"
  for log_file in ("metrics.jsonl", "prompts.jsonl"):  # as if the kill came mid-write
    with open(f"{workdir}/{log_file}", "a") as f:
      f.write('{"step": 99, "tra')

  proc = start(workdir, steps=12)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  assert f"at step {saved[-1]}" in out
  # The checkpoint kept the rollouts in flight with their tokens: the resume continues them.
  assert re.search(r"continuing \d+ prompts that were in flight \(\d+ tokens kept, not decoded again\)", out), out[-3000:]

  log = steps_in(f"{workdir}/prompts.jsonl")
  assert [r["step"] for r in log] == list(range(12))  # steps continue; lost steps redone once
  trained = [i for r in log for i in r["trained"]]
  dropped = [i for r in log for i in r["dropped"]]
  assert len(trained) == len(set(trained)) == 12 * 8  # no prompt trained twice
  final = json.load(open(f"{workdir}/checkpoints/12/meta/metadata"))
  accounted = set(trained) | set(dropped) | set(final["stream"]["outstanding"])
  assert accounted == set(range(final["stream"]["position"]))  # none skipped
  assert final["counters"]["groups_continued"] > 0 and final["counters"]["tokens_kept"] > 0
  # Admission after the restore is what an uninterrupted run's would be: nothing dropped as stale,
  # never more than (max_staleness + 1) batches of 8 prompts in flight.
  assert dropped == []
  metrics = steps_in(f"{workdir}/metrics.jsonl")
  rl = [r for r in metrics if "loss" in r]
  assert [r["step"] for r in rl] == list(range(12))  # no step twice
  assert max(r["queue/in_flight"] for r in rl) <= 2 * 8
  times = [r["time_s"] for r in metrics]
  assert times == sorted(times)  # the wall clock continues across the restart
  assert [r["step"] for r in metrics if "eval/accuracy" in r] == [0, 12]
  # Once more: the run is finished, and says so (it regenerates nothing).
  out, _ = start(workdir, steps=12).communicate(timeout=600)
  assert "is finished (step 12 of rl.num_steps=12); nothing to do" in out and "regenerating" not in out, out[-3000:]
  assert steps_in(f"{workdir}/metrics.jsonl") == metrics


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero_then_resumes(tmp_path):
  workdir = str(tmp_path / "run")
  proc = start(workdir, steps=200)
  wait_for(lambda: len(steps_in(f"{workdir}/prompts.jsonl")) >= 1, 300, proc)
  second = start(workdir, 200)  # a second run on a workdir in use is refused at once
  out, _ = second.communicate(timeout=120)
  assert second.returncode == 2 and out.strip().splitlines()[-1] == (
      f"tunixlike.train: error: --workdir {workdir} is in use by process {proc.pid} on host "
      f"{os.uname().nodename} (started {json.load(open(f'{workdir}/.lock'))['started']}); stop that run or "
      "choose another --workdir")
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out[-3000:]
  assert "checkpoint saved" in out
  reached = checkpoint_steps(workdir)[-1]
  assert 1 <= reached < 200
  other = start(workdir, reached + 2, "--config.data.task=reverse", "--config.seed=1")
  out, _ = other.communicate(timeout=120)
  assert other.returncode == 2 and "resuming would change data.task: 'addition' -> 'reverse'; seed: 0 -> 1" in out
  proc = start(workdir, steps=reached + 2)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  assert f"at step {reached}" in out
  assert [r["step"] for r in steps_in(f"{workdir}/prompts.jsonl")] == list(range(reached + 2))
  # The final line's time is the run's clock (time_s), and says how much of it this session took.
  final = next(line for line in out.splitlines() if line.startswith("held-out accuracy"))
  assert re.search(r" in (\d+) s \((\d+) s in this session, the rest before the resume\); the best was ", final), final


@pytest.mark.slow
def test_signals_during_the_warm_start_and_the_first_eval(tmp_path):
  """SIGTERM in the warm start saves it and exits 0; the next run continues it. Ctrl-C during the first
  eval keeps the finished warm start and the eval in a step-0 checkpoint, which the next run resumes."""
  workdir = str(tmp_path / "run")
  warm = ["--config.warm_start.eval_every=5", "--config.data.num_eval_examples=64",
          "--config.warm_start.target_accuracy=1.0"]
  proc = Output(start(workdir, 2, "--config.warm_start.max_steps=400", *warm))
  wait_for(lambda: "warm start step 5:" in proc.text, 300, proc.proc)
  proc.proc.send_signal(signal.SIGTERM)
  assert proc.wait() == 0 and "stopped during the warm start at step" in proc.text, proc.text[-3000:]
  assert "Traceback" not in proc.text and checkpoint_steps(workdir) == []
  paused = int(proc.text.split("stopped during the warm start at step ")[1].split(";")[0])
  assert paused >= 5

  # Without the compile cache: its compilation is most of the first eval (1 s cached), the signal's window.
  proc = Output(start(workdir, 2, f"--config.warm_start.max_steps={paused + 5}", *warm, compile_cache=False))
  wait_for(lambda: f"warm start step {paused + 5}:" in proc.text, 300, proc.proc)
  proc.proc.send_signal(signal.SIGINT)  # lands in the first eval (or its compilation)
  assert proc.wait() == 0, proc.text[-3000:]
  assert f"continuing the warm start from step {paused}" in proc.text
  assert "Traceback" not in proc.text and checkpoint_steps(workdir) == [0]
  assert not os.path.exists(f"{workdir}/warm_start")  # step 0 holds the finished warm start
  proc = Output(start(workdir, 2, f"--config.warm_start.max_steps={paused + 5}", *warm))
  assert proc.wait() == 0, proc.text[-3000:]
  assert "at step 0" in proc.text and "warm start step" not in proc.text  # neither is redone
  metrics = steps_in(f"{workdir}/metrics.jsonl")
  assert [r["warm_start/steps"] for r in metrics if "warm_start/steps" in r] == [paused + 5]
  assert [r["step"] for r in metrics if "eval/accuracy" in r] == [0, 2]


class Output:
  """Collects a process's output on a thread, so a test can wait for a line while it runs."""

  def __init__(self, proc):
    self.proc, self.text = proc, ""
    self._thread = threading.Thread(target=self._read, daemon=True)
    self._thread.start()

  def _read(self):
    for line in self.proc.stdout:
      self.text += line

  def wait(self, timeout_s=600) -> int:
    code = self.proc.wait(timeout_s)
    self._thread.join(30)
    return code
