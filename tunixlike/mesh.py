"""The device mesh, split into a sampler submesh and a learner submesh.

Sampler axes: ('replica', 'tensor'): data-parallel decode replicas x tensor parallelism within one.
Learner axes: ('fsdp', 'tensor'): fully-sharded data parallelism x tensor parallelism.
With several processes (hosts) the split is made per host: every host gives its first local devices
to the sampler and the rest to the learner, so that weight sync never crosses hosts (multi-controller
JAX refuses a cross-host device_put between different device sets; see DESIGN "Weight sync").
The learner mesh then spans every host (FSDP collectives cross hosts; all processes step it in
lockstep), while each process's sampler mesh holds only its own sampler devices: the sampler's
computations stay on one host, so its timing can never desynchronise the processes.

The colocated layout puts both submeshes on all devices (each host's sampler mesh on its own
devices): nothing is copied between device sets, and the two sides take turns
(`device_turns.DeviceTurns`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

LAYOUTS = ("split", "colocated")  # mesh.layout: own devices per side, or all devices shared
SAMPLER_AXES = ("replica", "tensor")
LEARNER_AXES = ("fsdp", "tensor")

# Logical parameter / activation axis -> mesh axis. Parameters carry logical names
# (nnx.with_partitioning); these rules decide where each lands on either submesh.
LEARNER_RULES = (
    ("batch", "fsdp"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("expert", None),
)
# The sampler replicates weights across replicas (each replica decodes its own slots) and
# splits them only along the tensor axis.
SAMPLER_RULES = (
    ("batch", "replica"),
    ("vocab", "tensor"),
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("expert", None),
)


class MeshError(ValueError):
  """Submesh sizes that do not divide or do not add up."""


@dataclasses.dataclass(frozen=True)
class Meshes:
  sampler: Mesh  # this process's sampler devices only (all of them with one process)
  learner: Mesh  # every process's learner devices
  # Whole hosts per side (mesh.sampler_hosts, `hosts.layout.HostLayout`): on a learner host `sampler`
  # is its own devices, where it evaluates; on a sampler host `learner` has none of its devices.
  hosts: object | None = None

  @property
  def colocated(self) -> bool:
    """Sampler and learner share their devices (mesh.layout='colocated')."""
    return self.hosts is None and set(self.sampler.devices.flat) <= set(self.learner.devices.flat)

  @property
  def num_processes(self) -> int:
    """How many processes the learner mesh spans (1: single-controller, plain device_put sync)."""
    return len({d.process_index for d in self.learner.devices.flat})


def split_devices(sampler_devices: int, learner_devices: int,
                  devices: Sequence[jax.Device]) -> tuple[list, list]:
  """Per-host split: each process gives its first local devices to the sampler."""
  total = sampler_devices + learner_devices
  if total != len(devices):
    # CPU devices are virtual: a process has as many as XLA_FLAGS says when JAX starts (1 by default).
    hint = (f" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={total} set before JAX starts makes "
            f"{total})" if devices and devices[0].platform == "cpu" else "")
    raise MeshError(f"mesh.sampler_devices={sampler_devices} + mesh.learner_devices="
                    f"{learner_devices} = {total}, but there are {len(devices)} devices{hint}")
  by_process: dict[int, list] = {}
  for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
    by_process.setdefault(d.process_index, []).append(d)
  n_proc = len(by_process)
  for name, n in (("sampler_devices", sampler_devices), ("learner_devices", learner_devices)):
    if n % n_proc:
      raise MeshError(f"mesh.{name}={n} is not divisible by the {n_proc} processes "
                      "(the split is made per host)")
  s_local = sampler_devices // n_proc
  sampler, learner = [], []
  for local in by_process.values():
    if len(local) != total // n_proc:
      raise MeshError(f"processes have unequal device counts ({[len(v) for v in by_process.values()]})")
    sampler += local[:s_local]
    learner += local[s_local:]
  return sampler, learner


def make_meshes(sampler_devices: int, learner_devices: int, sampler_tensor: int, learner_tensor: int,
                devices: Sequence[jax.Device] | None = None, *, layout: str) -> Meshes:
  """Builds both submeshes from `devices` (default: all devices of the default backend): a run passes its
  `mesh` keys. layout='colocated': both on all sampler_devices + learner_devices devices."""
  if layout not in LAYOUTS:
    raise MeshError(f"mesh.layout={layout!r} must be 'split' or 'colocated'")
  # Colocated, only the total counts: one device is sampler_devices=1, learner_devices=0.
  least = 0 if layout == "colocated" else 1
  if sampler_devices < 1 or learner_devices < least:
    raise MeshError(f"mesh.sampler_devices={sampler_devices}, mesh.learner_devices={learner_devices}: each side "
                    f"needs a device (learner_devices=0 only with mesh.layout='colocated')")
  for name, n, of in (("sampler_tensor", sampler_tensor, sampler_devices),
                      ("learner_tensor", learner_tensor, learner_devices)):
    if n < 1 or of % n:
      raise MeshError(f"mesh.{name}={n} must be >= 1 and divide mesh.{name.split('_')[0]}_devices={of}")
  devices = list(jax.devices() if devices is None else devices)
  sampler, learner = split_devices(sampler_devices, learner_devices, devices)
  if layout == "colocated":  # the same device order on both sides, each host's devices together
    sampler = learner = sorted(devices, key=lambda d: (d.process_index, d.id))
    sampler_devices = learner_devices = len(devices)
  n_proc = len({d.process_index for d in devices})
  if n_proc > 1:
    # Each host decodes on its own sampler devices; a tensor group must not straddle hosts on
    # either side (a learner one would give two hosts the same batch rows).
    for name, n, of in (("sampler_tensor", sampler_tensor, sampler_devices),
                        ("learner_tensor", learner_tensor, learner_devices)):
      if (of // n_proc) % n:
        raise MeshError(f"mesh.{name}={n} must divide the {of // n_proc} {name.split('_')[0]} devices "
                        f"per host ({of} over {n_proc} processes)")
    sampler = [d for d in sampler if d.process_index == jax.process_index()]
    sampler_devices = len(sampler)
  # The tensor axis is innermost so a replica's tensor shards sit on one host's neighbouring devices.
  s_shape = (sampler_devices // sampler_tensor, sampler_tensor)
  l_shape = (learner_devices // learner_tensor, learner_tensor)
  return Meshes(sampler=Mesh(np.array(sampler).reshape(s_shape), SAMPLER_AXES),
                learner=Mesh(np.array(learner).reshape(l_shape), LEARNER_AXES))


def check_whole_heads(num_heads: int, num_kv_heads: int, sampler_tensor: int, learner_tensor: int) -> None:
  """Tensor parallelism must give each device whole heads: a head split over devices makes every
  layer's head reshape a cross-device exchange (and inference servers refuse it too)."""
  for key, size in (("mesh.sampler_tensor", sampler_tensor), ("mesh.learner_tensor", learner_tensor)):
    if num_heads % size or num_kv_heads % size:
      fits = [d for d in range(1, num_kv_heads + 1) if num_heads % d == 0 and num_kv_heads % d == 0]
      raise MeshError(f"{key}={size} does not divide the model's {num_heads} attention heads and {num_kv_heads} "
                      f"KV heads: each tensor-parallel device must hold whole heads; choose one of {fits}")


def logical_to_mesh(spec: Sequence[str | None], rules) -> jax.sharding.PartitionSpec:
  """Maps a tuple of logical axis names to a PartitionSpec with `rules`."""
  table = dict(rules)
  out = []
  for name in spec:
    if name is not None and name not in table:
      raise KeyError(f"logical axis {name!r} has no sharding rule (rules: {sorted(table)})")
    out.append(None if name is None else table[name])
  return jax.sharding.PartitionSpec(*out)
