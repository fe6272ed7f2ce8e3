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


def restore_policy_weights(ckpt, step: int, model: nnx.Module, *, lora: bool, ppo: bool,
                           sharding: jax.sharding.Sharding | None = None) -> tuple[nnx.Module, dict]:
  """(the policy of checkpoint `step`, its meta): only the TrainState's `params` and `frozen` are
  read, not the optimizer state or a reference copy, nor PPO's value head.

  `model` gives the tree: a live model (its arrays' shardings are kept) or `nnx.eval_shape`'s with
  `sharding` for every array. `lora`: the checkpoint trained adapters (`params` = the LoRAParams).
  `ppo`: it trained a `PolicyWithValue`, whose policy sits under "policy". `ckpt` is a
  `checkpoint.Checkpointer`; one saved without its frozen base weights needs a live `model` holding them.
  """
  graphdef, params, frozen = nnx.split(model, nnx.LoRAParam if lora else nnx.Param, ...)
  frozen_saved = ckpt.layout(step).get("frozen_saved", True)
  target_of = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or x.sharding),
                                     t)
  wrap = lambda t: {"policy": t} if ppo and jax.tree.leaves(t) else t
  unwrap = lambda t: t["policy"] if ppo and jax.tree.leaves(t) else t
  target = {"params": wrap(target_of(params)), "frozen": wrap(target_of(frozen)) if frozen_saved else frozen}
  state, meta = ckpt.restore(step, abstract_state=target, partial=True)
  return nnx.merge(graphdef, unwrap(state["params"]), unwrap(state["frozen"]) if frozen_saved else frozen), meta
