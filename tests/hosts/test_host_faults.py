"""Whole hosts per side under start-up mistakes, strangers and a dead coordinator: real processes
of `python -m tunixlike.train` (or a library worker) on 127.0.0.1, each fault ending every host in
one line that names the host, the address or port, or the keys (`hosts.rendezvous`, `hosts.seal`,
`hosts.watch`). Start-up faults exit 2 before JAX starts, so each job here costs its processes'
imports only, except the dead-coordinator run."""

import json
import os
import signal
import socket
import sys
import threading
import time

import pytest

from multiprocess_job import ROOT, lines, local_job, run_processes
from test_by_host_cli import ERROR, by_host, command
from tunixlike.hosts import seal

pytestmark = pytest.mark.multihost
FAST_TIMEOUT = ["--config.mesh.host_timeout_s=4"]
JAX_TRACE = ("Check failure stack trace", "client.h", "RegisterTask", "Traceback")


def last_error(out: str) -> str:
  errors = [l for l in out.splitlines() if l.startswith(ERROR)]
  assert errors, out[-3000:]
  return errors[-1][len(ERROR):]


def one_line_each(results, status: int = 2) -> list[str]:
  """Every process exited `status` with its error as its last line and no JAX trace or traceback."""
  out = []
  for i, (rc, text) in enumerate(results):
    assert rc == status, f"process {i} exit {rc}:\n{text[-3000:]}"
    assert text.strip().splitlines()[-1].startswith(ERROR), text[-3000:]
    assert not any(t in text for t in JAX_TRACE), text[-3000:]
    out.append(last_error(text))
  return out


def job(tmp_path, n=2, flags=(), **kwargs):
  """A 1 + (n - 1) job on its own coordinator port (returned, with the results)."""
  port = local_job.free_port(following=n)
  env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", **kwargs.pop("env", {})}
  argv = command(tmp_path) + by_host(1, n - 1) + FAST_TIMEOUT + list(flags) + [f"--workdir={tmp_path / 'w'}"]
  return port, run_processes(argv, n, tmp_path, devices=2, timeout_s=120, env=env, wait_all=True, **kwargs)


def test_a_process_that_never_comes_is_named_and_strangers_are_refused(tmp_path):
  port = local_job.free_port(following=3)
  refusals = []

  def stranger():  # knocks on the coordinator's port without the secret while the job starts
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(refusals) < 2:
      try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
          s.recv(100)
          s.sendall(b"\x00\x00\x00\x02{}")
          refusals.append(s.recv(100))
      except OSError:
        time.sleep(0.1)

  threading.Thread(target=stranger, daemon=True).start()
  argv = command(tmp_path) + by_host(1, 2) + FAST_TIMEOUT + [f"--workdir={tmp_path / 'w'}"]
  results = run_processes(argv, 3, tmp_path, devices=2, timeout_s=120, only=[0, 1], wait_all=True,
                          env={"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"})
  want = (f"process ids [2] did not reach the coordinator 127.0.0.1:{port} within 4 s (mesh.host_timeout_s): start "
          "them with the same JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES=3, and check that they reach it (address, "
          "port, firewall)")
  assert one_line_each(results) == [want, want]
  assert refusals and all(b"refused" in r for r in refusals)
  assert "refused a connection from 127.0.0.1 to the coordinator port" in results[0][1]


