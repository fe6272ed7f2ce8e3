"""`CrossHost`: the `rl.transport.Transport` of whole sampler hosts (mesh.sampler_hosts > 0), the
learner hosts' end.

    rollouts      sampler hosts -> key-value store -> this host's queue (`learner_host.RemoteSampling`)
    weights       policy -> cross-host `jax.device_put` (`weights.Sender`; a sampler host's `Receiver`)
    stop, faults  both ways through the store (`learner_host`: START, STOP_REQUEST, OVER)

The sampler hosts' end is `sampler_host.run`, which composes the same sampler side as one host.
"""

from __future__ import annotations

import json

import jax

from tunixlike import distributed, mesh as mesh_lib
from tunixlike.hosts import kv, learner_host, weights
from tunixlike.hosts.layout import HostLayout
from tunixlike.rl import transport, weight_sync


class CrossHost:
  """Whole sampler hosts: rollouts and control through the key-value store, weights by cross-host
  `jax.device_put`; checkpoints are the learner hosts' alone."""

  def __init__(self, cfg, layout: HostLayout):
    self.cfg, self.layout = cfg, layout

  @property
  def checkpoint_processes(self):
    return distributed.group()  # the learner hosts (`build`: their process group)

  @property
  def stream_readers(self) -> int:
    return len(self.layout.sampler_hosts)  # each sampler host reads its shard of the prompts

  def describe(self) -> list[str]:
    return self.layout.describe()

  def engine(self, make):
    return None  # the sampler hosts sample: this host only evaluates

  def weight_sync(self, setup, learner, *, dump_dir: str | None = None) -> weight_sync.WeightSync:
    """Full weights, or LoRA's adapters after the first, to every sampler host; the targets are the
    sampler's shardings on a sampler host's mesh. `dump_dir`: where learner host 0 writes what it
    sends (mesh.save_synced_weights)."""
    from tunixlike.models import sharding as sharding_lib
    cfg, layout = self.cfg, self.layout
    model_state = learner.sampler_params(learner.state)
    targets = sharding_lib.state_shardings(model_state, layout.samplers[layout.sampler_hosts[0]],
                                           mesh_lib.SAMPLER_RULES)
    parts = {weights.MODEL: jax.tree.structure(model_state)}
    if learner.lora:
      parts[weights.ADAPTERS] = jax.tree.structure(learner.state.params)
    sender = weights.Sender(layout, parts, timeout_s=cfg.mesh.host_timeout_s, dump_dir=dump_dir)
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
