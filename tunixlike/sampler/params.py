"""What the engine accepts as params: an nnx State, a State plus LoRA adapters still packed, or a
small model's whole State packed (`Packed`, replicated on the sampler mesh).

A LoRA-only weight sync moves the adapters as one flat buffer (`Packed`): one transfer instead of
one per array. Splitting that buffer back into arrays on the sampler would be another program
dispatch per sync, as costly as the transfer itself at LoRA sizes. Instead the sampler keeps
`WithAdapters(base, packed)`, and the engine calls `materialize` inside its jitted programs, where
the split is a few slices that XLA hoists out of the decode loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed:
  """Arrays of one dtype concatenated into `flat`; `unpack()` (traceable) gives the tree back."""
  flat: jax.Array
  treedef: Any = dataclasses.field(metadata=dict(static=True))
  shapes: tuple = dataclasses.field(metadata=dict(static=True))

  def unpack(self) -> Any:
    out, start = [], 0
    for shape in self.shapes:
      size = int(np.prod(shape))
      out.append(self.flat[start:start + size].reshape(shape))
      start += size
    return jax.tree.unflatten(self.treedef, out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WithAdapters:
  """Sampler params whose LoRA adapters (`adapters`, packed) replace those in `base`."""
  base: Any
  adapters: Packed


def materialize(params: Any) -> Any:
  """The plain State the model merges with (call inside jit: the unpack is then free of dispatches)."""
  if isinstance(params, Packed):  # a small model's whole params, as its train step packed them
    return params.unpack()
  if isinstance(params, WithAdapters):
    from flax import nnx
    return nnx.merge_state(params.base, params.adapters.unpack())
  return params
