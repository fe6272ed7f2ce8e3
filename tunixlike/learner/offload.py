"""Host offload of learner state that the step needs only briefly: optimizer moments, reference params.

RL holds more state than supervised training (policy, reference, critic, Adam's two moments); on
an accelerator the moments alone are twice the trainable weights. `HostOffload` keeps chosen
components of the `TrainState` in host memory between steps and streams them to the device for
the step that needs them:

  * backends with a `pinned_host` memory space (TPU, GPU, recent CPU): the components are arrays
    with `sharding.with_memory_kind('pinned_host')`; one jitted step moves them to device memory
    (`jax.device_put` inside jit, which XLA schedules as async copies), runs the learner's step and
    writes the new values back to pinned host memory through `out_shardings`. Sharding is kept:
    each device's shard goes to its own host.
  * otherwise: plain host (numpy) arrays, `jax.device_put` before and `jax.device_get` after the
    step, outside jit.

The step's math is the learner's own (`Learner._train_step`), so offload changes where bytes live,
never the numbers.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from tunixlike.learner.state import TrainState
from tunixlike.learner.train_step import Learner

OFFLOADABLE = ("opt_state", "ref_params")  # TrainState fields; the critic lives in `params` (PPOLearner)
PINNED = "pinned_host"


def host_memory_kind(devices: Sequence[jax.Device]) -> str | None:
  """'pinned_host' when every device can address it, else None (fall back to numpy arrays)."""
  for d in devices:
    try:
      kinds = {m.kind for m in d.addressable_memories()}
    except Exception:  # backends without the memories API
      return None
    if PINNED not in kinds:
      return None
  return PINNED


def check_components(components: Sequence[str], state: TrainState) -> tuple[str, ...]:
  """The requested components, validated against what this learner's state holds."""
  out = []
  for c in components:
    if c not in OFFLOADABLE:
      raise ValueError(f"learner.offload={tuple(components)!r}: {c!r} is not an offloadable component; "
                       f"choose from {OFFLOADABLE}")
    if getattr(state, c) is None:
      raise ValueError(f"learner.offload={tuple(components)!r}: {c!r} does not exist in this learner "
                       "(the reference copy is kept only when algo.kl_coef > 0 and LoRA is off)")
    if c not in out:
      out.append(c)
  return tuple(out)


def tree_bytes(tree) -> int:
  return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def peak_device_memory(devices: Sequence[jax.Device]) -> int | None:
  """Peak bytes in use on the most loaded device, from the backend's memory stats (None where the
  backend keeps none, e.g. CPU)."""
  peaks = []
  for d in devices:
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    if stats and "peak_bytes_in_use" in stats:
      peaks.append(int(stats["peak_bytes_in_use"]))
  return max(peaks) if peaks else None


class HostOffload:
  """Keeps `components` of a learner's TrainState on the host and streams them for each step.

  Usage: `off = HostOffload(learner, ("opt_state",)); state = off.offload(learner.state)`, then
  `state, metrics = off.train_step(state, batch, rng)` in place of `learner.train_step` (the state
  passed in is donated). `fetch(state)` gives an all-on-device state (checkpointing, eval).
  `memory_kind` is 'pinned_host' or None (numpy fallback); `force_numpy` selects the fallback.
  """

  def __init__(self, learner: Learner, components: Sequence[str], *, force_numpy: bool = False):
    self.learner = learner
    self.components = check_components(components, learner.state)
    self.device_shardings = learner.state_shardings
    devices = sorted({d for s in jax.tree.leaves(self.device_shardings) for d in s.device_set}, key=lambda d: d.id)
    self.memory_kind = None if force_numpy else host_memory_kind(devices)
    self.bytes_per_step = 2 * sum(tree_bytes(getattr(learner.state, c)) for c in self.components)  # in + out
    if self.memory_kind is not None:
      self.host_shardings = self.device_shardings.replace(**{
          c: jax.tree.map(lambda s: s.with_memory_kind(self.memory_kind), getattr(self.device_shardings, c))
          for c in self.components})
      self._step = jax.jit(self._stream_step, donate_argnums=(0,), out_shardings=(self.host_shardings, None))

  def offload(self, state: TrainState) -> TrainState:
    """The same state with the chosen components moved to host memory."""
    parts = {c: getattr(state, c) for c in self.components}
    if self.memory_kind is not None:
      moved = jax.device_put(parts, {c: getattr(self.host_shardings, c) for c in self.components})
    else:
      moved = jax.device_get(parts)
    return state.replace(**moved)

  def fetch(self, state: TrainState) -> TrainState:
    """The same state with every component back in device memory, laid out as the learner's."""
    parts = {c: getattr(state, c) for c in self.components}
    return state.replace(**jax.device_put(parts, {c: getattr(self.device_shardings, c) for c in self.components}))

  def _stream_step(self, state: TrainState, batch, rng):
    on_device = state.replace(**{c: jax.device_put(getattr(state, c), getattr(self.device_shardings, c))
                                 for c in self.components})
    return self.learner._train_step(on_device, batch, rng)

  def train_step(self, state: TrainState, batch, rng):
    """(host-offloaded state, batch, rng) -> (host-offloaded state, metrics); `state` is donated.

    A learner with a `prepare` step (PPOLearner) gets its batch prepared first, with the
    reference streamed in for it (the KL reward reads it)."""
    stats = {}
    needs_prepare = getattr(self.learner, "needs_prepare", None)
    if needs_prepare is not None and needs_prepare(batch):
      view = state
      if "ref_params" in self.components:
        view = state.replace(ref_params=jax.device_put(state.ref_params, self.device_shardings.ref_params))
      batch, stats = self.learner.prepare(view, batch)
    if self.memory_kind is not None:
      new_state, metrics = self._step(state, batch, rng)
    else:
      new_state, metrics = self.learner.train_step(self.fetch(state), batch, rng)
      new_state = self.offload(new_state)
    return new_state, {**metrics, **stats}
