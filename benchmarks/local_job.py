"""Several processes of this machine as one multi-controller JAX job, each with its own virtual CPU
devices: how the tests and benchmarks run whole hosts (and the per-host split) without a cluster.
A launcher, not part of the library: benchmarks import it beside them, tests through
tests/multiprocess_job.py.

    results = local_job.run([sys.executable, "-m", "tunixlike.train", ...], 4, devices=2)
    for rc, output in results: ...

Process i gets JAX_PROCESS_ID=i, the coordinator on a free port of 127.0.0.1, the job's secret
(`tunixlike.hosts.seal`: one per job, in the environment, never on a command line) and `devices` CPU
devices (`xla_flags`, which the benchmarks' children use too), the same command as the others (as
on real hosts); the children import this same tunixlike. Every wait is bounded: when one process
fails, or the time runs out, the others are killed, so a test or benchmark never hangs on a job that
cannot finish.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import subprocess
import tempfile
import time
from typing import Mapping, Sequence

import tunixlike
from tunixlike.hosts import seal

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tunixlike.__file__)))
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass(frozen=True)
class Signal:
  """Send `signal` to process `process` once the output of process `watch` (default: `process`)
  contains `after` (SIGKILL: a host that dies mid-run; SIGTERM: a preemption). The job is then left
  to stop by itself."""

  process: int
  after: str
  signal: int
  watch: int | None = None


def free_port(following: int = 0) -> int:
  """A free port of 127.0.0.1 whose `following` next ports are free too (the coordinator's port:
  each process's transfer server takes the coordinator's port + 1 + its id)."""
  while True:
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    if port + following < 65536 and all(_free(p) for p in range(port + 1, port + 1 + following)):
      return port


def _free(port: int) -> bool:
  with socket.socket() as s:
    try:
      s.bind(("127.0.0.1", port))
      return True
    except OSError:
      return False


def xla_flags(devices: int, flags: str | None = None) -> str:
  """`flags` (default: $XLA_FLAGS) with `devices` virtual CPU devices in place of any count they set.
  Other platforms (GPU, TPU) ignore the flag."""
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  return " ".join([f for f in flags.split() if not f.startswith(_DEVICE_COUNT_FLAG)] + [f"{_DEVICE_COUNT_FLAG}={devices}"])


def device_env(devices: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
  """`env` (default: os.environ) for a child process with `devices` virtual CPU devices. XLA:CPU runs
  every virtual device's collectives on one thread pool sized by the host's cores (NPROC overrides the
  size); a large program can have one device wait in two collectives at once while the others wait in
  the first, with no thread left for the last device: a deadlock (a 64K-token row over 4 devices on 2
  cores). Four threads a device leave room. Other platforms ignore both variables."""
  env = dict(os.environ if env is None else env)
  env["XLA_FLAGS"] = xla_flags(devices, env.get("XLA_FLAGS", ""))
  env.setdefault("NPROC", str(4 * devices))
  return env


def _env(i: int, n: int, port: int, devices: int, extra: dict[str, str], secret: str) -> dict[str, str]:
  # Not device_env's NPROC: the job's processes run small programs (no deadlock seen) and the larger
  # pool cost tests/test_multihost.py's two processes 50 -> 58 CPU-s (one run each, 2026-11-28).
  return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(devices),
          "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(n), "JAX_PROCESS_ID": str(i),
          seal.ENV_SECRET: secret,
          "PYTHONPATH": os.pathsep.join([_PACKAGE_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
          **extra}


def run(argv: list[str], n: int, *, devices: int = 4, timeout_s: float = 180.0, log_dir: str | None = None,
        name: str = "process", send: Signal | None = None, env: dict[str, str] | None = None,
        cwd: str | None = None, only: Sequence[int] | None = None, envs: Mapping[int, dict] | None = None,
        wait_all: bool = False) -> list[tuple[int, str]]:
  """Runs `argv` on `n` processes as one job; returns each one's (exit code, output), in process order.

  Each process's output (stdout and stderr) goes to `log_dir/{name}_{i}.log` (a temporary directory
  when None). All are killed when one exits with an error (unless `send` is given: then the job
  is left to stop by itself after the signal; or `wait_all`) or when `timeout_s` runs out; a killed
  process's exit code is -9. `only`: the process ids started (a job whose other processes never
  come), in that order in the result; `envs`: more environment variables of process i (`envs[i]`).
  """
  only = list(range(n)) if only is None else list(only)
  with tempfile.TemporaryDirectory() as scratch:
    paths = [os.path.join(log_dir or scratch, f"{name}_{i}.log") for i in only]
    port, procs, secret = free_port(following=n), [], secrets.token_hex(32)
    try:
      for i, path in zip(only, paths):
        with open(path, "w") as log:  # the child keeps its own descriptor
          extra = {**(env or {}), **((envs or {}).get(i) or {})}
          procs.append(subprocess.Popen(argv, cwd=cwd, env=_env(i, n, port, devices, extra, secret), stdout=log,
                                        stderr=subprocess.STDOUT))
      deadline, sent = time.monotonic() + timeout_s, False
      watched = None if send is None else only.index(send.process if send.watch is None else send.watch)
      while None in [p.poll() for p in procs]:  # a list: every process polled
        if send is not None and not sent and send.after in _read(paths[watched]):
          procs[only.index(send.process)].send_signal(send.signal)
          sent = True
        if time.monotonic() > deadline or (send is None and not wait_all and
                                           any(p.returncode not in (None, 0) for p in procs)):
          time.sleep(2)  # let the others report their error too
          break
        time.sleep(0.2)
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
        p.wait(timeout=30)
    return [(p.returncode, _read(path)) for p, path in zip(procs, paths)]


def _read(path: str) -> str:
  with open(path, errors="replace") as f:
    return f.read()
