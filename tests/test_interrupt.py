"""A second Ctrl-C exits at once with status 130, whatever the spacing of the two signals, never
with a crash of the interpreter's shutdown (exit 139) while JAX's threads run."""

import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPACINGS_S = (0.001, 0.02, 0.1, 0.3, 0.6)  # between the two SIGINTs
# Each spacing twice: the old unwinding exit crashed in 1 of 3 tries, so 10 tries miss it with
# probability (2/3)**10 < 2%; each try is a process start (~1.7 s of CPU).
TRIES = 10
AT_ONCE = 2  # processes interrupted side by side


def _start(*args):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
  proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "interrupt_worker.py"), *args], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
  return proc


def _interrupt_twice(procs, spacing_s):
  for p in procs:
    p.send_signal(signal.SIGINT)
  time.sleep(spacing_s)
  for p in procs:
    p.send_signal(signal.SIGINT)
  out = []
  for p in procs:
    try:
      p.wait(10)
    except subprocess.TimeoutExpired:  # the two signals came before the handler ran once: one more
      p.send_signal(signal.SIGINT)
      p.wait(10)
    out.append((p.returncode, p.stdout.read(), p.stderr.read()))
  return out


def test_a_second_ctrl_c_exits_130_every_time(tmp_path):
  results = []
  for i in range(0, TRIES, AT_ONCE):
    procs = []
    try:
      procs += [_start(str(tmp_path)) for _ in range(AT_ONCE)]
      results += _interrupt_twice(procs, SPACINGS_S[(i // AT_ONCE) % len(SPACINGS_S)])
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
  assert [rc for rc, _, _ in results] == [130] * TRIES, [(rc, err[-500:]) for rc, _, err in results if rc != 130]
  for _, out, err in results:
    assert "received SIGINT: finishing the current step" in out
    assert err.strip().splitlines()[-1] == ("tunixlike.train: error: interrupted (a second Ctrl-C); no checkpoint "
                                            "was saved yet; the same command starts the run again")


def test_the_second_ctrl_c_line_names_the_checkpoint_the_workdir_keeps(tmp_path):
  import jax.numpy as jnp  # noqa: PLC0415
  from tunixlike import checkpoint  # noqa: PLC0415
  schedule = checkpoint.CheckpointSchedule(keep=1, every_steps=0, every_seconds=0)
  with checkpoint.Checkpointer(checkpoint.workdir_checkpoints(tmp_path), schedule) as saved:
    saved.save(3, {"w": jnp.ones(4)}, {"step": 3}, force=True)
  proc = _start(str(tmp_path))
  try:
    (rc, _, err), = _interrupt_twice([proc], 0.1)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert rc == 130
  assert err.strip().splitlines()[-1] == ("tunixlike.train: error: interrupted (a second Ctrl-C); the checkpoint "
                                          "of step 3 is kept; the same command resumes from it")


def _catches(pid: int, sig: int) -> bool:
  """Whether process `pid` has a handler for `sig` (Linux: the SigCgt mask of /proc/PID/status)."""
  with open(f"/proc/{pid}/status") as f:
    caught = next(int(l.split()[1], 16) for l in f if l.startswith("SigCgt:"))
  return bool(caught >> (sig - 1) & 1)


def test_a_sigterm_during_start_up_stops_the_run_at_once_with_a_line(tmp_path):
  # A million generated rows are formatted and length-checked at start-up: about a minute, which no
  # loop of that pass looked up a preemption in (the run went on for minutes after its SIGTERM).
  args = ["--config", "configs/addition_grpo.py:size=tiny", "--config.data.train_size=1000000",
          "--config.log.progress_bar=false", f"--workdir={tmp_path / 'run'}"]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  proc = subprocess.Popen([sys.executable, "-m", "tunixlike.train", *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 120  # the run's handler is installed once its imports are done
    while not _catches(proc.pid, signal.SIGTERM):
      assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
      time.sleep(0.05)
    time.sleep(1.0)  # into the rows' pass
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)  # a hang, not a slow machine, fails this
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
  assert err.strip().splitlines()[-1] == ("tunixlike.train: error: received SIGTERM during start-up: stopped before "
                                          "the first step (nothing to save yet; the same command starts the run "
                                          "again)")
  assert "finishing the current step" not in out and "Traceback" not in err
  assert not list((tmp_path / "run").glob("checkpoints/*"))