def test_busy_and_wrong_ports_are_named(tmp_path):
  # the coordinator's port taken (bound, not listening: a connection is refused)
  port = local_job.free_port(following=2)
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", port))
    env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"}
    argv = command(tmp_path) + by_host(1, 1) + FAST_TIMEOUT + [f"--workdir={tmp_path / 'w'}"]
    results = run_processes(argv, 2, tmp_path, devices=2, timeout_s=120, env=env, wait_all=True)
  host0, host1 = one_line_each(results)
  assert host0.startswith(f"host 0: cannot listen on the coordinator address 127.0.0.1:{port} (Address already in "
                          f"use): another process listens there (`ss -ltnp 'sport = :{port}'`)"), host0
  assert host1 == (f"host 1: nothing answered at the coordinator 127.0.0.1:{port} within 4 s (mesh.host_timeout_s): "
                   "start process 0 there, and check JAX_COORDINATOR_ADDRESS / distributed.coordinator_address (host "
                   "and port) and the firewall")
  # host 1's transfer port (coordinator port + 2) taken: both hosts say so
  port = local_job.free_port(following=2)
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", port + 2))
    results = run_processes(argv, 2, tmp_path, devices=2, timeout_s=120, wait_all=True,
                            env={"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"})
  lines_ = one_line_each(results)
  assert lines_[0] == lines_[1]
  assert lines_[0].startswith(f"host 1: the transfer port (coordinator port + 1 + process id) at 127.0.0.1:{port + 2} "
                              "cannot be used (Address already in use)"), lines_[0]
  # host 1 given another port than host 0's: each names what it waited for
  port = local_job.free_port(following=2)
  results = run_processes(argv, 2, tmp_path, devices=2, timeout_s=120, wait_all=True,
                          env={"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"},
                          envs={1: {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port + 5}"}})
  host0, host1 = one_line_each(results)
  assert host0.startswith("process ids [1] did not reach the coordinator"), host0
  assert host1.startswith(f"host 1: nothing answered at the coordinator 127.0.0.1:{port + 5} within 4 s"), host1


def test_hosts_with_another_config_or_secret_are_refused(tmp_path):
  config = tmp_path / "mismatch.py"
  argv = command(tmp_path)
  base = argv[argv.index("--config") + 1]
  config.write_text(f"import os\nfrom tunixlike import config\n\ndef get_config(arg=None):\n"
                    f"  c = config.load({base!r})\n  c.seed = int(os.environ.get('TEST_SEED', '0'))\n"
                    f"  c.rl.max_staleness = int(os.environ.get('TEST_STALENESS', '1'))\n  return c\n")
  argv[argv.index("--config") + 1] = str(config)
  argv += by_host(1, 1) + FAST_TIMEOUT + [f"--workdir={tmp_path / 'w'}"]
  port = local_job.free_port(following=2)
  results = run_processes(argv, 2, tmp_path, devices=2, timeout_s=120, wait_all=True,
                          env={"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"},
                          envs={1: {"TEST_SEED": "1", "TEST_STALENESS": "2"}})
  want = "host 1 runs another config than host 0: rl.max_staleness, seed differ (every host must run the same command)"
  assert one_line_each(results) == [want, want]
  # another secret: host 0 refuses it and waits for a process 1 that holds the run's
  port = local_job.free_port(following=2)
  results = run_processes(argv, 2, tmp_path, devices=2, timeout_s=120, wait_all=True,
                          env={"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"},
                          envs={1: {seal.ENV_SECRET: "not the run's"}})
  host0, host1 = one_line_each(results)
  assert host0.startswith("process ids [1] did not reach the coordinator"), host0
  assert host1 == (f"host 1: process 0 at 127.0.0.1:{port} refused this host: its secret differs "
                   "(TUNIXLIKE_HOSTS_SECRET / TUNIXLIKE_HOSTS_SECRET_FILE must be the same on every host)")


def test_forged_and_replayed_entries_are_refused_and_counted_and_the_coordinator_listens_where_told(tmp_path):
  worker = os.path.join(ROOT, "tests", "hosts", "forged_worker.py")
  (rc0, out0), (rc1, out1) = run_processes([sys.executable, worker], 2, tmp_path, devices=1, timeout_s=120)
  assert rc0 == 0 and rc1 == 0, out0[-3000:] + out1[-3000:]
  assert json.loads(lines(out0, "GOT")[0]) == ["first", "second"]
  assert lines(out0, "REFUSED") == ["3"]
  assert "replayed (sequence 1 of host 1)" in out0 and "its seal does not verify" in out0
  # the coordinator listens on the address it was given, not on every interface (JAX's default)
  assert json.loads(lines(out0, "ELSEWHERE")[0]) == {"127.0.0.1": True, "127.0.0.2": False, "::1": False}


def test_a_dead_coordinator_host_is_one_line_on_the_others(tmp_path):
  argv = command(tmp_path) + by_host(1, 1) + ["--config.mesh.host_timeout_s=30", "--config.rl.num_steps=50",
                                              f"--workdir={tmp_path / 'w'}"]
  (rc0, _), (rc1, out1) = run_processes(argv, 2, tmp_path, devices=2, timeout_s=240,
                                        send=local_job.Signal(0, "weights v1 (model) arrived", signal.SIGKILL, watch=1))
  assert rc0 == -signal.SIGKILL
  assert rc1 == 1, out1[-3000:]
  coordinator = [l for l in out1.splitlines() if l.startswith(ERROR)][-1]
  assert coordinator.startswith(f"{ERROR}host 1: lost the coordination service at 127.0.0.1:"), out1[-3000:]
  assert coordinator.endswith("learner host 0 died or the network to it failed; run the same command again on every "
                              "host to resume from the learner hosts' last checkpoint")
  assert out1.strip().splitlines()[-1] == coordinator
  assert not any(t in out1 for t in JAX_TRACE), out1[-3000:]


@pytest.mark.multihost_long
def test_a_dead_learner_host_is_named_on_the_others(tmp_path):
  """2 learner hosts + 1 sampler host, learner host 1 killed: JAX's coordination service stops the job
  after its heartbeat timeout (2 x mesh.host_timeout_s + 60 s), and each host's watcher names host 1."""
  argv = command(tmp_path) + ["--config.mesh.sampler_hosts=1", "--config.mesh.sampler_devices=2",
                              "--config.mesh.learner_devices=4", "--config.mesh.host_timeout_s=4",
                              "--config.rl.num_steps=50", f"--workdir={tmp_path / 'w'}"]
  results = run_processes(argv, 3, tmp_path, devices=2, timeout_s=300,
                          send=local_job.Signal(1, "weights v2 ", signal.SIGKILL, watch=2))
  assert [rc for rc, _ in results] == [1, -signal.SIGKILL, 1], [out[-2000:] for _, out in results]
  for rc, out in (results[0], results[2]):
    assert last_error(out).endswith("JAX's coordination service stopped the job: host 1 sent no heartbeat in time "
                                    "(it died or hangs); run the same command again on every host to resume from the "
                                    "learner hosts' last checkpoint"), out[-3000:]
    assert out.strip().splitlines()[-1].startswith(ERROR) and not any(t in out for t in JAX_TRACE), out[-3000:]
