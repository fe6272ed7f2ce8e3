"""Host offload of learner state that the step needs only briefly: reference, optimizer moments, critic.

RL holds more state than supervised training (policy, reference, critic, Adam's two moments); on
an accelerator the moments alone are twice the trainable weights. `HostOffload` keeps chosen
components of the `TrainState` in host memory between steps and streams them to the device for
the step that needs them. Components (the `learner.offload` config key):

  reference  `ref_params`, the frozen reference policy of the KL term (exists when a KL is used)
  optimizer  `opt_state`, the optimizer's moments and counters
  critic     `params["critic"]`, the trunk and head of a separate critic model (PPO with
             model.critic_path); the small value head on the policy trunk is not offloadable

Where the bytes live:
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

from typing import Any, Sequence

import jax
import numpy as np

from tunixlike.learner.config import OFFLOAD_COMPONENTS
from tunixlike.learner.state import TrainState
from tunixlike.learner.train_step import Learner

COMPONENTS = OFFLOAD_COMPONENTS  # component -> (TrainState field, first key inside it or None for all of it)
OFFLOADABLE = tuple(COMPONENTS)
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


def _missing_why(component: str) -> str:
  return {"reference": "the reference copy is kept only when algo.kl_coef > 0 (or PPO's algo.kl_reward_coef > 0) "
                       "and LoRA is off",
          "optimizer": "this learner has no optimizer state",
          "critic": "only a separate critic model (model.critic_path) can be offloaded; the value head on the "
                    "policy trunk is part of the policy"}[component]


def _component_tree(state: TrainState, component: str):
  field, key = COMPONENTS[component]
  tree = getattr(state, field)
  if key is None or tree is None:
    return tree
  return tree[key] if key in tree else None


def check_components(components: Sequence[str], state: TrainState) -> tuple[str, ...]:
  """The requested components, validated against what this learner's state holds."""
  out = []
  for c in components:
    if c not in COMPONENTS:
      raise ValueError(f"learner.offload={tuple(components)!r}: {c!r} is not an offloadable component; "
                       f"choose from {OFFLOADABLE}")
    tree = _component_tree(state, c)
    if tree is None or not jax.tree.leaves(tree):
      raise ValueError(f"learner.offload={tuple(components)!r}: {c!r} does not exist in this learner "
                       f"({_missing_why(c)})")
    if c not in out:
      out.append(c)
  return tuple(out)


def offload_mask(state: TrainState, components: Sequence[str]) -> TrainState:
  """A TrainState-shaped tree of bools: True on the leaves of the chosen components."""
  def in_component(path) -> bool:
    field = getattr(path[0], "name", None)
    for c in components:
      f, key = COMPONENTS[c]
      if field == f and (key is None or (len(path) > 1 and getattr(path[1], "key", None) == key)):
        return True
    return False
  return jax.tree_util.tree_map_with_path(lambda path, _: in_component(path), state)


def tree_bytes(tree) -> int:
  return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def component_bytes(state: TrainState) -> dict[str, int]:
  """Bytes of each offloadable component present in `state` (plus the trainable `params` as a whole)."""
  out = {"params": tree_bytes(state.params)}
  for c in COMPONENTS:
    tree = _component_tree(state, c)
    if tree is not None:
      out[c] = tree_bytes(tree)
  return out


def peak_device_memory(devices: Sequence[jax.Device]) -> int | None:
  """Peak bytes in use on the most loaded device, from the backend's memory stats (None where the
  backend keeps none, e.g. CPU)."""
  peaks = []
  for d in devices:
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    if stats and "peak_bytes_in_use" in stats:
      peaks.append(int(stats["peak_bytes_in_use"]))
  return max(peaks) if peaks else None


def _select(mask, on, off):
  """Leaves of `on` where mask is True, of `off` elsewhere (same tree structure)."""
  return jax.tree.map(lambda m, a, b: a if m else b, mask, on, off)


