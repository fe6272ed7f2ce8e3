"""Start N processes on 127.0.0.1 as one multi-controller JAX job (CPU, virtual devices each) and
collect what each printed: the launcher of every several-process test (tests/test_multihost.py,
tests/hosts/)."""

import os
import socket
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def lines(out: str, tag: str) -> list[str]:
  """The lines of `out` that start with `tag ` (without it)."""
  return [l[len(tag) + 1:] for l in out.splitlines() if l.startswith(tag + " ")]


def run_processes(argv: list[str], n: int, tmp_path, *, timeout_s: float = 180, devices: int = 4,
                  kill: tuple[int, str, int] | None = None, name: str = "process") -> list[tuple[int, str]]:
  """Starts `n` processes of `argv` as one job; returns (exit code, output) of each, in process order.

  Process i gets JAX_PROCESS_ID=i, the coordinator on a free port, `devices` virtual CPU devices.
  All are killed when one fails or `timeout_s` runs out. `kill=(i, text, signal)`: send process i
  `signal` (SIGKILL: a host that dies mid-run; SIGTERM: a preemption) once its output shows
  `text`; the processes are then left to stop by themselves.
  """
  port = free_port()
  procs, logs = [], [open(tmp_path / f"{name}_{i}.log", "w+") for i in range(n)]
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if not f.startswith("--xla_force_host_platform_device_count"))
  try:
    for i in range(n):
      env = {**os.environ, "JAX_PLATFORMS": "cpu",
             "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
             "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(n), "JAX_PROCESS_ID": str(i),
             "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
      procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=logs[i], stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    killed = False
    while None in [p.poll() for p in procs]:  # a list: every process polled
      if kill is not None and not killed and kill[1] in (tmp_path / f"{name}_{kill[0]}.log").read_text():
        procs[kill[0]].send_signal(kill[2])
        killed = True
      if time.monotonic() > deadline or (not kill and any(p.returncode not in (None, 0) for p in procs)):
        time.sleep(2)  # let the others report their error too
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait(timeout=30)
  outs = []
  for f in logs:
    f.seek(0)
    outs.append(f.read())
    f.close()
  return [(p.returncode, out) for p, out in zip(procs, outs)]

