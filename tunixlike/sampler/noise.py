"""Sampling noise keys: each sample's key depends on its group's start order and its index (and, for
multi-turn episodes, the turn number), never on the slot it decodes in, so a sample is the same
whatever else shares the slots."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# Groups whose noise keys are made by one device call. Fetching keys waits for the device queue
# (prefills, generate calls) to drain, so it is done once per block of groups, not once per group.
_KEY_BLOCK = 64


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _sample_keys(base, first_seq, group_size: int, num_groups: int, turns: int = 0):
  """Noise keys [num_groups, group_size, 2] of the groups started `first_seq`, `first_seq + 1`, ...:
  each depends on its group's start order and its sample index, not on its slot. With `turns`
  (multi-turn episodes) one key per policy turn: [num_groups, group_size, turns, 2]."""
  def group_keys(seq):
    group_key = jax.random.fold_in(base, seq)
    keys = jax.vmap(lambda i: jax.random.fold_in(group_key, i))(jnp.arange(group_size))
    if turns:
      keys = jax.vmap(lambda k: jax.vmap(lambda t: jax.random.fold_in(k, t))(jnp.arange(turns)))(keys)
    return keys
  return jax.vmap(group_keys)(first_seq + jnp.arange(num_groups))


class NoiseKeys:
  """The keys of a run's groups (`sampler.seed`), made a block of groups at a time."""

  def __init__(self, seed: int, group_size: int, turns: int = 0):
    """`turns`: a key per policy turn (multi-turn episodes and agents), 0 = one per sample."""
    self.base = jax.random.PRNGKey(seed)
    self.group_size, self.turns = group_size, turns
    self.blocks: dict[int, np.ndarray] = {}  # block -> keys of its groups (the latest few)

  def group(self, seq: int) -> np.ndarray:
    """Keys [group_size, 2] (or [group_size, turns, 2]) of the group started `seq`-th."""
    block, i = divmod(seq, _KEY_BLOCK)
    if block not in self.blocks:
      if len(self.blocks) >= 4:  # groups of neighbouring blocks interleave (multi-turn): keep a few
        del self.blocks[min(self.blocks)]
      keys = _sample_keys(self.base, block * _KEY_BLOCK, self.group_size, _KEY_BLOCK, self.turns)
      self.blocks[block] = np.asarray(keys)
    return self.blocks[block][i]

  def of_noise_id(self, noise_id: int) -> np.ndarray:
    """Keys [group_size, 2] seeded by a request's own `noise_id` instead of its start order."""
    return np.asarray(_sample_keys(self.base, noise_id, self.group_size, 1))[0]