class HostOffload:
  """Keeps `components` of a learner's TrainState on the host and streams them for each step.

  Usage: `off = HostOffload(learner, ("optimizer",)); state = off.offload(learner.state)`, then
  `state, metrics = off.train_step(state, batch, rng)` in place of `learner.train_step` (the state
  passed in is donated). `fetch(state)` gives an all-on-device state (eval, export).
  `memory_kind` is 'pinned_host' or None (numpy fallback); `force_numpy` selects the fallback.
  """

  def __init__(self, learner: Learner, components: Sequence[str], *, force_numpy: bool = False):
    self.learner = learner
    self.components = check_components(components, learner.state)
    self.mask = offload_mask(learner.state, self.components)
    self.device_shardings = learner.state_shardings
    devices = sorted({d for s in jax.tree.leaves(self.device_shardings) for d in s.device_set}, key=lambda d: d.id)
    self.memory_kind = None if force_numpy else host_memory_kind(devices)
    moved = sum(tree_bytes(_component_tree(learner.state, c)) for c in self.components)
    self.bytes_per_step = 2 * moved  # each component goes in and comes back out
    if self.memory_kind is not None:
      host = jax.tree.map(lambda s: s.with_memory_kind(self.memory_kind), self.device_shardings)
      self.host_shardings = _select(self.mask, host, self.device_shardings)
      self._step = jax.jit(self._stream_step, donate_argnums=(0,), out_shardings=(self.host_shardings, None))

  def offload(self, state: TrainState) -> TrainState:
    """The same state with the chosen components moved to host memory (a no-op for leaves already there)."""
    if self.memory_kind is not None:
      return jax.device_put(state, self.host_shardings)
    return jax.tree.map(lambda m, x: np.asarray(jax.device_get(x)) if m else x, self.mask, state)

  def fetch(self, state: TrainState, components: Sequence[str] | None = None) -> TrainState:
    """The same state with the chosen components (default: all offloaded ones) back in device
    memory, laid out as the learner's."""
    mask = self.mask if components is None else offload_mask(state, components)
    return jax.tree.map(lambda m, x, s: jax.device_put(x, s) if m else x, mask, state, self.device_shardings)

  def _stream_step(self, state: TrainState, batch, rng):
    on_device = jax.tree.map(lambda m, x, s: jax.device_put(x, s) if m else x, self.mask, state,
                             self.device_shardings)
    return self.learner._train_step(on_device, batch, rng)

  def train_step(self, state: TrainState, batch, rng):
    """(host-offloaded state, batch, rng) -> (host-offloaded state, metrics); `state` is donated.

    A learner with a `prepare` step (PPOLearner) gets its batch prepared first, with the
    reference and the critic streamed in for it (the KL reward and the values read them)."""
    stats = {}
    needs_prepare = getattr(self.learner, "needs_prepare", None)
    if needs_prepare is not None and needs_prepare(batch):
      view = self.fetch(state, [c for c in self.components if c != "optimizer"])
      batch, stats = self.learner.prepare(view, batch)
      del view
    if self.memory_kind is not None:
      new_state, metrics = self._step(state, batch, rng)
    else:
      new_state, metrics = self.learner.train_step(self.fetch(state), batch, rng)
      new_state = self.offload(new_state)
    return new_state, {**metrics, **stats}


class OffloadedLearner:
  """A learner whose `state` keeps some components in host memory, driven exactly like the learner.

  `state` is always the offloaded state: assigning a device state (e.g. one restored from a
  checkpoint) offloads it. Every other attribute (`put_batch`, `model`, `mesh`, `lora`, ...) is
  the wrapped learner's.
  """

  def __init__(self, learner: Learner, components: Sequence[str], *, force_numpy: bool = False):
    self.inner = learner
    self.host = HostOffload(learner, components, force_numpy=force_numpy)
    self._state = self.host.offload(learner.state)
    learner.state = None  # drop the device copies: the offloaded state is the only one

  @property
  def state(self) -> TrainState:
    return self._state

  @state.setter
  def state(self, value: TrainState):
    self._state = self.host.offload(value)

  def train_step(self, state: TrainState, batch, rng):
    return self.host.train_step(state, batch, rng)

  def __getattr__(self, name: str) -> Any:  # only called for attributes not found above
    return getattr(self.__dict__["inner"], name)
