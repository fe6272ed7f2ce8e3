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


def test_a_second_ctrl_c_exits_130_every_time():
  results = []
  for i in range(0, TRIES, AT_ONCE):
    procs = []
    try:
      procs += [_start() for _ in range(AT_ONCE)]
      results += _interrupt_twice(procs, SPACINGS_S[(i // AT_ONCE) % len(SPACINGS_S)])
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
  assert [rc for rc, _, _ in results] == [130] * TRIES, [(rc, err[-500:]) for rc, _, err in results if rc != 130]
  for _, out, err in results:
    assert "received SIGINT: finishing the current step" in out
    assert err.strip().splitlines()[-1] == ("tunixlike.train: error: interrupted (a second Ctrl-C); the last "
                                            "checkpoint is kept")
