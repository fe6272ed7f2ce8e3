"""The by-host layout: whole processes decode, whole processes train (mesh.sampler_hosts > 0).

Processes 0 .. L-1 are learner hosts and L .. N-1 sampler hosts (process 0, the coordinator's host,
trains, logs and checkpoints; a sampler host that dies does not take the coordinator with it). The
learner mesh ('fsdp', 'tensor') spans every device of the learner hosts; each sampler host has its
own sampler mesh ('replica', 'tensor') over its own devices, and computes only there, so no global
computation ever includes a sampler host. Weights reach sampler host j by cross-host
`jax.device_put` from host `senders[j]` (a learner host, round robin; `hosts.transfer` also takes a
sampler host that already has them, a relay) split evenly over both hosts' devices, since
cross-process device_put needs the same device count and shard shapes on both sides (JAX
docs/multi_process.md); sampler host j then spreads it to its replicas locally (an array its
tensor-parallel layout splits crosses in that layout instead: `hosts.transfer`). Every host must
have the same number of devices.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from tunixlike import mesh as mesh_lib

LEARNER, SAMPLER = "learner", "sampler"


@dataclasses.dataclass(frozen=True)
class HostLayout:
  learner_hosts: tuple[int, ...]
  sampler_hosts: tuple[int, ...]
  learner: Mesh  # every learner host's devices
  samplers: dict  # sampler process -> its sampler mesh (its own devices)
  senders: dict  # sampler process -> the process that sends it the weights

  def role(self, process: int | None = None) -> str:
    process = jax.process_index() if process is None else process
    return SAMPLER if process in self.samplers else LEARNER

  def receivers(self, process: int | None = None) -> list[int]:
    """The sampler hosts that learner host `process` sends weights to."""
    process = jax.process_index() if process is None else process
    return [s for s in self.sampler_hosts if self.senders[s] == process]

  def describe(self) -> list[str]:
    """One start-up line per host: its role and its devices."""
    lines = []
    for p in sorted(self.learner_hosts + self.sampler_hosts):
      if p in self.samplers:
        m = self.samplers[p]
        lines.append(f"host {p}: sampler, devices {[d.id for d in m.devices.flat]}, mesh {dict(m.shape)}, "
                     f"weights from host {self.senders[p]}")
      else:
        ids = [d.id for d in self.learner.devices.flat if d.process_index == p]
        lines.append(f"host {p}: learner, devices {ids}, learner mesh {dict(self.learner.shape)} "
                     f"over hosts {list(self.learner_hosts)}")
    return lines


def make_host_layout(sampler_hosts: int, sampler_tensor: int, learner_tensor: int,
                     devices: Sequence[jax.Device] | None = None) -> HostLayout:
  """The last `sampler_hosts` processes decode, the others train (a run passes its `mesh` keys)."""
  devices = list(jax.devices() if devices is None else devices)
  by_process: dict[int, list] = {}
  for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
    by_process.setdefault(d.process_index, []).append(d)
  n = len(by_process)
  if not 1 <= sampler_hosts < n:
    raise mesh_lib.MeshError(f"mesh.sampler_hosts={sampler_hosts} must be >= 1 and leave a learner host "
                             f"among the {n} processes")
  counts = {len(v) for v in by_process.values()}
  if len(counts) != 1:
    raise mesh_lib.MeshError(f"mesh.sampler_hosts needs the same device count on every host, got "
                             f"{ {p: len(v) for p, v in by_process.items()} } (cross-host device_put "
                             "moves between device sets of the same size)")
  local = counts.pop()
  for name, t in (("sampler_tensor", sampler_tensor), ("learner_tensor", learner_tensor)):
    if t < 1 or local % t:
      raise mesh_lib.MeshError(f"mesh.{name}={t} must divide the {local} devices per host "
                               "(a tensor group stays on one host)")
  procs = sorted(by_process)
  learners, samplers = tuple(procs[:n - sampler_hosts]), tuple(procs[n - sampler_hosts:])
  s_shape = (local // sampler_tensor, sampler_tensor)

  def sampler_mesh(p):
    return Mesh(np.array(by_process[p]).reshape(s_shape), mesh_lib.SAMPLER_AXES)

  learner_devices = [d for p in learners for d in by_process[p]]
  learner = Mesh(np.array(learner_devices).reshape(len(learner_devices) // learner_tensor, learner_tensor),
                 mesh_lib.LEARNER_AXES)
  senders = {s: learners[i % len(learners)] for i, s in enumerate(samplers)}
  return HostLayout(learner_hosts=learners, sampler_hosts=samplers, learner=learner,
                    samplers={s: sampler_mesh(s) for s in samplers}, senders=senders)
