"""The run's layout, chosen once, here at the entry: the one place that may import both `rl` and `hosts`.

    layouts.run(cfg, workdir)
      start(cfg, workdir): this process's part of the run started, and its `rl.transport.Transport`:
        mesh.sampler_hosts = 0   `build.start_processes`: the sampler side in every process (`InProcess`)
        mesh.sampler_hosts > 0   `hosts.rendezvous.initialize`, then `hosts.transport.CrossHost`
      a process that learns:    `rl.trainer.run(transport=...)`, which does not know which it has
      a process that decodes:   `hosts.sampler_host.run`, under the same workdir lock and signals

A new layout (elastic sampler hosts, a learner on another slice) is a new `Transport` chosen here.
"""

from __future__ import annotations

from typing import Any

import jax

from tunixlike import workdir as workdir_lib
from tunixlike.config import Config
from tunixlike.hosts import rendezvous, sampler_host
from tunixlike.hosts.transport import CrossHost
from tunixlike.rl import build, trainer
from tunixlike.rl.transport import Transport


def start(cfg: Config, workdir: str) -> Transport:
  """This process's part of the run started (whole sampler hosts: their rendezvous first) and the run's
  layout; bad keys or processes raise `trainer.SetupError` (one line). Before anything touches a JAX
  backend; the processes are started once (a second call reuses them)."""
  try:
    if not cfg.mesh.sampler_hosts:
      return build.start_processes(cfg)
    rendezvous.initialize(cfg.distributed, rendezvous.hello(cfg))
    return CrossHost(cfg, workdir_lib.local_dir(workdir, jax.process_index()))
  except ValueError as e:
    raise trainer.SetupError(str(e)) from e


def run(cfg: Config, workdir: str, *, on_second_interrupt=None, **kw) -> dict[str, Any]:
  """`rl.trainer.run` on the layout `start` chose; a process that only decodes samples for the learner's
  processes until they end the run (`decode`). `kw`: `trainer.run`'s."""
  transport = start(cfg, workdir)
  if transport.learns:
    return trainer.run(cfg, workdir, transport=transport, on_second_interrupt=on_second_interrupt, **kw)
  with trainer.claimed(workdir, on_second_interrupt) as preemption:
    return decode(cfg, workdir, transport, preemption, **kw)


def decode(cfg: Config, workdir: str, transport: Transport, preemption, *, hooks=(), on_host_fault=None,
           **user) -> dict[str, Any]:
  """A sampler host's run: it samples for the learner hosts until they end the run; the learner hosts
  keep the logs, evals and checkpoints (`hosts.sampler_host`); `hooks` and `on_host_fault` are theirs."""
  setup = trainer.built(cfg, preemption, transport=transport, **user)
  say = lambda line: print(line, flush=True)
  say(transport.describe()[jax.process_index()])
  preemption.say = say
  try:
    return sampler_host.run(setup, preemption, say=say)
  finally:
    setup.tracer.close()
