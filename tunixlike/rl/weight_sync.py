"""Weight sync from the learner submesh to the sampler submesh by `jax.device_put` resharding.

One device_put over the whole pytree moves every array to its sampler sharding in a single call (the
runtime batches the transfers: no per-parameter round-trips, the overhead FIELD.md warns about).
An optional dtype cast (e.g. a bf16 sampler) happens on the learner devices first so that half the
bytes cross. LoRA-only sync passes just the adapter pytree. Every sync is timed.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp


def target_shardings(tree: Any, mesh: jax.sharding.Mesh, specs: Any) -> Any:
  """NamedShardings on `mesh` for a pytree of PartitionSpecs (same structure as `tree`)."""
  return jax.tree.map(lambda _, spec: jax.sharding.NamedSharding(mesh, spec), tree, specs)


@functools.partial(jax.jit, static_argnums=1)
def _cast_floats(tree: Any, dtype: str) -> Any:
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _cast(tree: Any, dtype) -> Any:
  return tree if dtype is None else _cast_floats(tree, jnp.dtype(dtype).name)


def sync(tree: Any, shardings: Any, *, dtype=None, block: bool = True) -> tuple[Any, float]:
  """Returns (the tree on the sampler shardings, milliseconds taken).

  `block=True` waits for the copy: the learner's next step donates its buffers, and the time
  measured is then the real transfer time, not the dispatch time.
  """
  start = time.perf_counter()
  out = jax.device_put(_cast(tree, dtype), shardings)
  if block:
    out = jax.block_until_ready(out)
  return out, (time.perf_counter() - start) * 1e3


def subtree_like(full: Any, part: Any) -> Any:
  """The entries of nnx State `full` at the paths of `part` (e.g. the LoRA adapters' shardings)."""
  from flax import nnx
  table = dict(nnx.to_flat_state(full))
  return nnx.from_flat_state([(path, table[path]) for path, _ in nnx.to_flat_state(part)])


def replace_leaves(full: Any, part: Any) -> Any:
  """`full` with the entries at `part`'s paths replaced (LoRA sync: new adapters, same base)."""
  from flax import nnx
  return nnx.merge_state(full, part)
