"""The policy being trained: the one owner of the learner state and its version."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from tunixlike import distributed, trace as trace_lib
from tunixlike.learner import offload as offload_lib, prompt_rows
from tunixlike.learner.batch import assemble_batch, pick_bucket
from tunixlike.learner.train_step import Learner
from tunixlike.rl.weight_sync import Synced, WeightSync
from tunixlike.rollout import RolloutGroup

_LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def length_buckets(longest: int) -> tuple[int, ...]:
  """The sequence lengths T a batch of a row per completion is padded to (up to `longest`)."""
  return tuple(sorted({min(b, longest) for b in _LENGTH_BUCKETS} | {longest}))


class Policy:
  """Trains on scored rollout groups, hands its weights to its `WeightSync`, and restores from checkpoints.

  `learner` (`train_step.Learner`, `ppo.PPOLearner`, or either behind `offload.OffloadedLearner`)
  is the compiled step; its `state` is written here and nowhere else. `version` counts the
  optimizer steps taken (= the policy version stamped on every token sampled with its weights).

  A batch is this process's `rows` rows (all of them with one process): a row per completion, padded
  to one of `seq_buckets`, or with `share_prompts` a row per group (`prompt_rows`; packed several
  groups a row with the learner's `optim.pack_tokens`). `routing` adds the sampler's MoE routing to
  the batch (sampler.record_routing); the sampling masks follow the learner's `algo.keep_sampling_mask`.
  `seed` seeds the step's rng (folded with the version).
  """

  def __init__(self, learner: Learner, weight_sync: WeightSync, *, rows: int, seq_buckets: tuple[int, ...],
               pad_id: int, seed: int, share_prompts: bool, routing: bool = False,
               tracer=trace_lib.NULL_TRACER):
    self.learner, self.weight_sync, self.tracer = learner, weight_sync, tracer
    self.num_rows, self.seq_buckets, self.pad_id = rows, tuple(seq_buckets), pad_id
    self.share_prompts, self.routing = share_prompts, routing
    self.version = 0
    mesh = learner.mesh
    self.num_processes = 1 if mesh is None else len({d.process_index for d in mesh.devices.flat})
    self.lora = learner.lora
    self._rng = jax.random.PRNGKey(seed)
    self._devices = ([jax.devices()[0]] if mesh is None  # this process's learner devices (for memory stats)
                     else [d for d in mesh.devices.flat if d.process_index == jax.process_index()])
    # (state, batch, rng) -> (state, metrics, what the weight sync asked the step to compute, or None)
    if weight_sync.mode == "packed":
      self._step = learner.step_with_output(weight_sync.step_output, weight_sync.step_output_sharding)
    else:
      self._step = lambda state, batch, rng: (*learner.train_step(state, batch, rng), None)

  @property
  def state(self):
    """The learner's TrainState (read it; `train` and `restore` are what change it)."""
    return self.learner.state

  def model(self) -> nnx.Module:
    """The trained model (for PPO the policy with its value head) over the current state's arrays."""
    return self.learner.model(self.learner.state)

  def full_params(self) -> nnx.State:
    """The sampler's params (the policy without a value head) on the learner."""
    return self.learner.sampler_params(self.learner.state)

  def restore(self, ckpt, step: int | None = None) -> dict:
    """Loads checkpoint `step` (None: the newest readable one) into the state; returns its meta."""
    state, meta = ckpt.restore(step, abstract_state=self.learner.state)
    self.load(state, int(meta["version"]))
    return meta

  def load(self, state, version: int) -> None:
    """Takes a restored learner `state` at `version` (a checkpoint of several policies holds each one's)."""
    self.learner.state, self.version = state, version

  def sync_weights(self) -> Synced:
    """The current weights on the sampler's devices, with their version (`WeightSync.sync`)."""
    return self.weight_sync.sync(self.learner.state, self.version)

  @property
  def synced_params(self) -> Any:
    """The params last handed to the sampler (on this process's sampler devices), or None."""
    return self.weight_sync.synced_params

  def train(self, groups: list[RolloutGroup]) -> dict[str, float]:
    """One optimizer step on groups the reward stage scored (`group.advantages` set)."""
    return self.train_batch(self.assemble(groups))

  def assemble(self, groups: list[RolloutGroup]) -> dict:
    """The host batch of scored groups (host work: the runtime does it before taking a device turn)."""
    unscored = [g.prompt_id for g in groups if g.advantages is None]
    if unscored:
      raise ValueError(f"groups {unscored[:3]} have no advantages: score them first (rl/scoring.py)")
    optim, share = self.learner.cfg.optim, self.share_prompts
    buckets = self.seq_buckets
    if optim.group_by_length:  # micro-batches are trimmed in the step: one T, one compilation
      buckets = buckets[-1:]
    elif self.num_processes > 1 and optim.pack_tokens:  # the same T on every process
      buckets = buckets[-1:]
    elif self.num_processes > 1:  # every process's share must have the same length T: the longest bucket
      lengths = ([prompt_rows.row_length(g) for g in groups] if share else
                 [len(g.prompt_token_ids) + c.num_tokens for g in groups for c in g.completions])
      buckets = (distributed.max_over_processes(pick_bucket(max(lengths, default=1), self.seq_buckets)),)
    if share and optim.pack_tokens:
      return self._packed_rows(groups, buckets)
    if share:
      return prompt_rows.assemble(groups, num_rows=self.num_rows, seq_buckets=buckets, pad_id=self.pad_id)
    return assemble_batch(groups, num_rows=self.num_rows, seq_buckets=buckets, pad_id=self.pad_id,
                          sampling_mask=self.learner.cfg.algo.keep_sampling_mask, routing=self.routing)

  def _packed_rows(self, groups: list[RolloutGroup], buckets) -> dict:
    """optim.pack_tokens: the groups packed into as few rows as hold them, the row count rounded up to
    a multiple of micro_batches * this process's learner devices (the same on every process)."""
    optim = self.learner.cfg.optim
    rows = prompt_rows.pack(groups, optim.pack_tokens)
    mesh = self.learner.mesh
    devices = 1 if mesh is None or self.learner.context_parallel else (
        mesh.shape[self.learner.cfg.batch_axis] // self.num_processes)
    unit = optim.micro_batches * devices
    n = -(-max(len(rows), 1) // unit) * unit
    if self.num_processes > 1:
      n = distributed.max_over_processes(n)
    return prompt_rows.assemble(groups, num_rows=n, seq_buckets=buckets, pad_id=self.pad_id, rows=rows)

  def train_batch(self, batch: dict) -> dict[str, float]:
    """One optimizer step on an `assemble`d batch."""
    with self.tracer.span("train_step", cat="learner", version=self.version):
      placed = self.learner.put_batch(batch)
      rng = jax.random.fold_in(self._rng, self.version)
      state, metrics, step_output = self._step(self.learner.state, placed, rng)
      self.learner.state = state
      self.weight_sync.after_step(self.learner.state, step_output)  # before waiting: queued behind the step
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not metrics.get("nonfinite", 0.0):
      self.version += 1
    metrics["skipped"] = metrics.get("nonfinite", 0.0)
    peak = offload_lib.peak_device_memory(self._devices)  # None where the backend keeps no stats (CPU)
    if peak is not None:
      metrics["learner/peak_bytes"] = float(peak)
    return metrics
