"""The policy being trained: the one owner of the learner state, its version, and its weights' way to the sampler."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tunixlike import distributed, trace as trace_lib
from tunixlike.config import Config
from tunixlike.learner import offload as offload_lib, prompt_rows, value as value_lib
from tunixlike.learner.batch import assemble_batch, pick_bucket
from tunixlike.learner.train_step import Learner
from tunixlike.rl import weight_sync
from tunixlike.rollout import RolloutGroup
from tunixlike.sampler import params as params_lib
from tunixlike.sampler.engine import Engine


def _state_leaves(state) -> list:
  """The arrays of a TrainState's model (trained and frozen), in the order `Policy._layout` indexes."""
  return jax.tree.leaves((state.params, state.frozen))


class Policy:
  """Trains on scored rollout groups, hands its weights to the sampler, and restores from checkpoints.

  `learner` (`train_step.Learner`, `ppo.PPOLearner`, or either behind `offload.OffloadedLearner`)
  is the compiled step; its `state` is written here and nowhere else. `version` counts the
  optimizer steps taken (= the policy version stamped on every token sampled with its weights).
  """

  def __init__(self, learner: Learner, engine: Engine, cfg: Config, pad_id: int, *, tracer=trace_lib.NULL_TRACER):
    self.learner, self.engine, self.cfg, self.pad_id, self.tracer = learner, engine, cfg, pad_id, tracer
    self.version = 0
    mesh = learner.mesh
    self.num_processes = 1 if mesh is None else len({d.process_index for d in mesh.devices.flat})
    # This process's rows of each batch (all of them with one process): a row per completion, or per
    # group with optim.share_prompts.
    longest = cfg.sampler.max_prefill_length + cfg.sampler.max_new_tokens
    if cfg.optim.share_prompts:
      self.num_rows = cfg.rl.prompts_per_step // self.num_processes
      self.seq_buckets = prompt_rows.row_buckets(cfg.optim.pack_tokens or longest * cfg.algo.group_size)
    else:
      self.num_rows = cfg.rl.prompts_per_step * cfg.algo.group_size // self.num_processes
      self.seq_buckets = tuple(sorted({min(b, longest) for b in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)}
                                      | {longest}))
    self._rng = jax.random.PRNGKey(cfg.seed)
    self.lora = learner.lora
    self._sampler_params = None  # LoRA sync keeps the sampler's base weights and swaps adapters only
    self._packed = None  # (adapters, their packed buffer): LoRA packing queued behind the train step
    self._sampler_layout = None  # (treedef, indices): the sampler's params from the state's leaves
    # The adapters' sampler shardings are the same every sync: looked up once.
    self._adapter_shardings = (weight_sync.subtree_like(engine.param_shardings, learner.state.params)
                               if self.lora else None)
    self._devices = ([jax.devices()[0]] if mesh is None  # this process's learner devices (for memory stats)
                     else [d for d in mesh.devices.flat if d.process_index == jax.process_index()])
    self._pack_layout = None  # (treedef, shapes) of the sampler's params the train step packs
    self._step_pack = None  # the last train step's packed params, until a sync sends them
    self._fuse_sync_packing()

  @property
  def state(self):
    """The learner's TrainState (read it; `train` and `restore` are what change it)."""
    return self.learner.state

  def model(self) -> nnx.Module:
    """The trained model (for PPO the policy with its value head) over the current state's arrays."""
    return self.learner.model(self.learner.state)

  def restore(self, ckpt, step: int | None = None) -> dict:
    """Loads checkpoint `step` (None: the newest readable one) into the state; returns its meta."""
    self.learner.state, meta = ckpt.restore(step, abstract_state=self.learner.state)
    self.version = int(meta["version"])
    self._packed = self._step_pack = None
    return meta

  def train(self, groups: list[RolloutGroup]) -> dict[str, float]:
    """One optimizer step on groups the reward stage scored (`group.advantages` set)."""
    return self.train_batch(self.assemble(groups))

  def assemble(self, groups: list[RolloutGroup]) -> dict:
    """The host batch of scored groups (host work: the runtime does it before taking a device turn)."""
    unscored = [g.prompt_id for g in groups if g.advantages is None]
    if unscored:
      raise ValueError(f"groups {unscored[:3]} have no advantages: score them first (rl/scoring.py)")
    buckets = self.seq_buckets
    share = self.cfg.optim.share_prompts
    if self.cfg.optim.group_by_length:  # micro-batches are trimmed in the step: one T, one compilation
      buckets = buckets[-1:]
    elif self.num_processes > 1 and self.cfg.optim.pack_tokens:  # the same T on every process
      buckets = buckets[-1:]
    elif self.num_processes > 1:  # every process's share must have the same length T: the longest bucket
      lengths = ([prompt_rows.row_length(g) for g in groups] if share else
                 [len(g.prompt_token_ids) + c.num_tokens for g in groups for c in g.completions])
      buckets = (distributed.max_over_processes(pick_bucket(max(lengths, default=1), self.seq_buckets)),)
    if share and self.cfg.optim.pack_tokens:
      return self._packed_rows(groups, buckets)
    if share:
      return prompt_rows.assemble(groups, num_rows=self.num_rows, seq_buckets=buckets, pad_id=self.pad_id)
    return assemble_batch(groups, num_rows=self.num_rows, seq_buckets=buckets, pad_id=self.pad_id,
                          sampling_mask=self.cfg.algo.keep_sampling_mask, routing=self.cfg.sampler.record_routing)

  def _packed_rows(self, groups: list[RolloutGroup], buckets) -> dict:
    """optim.pack_tokens: the groups packed into as few rows as hold them, the row count rounded up to
    a multiple of micro_batches * this process's learner devices (the same on every process)."""
    rows = prompt_rows.pack(groups, self.cfg.optim.pack_tokens)
    mesh = self.learner.mesh
    devices = 1 if mesh is None or self.learner.context_parallel else (
        mesh.shape[self.learner.cfg.batch_axis] // self.num_processes)
    unit = self.cfg.optim.micro_batches * devices
    n = -(-max(len(rows), 1) // unit) * unit
    if self.num_processes > 1:
      n = distributed.max_over_processes(n)
    return prompt_rows.assemble(groups, num_rows=n, seq_buckets=buckets, pad_id=self.pad_id, rows=rows)

  def train_batch(self, batch: dict) -> dict[str, float]:
    """One optimizer step on an `assemble`d batch."""
    with self.tracer.span("train_step", cat="learner", version=self.version):
      placed = self.learner.put_batch(batch)
      rng = jax.random.fold_in(self._rng, self.version)
      self.learner.state, metrics = self.learner.train_step(self.learner.state, placed, rng)
      if self.lora and self._sampler_params is not None:  # before waiting: the pack runs right after the step
        adapters = self.learner.state.params
        self._packed = (adapters, weight_sync.pack(adapters, self._adapter_shardings, dtype=self.cfg.rl.sync_dtype))
      if self._pack_layout is not None:
        self._step_pack = params_lib.Packed(self.learner.fused_output, *self._pack_layout)
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
    if isinstance(self._sampler_params, params_lib.Packed):
      return self._sampler_params.unpack()
    return self._sampler_params

  def full_params(self) -> nnx.State:
    model = self.model()
    if isinstance(model, value_lib.PolicyWithValue):  # PPO: the sampler gets the policy, not the critic
      model = model.policy
    return nnx.split(model)[1]

  def _layout(self):
    """(treedef of the sampler's params, the index of each of its arrays among the state's leaves),
    matched once; False when the model's arrays are not the state's own (an offloaded learner)."""
    if self._sampler_layout is None:
      leaves = _state_leaves(self.learner.state)
      full, treedef = jax.tree.flatten(self.full_params())
      index = {id(x): i for i, x in enumerate(leaves)}
      self._sampler_layout = all(id(x) in index for x in full) and (treedef, [index[id(x)] for x in full])
    return self._sampler_layout

  def _full_params_fast(self) -> nnx.State:
    """`full_params()` without the nnx merge and split (milliseconds per sync on a small model): the
    state's arrays are placed into the sampler's structure by `_layout`."""
    if not self._layout():
      return self.full_params()
    treedef, indices = self._layout()
    leaves = _state_leaves(self.learner.state)
    return jax.tree.unflatten(treedef, [leaves[i] for i in indices])

  def _fuse_sync_packing(self) -> None:
    """A small model's full sync on one process: the train step itself packs the sampler's params
    into one buffer replicated on the learner mesh (`Learner.fuse_into_step`: an all-gather inside
    the step, no dispatch of its own), and a sync is one transfer instead of one per array. A
    sampler that replicates its params (sampler.tensor 1) keeps the buffer packed, and the engine's
    programs split it (`params.materialize`); a tensor-parallel one gets it split into its shardings
    by one program. Learner's time per sync for the main job's model, idle machine: 4.5 ms per
    array, 1.4 ms with the split, 0.7 ms kept packed (2026-11-26)."""
    mesh = self.learner.mesh
    if self.lora or mesh is None or self.num_processes > 1 or not isinstance(self.learner, Learner) \
        or not self._layout():
      return
    treedef, indices = self._layout()

    def sent(state):  # the sampler's arrays, cast as the sync casts them
      xs = _state_leaves(state)
      return weight_sync.cast_floats([xs[i] for i in indices], self.cfg.rl.sync_dtype)

    def pack(state):
      return jnp.concatenate([x.reshape(-1) for x in sent(state)])

    arrays = jax.eval_shape(sent, self.learner.state)
    if len({x.dtype for x in arrays}) != 1 or sum(x.size * x.dtype.itemsize for x in arrays) > weight_sync.PACK_MAX_BYTES:
      return
    replicated = NamedSharding(mesh, PartitionSpec())
    self.learner.fuse_into_step(pack, replicated)
    self._pack_now = jax.jit(pack, out_shardings=replicated)  # the syncs before the first step, or after a restore
    self._pack_layout = (treedef, tuple(x.shape for x in arrays))
    self._keep_packed = all(s.is_fully_replicated for s in jax.tree.leaves(self.engine.param_shardings))

  def sampler_weights(self) -> tuple[Any, float]:
    """(params on this process's sampler devices, the ms this thread spent on the sync: the copy
    itself is queued, and the sampler's next call waits for it on the devices). On several processes
    every process must call this at the same point (the learner arrays are all-gathered across hosts)."""
    start = time.perf_counter()
    with self.tracer.span("weight_sync", cat="sync", version=self.version, lora=self.lora):
      if self._pack_layout is not None:
        packed = self._step_pack
        if packed is None:
          packed = params_lib.Packed(self._pack_now(self.learner.state), *self._pack_layout)
        self._step_pack = None
        params, _ = weight_sync.sync(packed, self.engine.param_shardings, keep_packed=self._keep_packed, block=False)
      elif not self.lora or self._sampler_params is None:
        params, _ = weight_sync.sync(self._full_params_fast(), self.engine.param_shardings,
                                     dtype=self.cfg.rl.sync_dtype, block=False)
      else:
        adapters = self.learner.state.params
        packed_for, packed = self._packed or (None, None)
        source = packed if packed_for is adapters and packed is not None else adapters  # not if restored since
        self._packed = None
        synced, _ = weight_sync.sync(source, self._adapter_shardings, dtype=self.cfg.rl.sync_dtype,
                                     keep_packed=True, block=False)
        params = weight_sync.replace_leaves(self._sampler_params, synced)
      self._sampler_params = params
    return params, (time.perf_counter() - start) * 1e3
