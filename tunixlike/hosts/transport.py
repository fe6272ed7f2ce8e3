"""`CrossHost`: the `rl.transport.Transport` of whole sampler hosts (mesh.sampler_hosts > 0), chosen
at the entry (`tunixlike.layouts.start`, after `rendezvous.initialize`); the learner hosts' end.

    rollouts      sampler hosts -> key-value store -> this host's queue (`learner_host.RemoteSampling`)
    weights       policy -> cross-host `jax.device_put` (`weights.Sender`; a sampler host's `Receiver`)
    stop, faults  both ways through the store (`learner_host`: START, STOP_REQUEST, OVER)

The sampler hosts' end is `sampler_host.run`, which composes the same sampler side as one host.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import numpy as np

from tunixlike import distributed, mesh as mesh_lib
from tunixlike.hosts import kv, learner_host, weights
from tunixlike.hosts.layout import HostLayout, make_host_layout
from tunixlike.rl import transport, weight_sync


def check_split(cfg, n: int) -> None:
  """Keys that are totals over all hosts must split evenly: the batch over the learner hosts, the
  decode slots over the sampler hosts, of `n` processes."""
  s = cfg.mesh.sampler_hosts
  if not 0 < s < n:
    raise ValueError(f"mesh.sampler_hosts={s} must leave a learner host among the {n} processes")
  for key, total, hosts, what in (("rl.prompts_per_step", cfg.rl.prompts_per_step, n - s, "learner"),
                                  ("sampler.max_concurrent_decodes", cfg.sampler.max_concurrent_decodes, s, "sampler")):
    if total % hosts:
      raise ValueError(f"{key}={total} must be divisible by the {hosts} {what} processes (each host takes its share)")


class CrossHost:
  """Whole sampler hosts: rollouts and control through the key-value store, weights by cross-host
  `jax.device_put`; checkpoints are the learner hosts' alone. Built once the processes have started:
  the learner hosts' collectives leave the sampler hosts out from then on. `local_dir`: this
  process's logs, where mesh.save_synced_weights writes every weight sync it sends or receives."""

  def __init__(self, cfg, local_dir: str):
    self.cfg = cfg
    self.synced_weights_dir = os.path.join(local_dir, "synced_weights") if cfg.mesh.save_synced_weights else None
    n, s = jax.process_count(), cfg.mesh.sampler_hosts
    check_split(cfg, n)
    distributed.set_process_group(range(n - s))

  @functools.cached_property
  def layout(self) -> HostLayout:
    m = self.cfg.mesh
    return make_host_layout(m.sampler_hosts, m.sampler_tensor, m.learner_tensor)

  @property
  def checkpoint_processes(self):
    return distributed.group()  # the learner hosts (their process group)

  @property
  def decoders(self) -> int:
    return self.cfg.mesh.sampler_hosts

  @property
  def learns(self) -> bool:
    return jax.process_index() < jax.process_count() - self.cfg.mesh.sampler_hosts  # the last N processes decode

  @property
  def data_shard(self) -> tuple[int, int]:
    """Each sampler host its shard of the training prompts, each learner host its shard of the
    held-out ones (the side that reads them)."""
    me, learners = jax.process_index(), jax.process_count() - self.cfg.mesh.sampler_hosts
    return (me, learners) if self.learns else (me - learners, self.decoders)

  def meshes(self) -> mesh_lib.Meshes:
    """One learner mesh over the learner hosts, and as this process's sampler mesh its own devices
    (a learner host evaluates there)."""
    m, layout = self.cfg.mesh, self.layout
    local = len(jax.local_devices())
    for key, n, hosts in (("mesh.sampler_devices", m.sampler_devices, len(layout.sampler_hosts)),
                          ("mesh.learner_devices", m.learner_devices, len(layout.learner_hosts))):
      if n != hosts * local:
        raise mesh_lib.MeshError(f"{key}={n}: with mesh.sampler_hosts={m.sampler_hosts} it counts the devices of "
                                 f"its side's {hosts} hosts, {hosts} x {local} = {hosts * local}")
    me = jax.process_index()
    if me in layout.samplers:
      sampler = layout.samplers[me]
    else:  # the learner host's own devices, as a sampler mesh for its evals
      sampler = mesh_lib.Mesh(np.array(jax.local_devices()).reshape(local // m.sampler_tensor, m.sampler_tensor),
                              mesh_lib.SAMPLER_AXES)
    return mesh_lib.Meshes(sampler=sampler, learner=layout.learner, hosts=layout)

  def describe(self) -> list[str]:
    return self.layout.describe()

  def engine(self, make):
    return None  # the sampler hosts sample: this host only evaluates

  def weight_sync(self, setup, learner) -> weight_sync.WeightSync:
    """Full weights, or LoRA's adapters after the first, to every sampler host; the targets are the
    sampler's shardings on a sampler host's mesh. Learner host 0 writes what it sends to
    `synced_weights_dir` (mesh.save_synced_weights)."""
    from tunixlike.models import sharding as sharding_lib
    cfg, layout = self.cfg, self.layout
    model_state = learner.sampler_params(learner.state)
    targets = sharding_lib.state_shardings(model_state, layout.samplers[layout.sampler_hosts[0]],
                                           mesh_lib.SAMPLER_RULES)
    parts = {weights.MODEL: jax.tree.structure(model_state)}
    if learner.lora:
      parts[weights.ADAPTERS] = jax.tree.structure(learner.state.params)
    sender = weights.Sender(layout, parts, timeout_s=cfg.mesh.host_timeout_s, dump_dir=self.synced_weights_dir)
    return weight_sync.for_learner(learner, targets, dtype=cfg.rl.sync_dtype, across_hosts=sender,
                                   tracer=setup.tracer)

  def eval_weights(self, setup, rl):
    """A copy of this host's own weights on its own devices: the sampler hosts never wait for an eval."""
    params, _ = weight_sync.sync(rl.policy.full_params(), rl.eval_engine.param_shardings, dtype=self.cfg.rl.sync_dtype)
    return params, rl.policy.version

  def stream(self, pipe, states=None, kept=None):
    return learner_host.SamplerStreams(len(self.layout.sampler_hosts), states)

  def own(self, states):
    return states  # the learner hosts keep every sampler host's stream

  def stream_states(self, stream, own):
    return own  # `SamplerStreams.state()` is already every sampler host's, pooled by the learner hosts

  def start(self, stream) -> None:
    """Tells the sampler hosts where their prompt streams start (they wait for it)."""
    if jax.process_index() == 0:
      kv.put(learner_host.START, json.dumps({"streams": stream.states()}).encode())

  def sampler_side(self, setup, rl, stream, queue, *, on_fault=None, **kw) -> transport.SamplerSide:
    """The sampler hosts sample, score and send; this learner host's queue receives."""
    rl.policy.sync_weights()  # the first weights, to every sampler host
    sampling = learner_host.RemoteSampling(queue, jax.process_index(), self.layout.sampler_hosts,
                                           silence_timeout_s=self.cfg.mesh.host_timeout_s, on_fault=on_fault)
    return transport.SamplerSide(sampling, rewards=None, hooks=(sampling.count_refused,))

  def stop_asked(self) -> str | None:
    if jax.process_index() != 0:  # learner host 0 reads it; `agreed` tells the others
      return None
    host = kv.try_get(learner_host.STOP_REQUEST)
    return None if host is None else f"sampler host {host.decode()}"

  def end(self, failure: str | None = None, host: int | None = None) -> None:
    if failure is not None or jax.process_index() == 0:  # learner host 0 ends every run; any host a failed one
      learner_host.end_run(failure=failure, host=host)

  def fault_elsewhere(self) -> kv.HostTimeout | None:
    over = learner_host.run_over()
    return None if not over or not over["failure"] else kv.HostTimeout(over["failure"], over.get("host"))
