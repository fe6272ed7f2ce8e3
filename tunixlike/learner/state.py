"""The learner's train state: a pytree the jitted step takes and returns (and donates).

The model is split once into a static GraphDef and three States:
  params      what trains: every nnx.Param, or only the nnx.LoRAParam adapters under LoRA
  frozen      everything else (base weights under LoRA; non-parameter variables)
  ref_params  the reference policy's copy of `params` for the KL term: a frozen copy of the
              initial weights, or None. Under LoRA the reference is the base model, i.e. the same
              `frozen` weights with the adapters zeroed (no second copy of the weights).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
from flax import nnx


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 []: optimizer updates so far = the policy version of `params`
  params: nnx.State
  opt_state: Any
  frozen: nnx.State
  ref_params: nnx.State | None
