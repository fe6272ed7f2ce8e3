"""A host that JAX's coordination service stops says why in one line, not with JAX's fatal trace
(mesh.sampler_hosts > 0).

When process 0 (learner host 0, which holds JAX's coordination service) dies, every other process's
JAX client aborts at once (`client.h: Terminating process because the JAX distributed service
detected fatal errors`, SIGABRT and a C++ stack trace): its error-polling stream to the service
breaks. When another process stays silent for JAX's heartbeat timeout, the service aborts every
process the same way. jaxlib 0.10.2 offers no way to turn that into a Python error:
`jax.distributed.initialize` takes no callback, and the client's `missed_heartbeat_callback`, given
a Python function, fails converting the status (`std::bad_cast`) and terminates all the same
(tried). So the CLI runs each host's process as the child of a small watcher (`supervise`): the
child is the run, its stderr passes through the watcher line by line, and when the child aborts
that way the watcher drops JAX's trace and says what happened, naming the silent host when JAX
does. The child dies with the watcher (PR_SET_PDEATHSIG on Linux), and the watcher hands it SIGTERM,
SIGINT and SIGHUP (the child has its own process group, so a Ctrl-C reaches it once).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading

ENV = "TUNIXLIKE_HOSTS_WATCHED"  # set in the child: the run itself
# The first line of JAX's abort on a lost coordination service, and the lines that announce it.
_FATAL = "Terminating process because the JAX distributed service detected fatal errors"
_PRELUDE = ("Polled an error from coordination service", "Failed to retrieve preemption notice",
            "coordination_service.cc")
# How JAX names a process that stopped sending heartbeats.
_SILENT = (re.compile(r"Task (\d+) heartbeat timeout"), re.compile(r"stopped sending heartbeats\):\s*(\d+)"))


def watched() -> bool:
  """Whether this process is the run under a watcher (the child)."""
  return os.environ.get(ENV) == "1"


def die_with_parent() -> None:
  """The child: killed when its watcher dies (a host killed with -9 takes its run with it)."""
  if sys.platform.startswith("linux"):
    try:
      ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
      pass


def supervise(prog: str, process_id: int, coordinator: str) -> int:
  """Runs this same command as the child and returns the status to exit with (see the module docstring)."""
  child = subprocess.Popen([sys.executable] + sys.orig_argv[1:], env={**os.environ, ENV: "1"}, stderr=subprocess.PIPE,
                           process_group=0)
  for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda s, _: child.send_signal(s))
  held: list[bytes] = []  # lines that may be JAX's abort: shown unless the child then aborts
  lost = threading.Event()
  for line in iter(child.stderr.readline, b""):
    text = line.decode(errors="replace")
    if _FATAL in text:
      lost.set()
    if held or lost.is_set() or any(p in text for p in _PRELUDE):
      held.append(line)
    else:
      sys.stderr.buffer.write(line)
      sys.stderr.flush()
  rc = child.wait()
  if lost.is_set() and rc == -signal.SIGABRT:
    print(f"{prog}: error: {_why(b''.join(held).decode(errors='replace'), process_id, coordinator)}; run the same "
          "command again on every host to resume from the learner hosts' last checkpoint", file=sys.stderr, flush=True)
    return 1
  for line in held:
    sys.stderr.buffer.write(line)
  sys.stderr.flush()
  return 128 - rc if rc < 0 else rc


def _why(jax_said: str, me: int, coordinator: str) -> str:
  silent = {int(m) for pattern in _SILENT for m in pattern.findall(jax_said)} - {me}
  if silent:
    return (f"host {me}: JAX's coordination service stopped the job: host {', '.join(map(str, sorted(silent)))} sent "
            "no heartbeat in time (it died or hangs)")
  if me == 0:
    return "host 0: JAX's coordination service stopped the job"
  return f"host {me}: lost the coordination service at {coordinator}: learner host 0 died or the network to it failed"
