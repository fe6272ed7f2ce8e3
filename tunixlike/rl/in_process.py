"""`InProcess`: the `rl.transport.Transport` of a run whose sampler side is in this process (split
or colocated meshes). The driver admits from and scores into the learner's own `RolloutQueue`;
weights cross by `jax.device_put` (the policy's own `weight_sync`); a fault is this process's own
exception, and there is no peer to tell.
"""

from __future__ import annotations

from typing import Callable

import jax

from tunixlike import distributed, mesh as mesh_lib
from tunixlike.rl.prompts import PromptStream
from tunixlike.rl.transport import PeerFault, SamplerSide


class InProcess:
  """The sampler side in this process: a shared queue, `jax.device_put` weight sync; every process
  decodes and learns. `compose(setup, rl, stream, queue, **kw)` builds its `SamplerSide`
  (`build.local_sampler_side`)."""

  checkpoint_processes = None
  learns = True

  def __init__(self, cfg, compose: Callable[..., SamplerSide]):
    if cfg.mesh.sampler_hosts:  # whole sampler hosts start with their rendezvous, before JAX does
      raise ValueError(f"mesh.sampler_hosts={cfg.mesh.sampler_hosts}: whole sampler hosts are started by the entry "
                       "point (tunixlike.train, python -m tunixlike.train: `tunixlike.layouts.start`)")
    self.mesh, self.compose = cfg.mesh, compose

  @property
  def decoders(self) -> int:
    return jax.process_count()

  @property
  def data_shard(self) -> tuple[int, int]:
    return jax.process_index(), jax.process_count()

  def meshes(self) -> mesh_lib.Meshes:
    m = self.mesh
    return mesh_lib.make_meshes(m.sampler_devices, m.learner_devices, m.sampler_tensor, m.learner_tensor,
                                layout=m.layout)

  def describe(self) -> list[str]:
    return []

  def engine(self, make):
    return make()

  def weight_sync(self, setup, learner):
    return None

  def eval_weights(self, setup, rl):
    synced = rl.policy.sync_weights()
    return synced.params, synced.version

  def stream(self, pipe, states=None, kept=None):
    if states is None:
      return PromptStream(pipe)
    mine, = states
    return PromptStream(pipe, mine["position"], replay=mine["outstanding"],
                        kept=kept.stream_indices if kept is not None else ())

  def own(self, states):
    return [states[jax.process_index()]]

  def stream_states(self, stream, own):
    return distributed.allgather_json(own) if distributed.is_multiprocess() else None

  def start(self, stream) -> None:
    pass

  def sampler_side(self, setup, rl, stream, queue, *, on_fault=None, **kw) -> SamplerSide:
    return self.compose(setup, rl, stream, queue, **kw)  # a fault here is this process's own exception

  def stop_asked(self) -> str | None:
    return None

  def end(self, failure=None, host=None) -> None:
    pass

  def fault_elsewhere(self) -> PeerFault | None:
    return None
