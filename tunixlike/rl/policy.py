"""The runtime's view of the learner: train on rollout groups, hand weights to the sampler."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from tunixlike import distributed, trace as trace_lib
from tunixlike.config import Config
from tunixlike.learner import offload as offload_lib, value as value_lib
from tunixlike.learner import token_advantages as token_adv_lib
from tunixlike.learner.batch import assemble_batch, pick_bucket
from tunixlike.learner.train_step import Learner
from tunixlike.rl import weight_sync
from tunixlike.rollout import RolloutGroup
from tunixlike.sampler.engine import Engine


class PolicyLearner:
  """The runtime's view of the learner: train on groups, hand weights to the sampler."""

  def __init__(self, learner: Learner, engine: Engine, cfg: Config, pad_id: int, *, tracer=trace_lib.NULL_TRACER):
    self.learner, self.engine, self.cfg, self.pad_id, self.tracer = learner, engine, cfg, pad_id, tracer
    self.version = 0
    mesh = learner.mesh
    self.num_processes = 1 if mesh is None else len({d.process_index for d in mesh.devices.flat})
    # This process's rows of each batch (all of them with one process).
    self.num_rows = cfg.rl.prompts_per_step * cfg.algo.group_size // self.num_processes
    longest = cfg.sampler.max_prefill_length + cfg.sampler.max_new_tokens
    self.seq_buckets = tuple(sorted({min(b, longest) for b in (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)}
                                    | {longest}))
    self._rng = jax.random.PRNGKey(cfg.seed)
    self.lora = learner.lora
    self._sampler_params = None  # LoRA sync keeps the sampler's base weights and swaps adapters only
    self._packed = None  # (adapters, their packed buffer): LoRA packing queued behind the train step
    # The adapters' sampler shardings are the same every sync: looked up once.
    self._adapter_shardings = (weight_sync.subtree_like(engine.param_shardings, learner.state.params)
                               if self.lora else None)
    # Per-token advantages (process rewards, on-policy distillation), or None for the group advantage.
    a = cfg.algo
    process_coef = a.process_reward_coef if a.process_reward is not None else 0.0
    distill_coef = 1.0 if a.advantage == "distill" else 0.0
    self.token_advantages = (token_adv_lib.TokenAdvantageConfig(process_coef=process_coef, distill_coef=distill_coef)
                             if process_coef or distill_coef else None)
    self._devices = ([jax.devices()[0]] if mesh is None  # this process's learner devices (for memory stats)
                     else [d for d in mesh.devices.flat if d.process_index == jax.process_index()])

  def train(self, groups: list[RolloutGroup]) -> dict[str, float]:
    a = self.cfg.algo
    buckets = self.seq_buckets
    if self.cfg.optim.group_by_length:  # micro-batches are trimmed in the step: one T, one compilation
      buckets = buckets[-1:]
    elif self.num_processes > 1:  # every process's share must have the same length T: the longest bucket
      longest = max((len(g.prompt_token_ids) + c.num_tokens for g in groups for c in g.completions), default=1)
      buckets = (distributed.max_over_processes(pick_bucket(longest, self.seq_buckets)),)
    batch = assemble_batch(groups, num_rows=self.num_rows, seq_buckets=buckets, advantage=a.advantage,
                           pad_id=self.pad_id, overlong_max_length=self.cfg.sampler.max_new_tokens,
                           overlong_buffer=a.overlong_buffer, overlong_penalty=a.overlong_penalty,
                           sampling_mask=a.keep_sampling_mask, routing=self.cfg.sampler.record_routing,
                           token_advantages=self.token_advantages)
    with self.tracer.span("train_step", cat="learner", version=self.version):
      placed = self.learner.put_batch(batch)
      rng = jax.random.fold_in(self._rng, self.version)
      self.learner.state, metrics = self.learner.train_step(self.learner.state, placed, rng)
      if self.lora and self._sampler_params is not None:  # before waiting: the pack runs right after the step
        adapters = self.learner.state.params
        self._packed = (adapters, weight_sync.pack(adapters, self._adapter_shardings, dtype=self.cfg.rl.sync_dtype))
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not metrics.get("nonfinite", 0.0):
      self.version += 1
    metrics["skipped"] = metrics.get("nonfinite", 0.0)
    peak = offload_lib.peak_device_memory(self._devices)  # None where the backend keeps no stats (CPU)
    if peak is not None:
      metrics["learner/peak_bytes"] = float(peak)
    return metrics

  @property
  def synced_params(self) -> Any:
    """The params last handed to the sampler (on this process's sampler devices), or None."""
    return self._sampler_params

  def full_params(self) -> nnx.State:
    model = self.learner.model(self.learner.state)
    if isinstance(model, value_lib.PolicyWithValue):  # PPO: the sampler gets the policy, not the critic
      model = model.policy
    return nnx.split(model)[1]

  def sampler_weights(self) -> tuple[Any, float]:
    """(params on this process's sampler devices, sync ms). On several processes every process
    must call this at the same point (the learner arrays are all-gathered across hosts)."""
    with self.tracer.span("weight_sync", cat="sync", version=self.version, lora=self.lora):
      if not self.lora or self._sampler_params is None:
        params, ms = weight_sync.sync(self.full_params(), self.engine.param_shardings, dtype=self.cfg.rl.sync_dtype)
      else:
        adapters = self.learner.state.params
        packed_for, packed = self._packed or (None, None)
        source = packed if packed_for is adapters and packed is not None else adapters  # not if restored since
        self._packed = None
        synced, ms = weight_sync.sync(source, self._adapter_shardings, dtype=self.cfg.rl.sync_dtype,
                                      keep_packed=True)
        params = weight_sync.replace_leaves(self._sampler_params, synced)
      self._sampler_params = params
    return params, ms
