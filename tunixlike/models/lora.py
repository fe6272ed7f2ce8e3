"""LoRA adapters on the model's projections (flax `nnx.LoRA` / `nnx.LoRAParam`).

  y = x W + b + (alpha / r) * x A B,   A [in, r] (he-uniform), B [r, out] (zeros)

Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv 2106.09685. B starts
at zero, so a freshly adapted model computes exactly the base model.

`apply_lora` swaps each targeted `nnx.Linear` for a `LoRALinear` that *adopts* the original kernel
and bias Variables: parameter paths (`layers/0/attn/q_proj/kernel`), values and sharding stay as
they were, and the adapters appear beside them (`.../q_proj/lora/lora_a`). Adapters are
`nnx.LoRAParam`, so filtering on that type selects exactly what trains and what syncs. They are
replicated, not sharded like their kernels: see `LoRALinear`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tunixlike.models import sharding as sharding_lib
from tunixlike.settings import FromConfig, tree_key


@dataclasses.dataclass(frozen=True)
class LoRAConfig(FromConfig):
  """`LoRAConfig.from_config(cfg)`: the run's lora section (`apply_lora` needs a rank > 0; the config
  checks alpha and the targets)."""

  rank: int = tree_key("lora.rank")
  alpha: float = tree_key("lora.alpha")  # the adapter's scale is alpha / rank
  # Attribute names of the projections to adapt, as in Hugging Face / peft target_modules.
  targets: tuple[str, ...] = tree_key("lora.targets")

  def __post_init__(self):
    if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
      raise ValueError(f"lora.rank={self.rank!r} must be a positive int (0: no adapters)")
    object.__setattr__(self, "targets", tuple(self.targets))

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


class LoRALinear(nnx.Linear):
  """An `nnx.Linear` plus a low-rank update; built around an existing Linear's Variables."""

  def __init__(self, base: nnx.Linear, *, rank: int, alpha: float, rngs: nnx.Rngs):
    # No Linear.__init__: it would draw a fresh kernel. Adopt the base Variables instead.
    self.kernel = base.kernel
    self.bias = base.bias if base.bias is not None else nnx.data(None)
    for name in ("in_features", "out_features", "use_bias", "dtype", "param_dtype", "precision",
                 "dot_general", "promote_dtype", "preferred_element_type"):
      setattr(self, name, getattr(base, name))
    # Adapters are replicated on every device: they are small (rank x (in + out) per projection),
    # and a replicated copy lets weight sync pack them with no gather (on CPU an all-gather of the
    # FSDP-sharded adapters cost 4x the transfer itself).
    self.lora = nnx.LoRA(self.in_features, rank, self.out_features, dtype=self.dtype,
                         param_dtype=self.param_dtype, rngs=rngs,
                         a_metadata={"out_sharding": (None, None), "eager_sharding": False},
                         b_metadata={"out_sharding": (None, None), "eager_sharding": False})
    self.scale = float(alpha) / rank

  def __call__(self, x, out_sharding=None):
    return super().__call__(x, out_sharding=out_sharding) + self.scale * self.lora(x)


def _targets_in(model: nnx.Module) -> dict[str, list[tuple]]:
  found: dict[str, list[tuple]] = {}
  for path, module in nnx.iter_modules(model):
    if path and isinstance(module, nnx.Linear):
      found.setdefault(str(path[-1]), []).append(path)
  return found


def _get(model, path):
  node = model
  for p in path:
    node = node[p] if isinstance(p, int) else getattr(node, p)
  return node


def apply_lora(model: nnx.Module, cfg: LoRAConfig, *, seed: int, mesh: jax.sharding.Mesh | None = None,
               rules=None) -> nnx.Module:
  """Adds adapters to every Linear named in `cfg.targets` (in place; returns the model).

  With `mesh` and `rules` the adapters are placed with the same logical-axis rules as the model.
  Raises if a target name matches no projection (a typo would otherwise train nothing).
  """
  found = _targets_in(model)
  for t in cfg.targets:
    if t not in found:
      raise ValueError(f"lora.targets entry {t!r} matches no projection of the model; "
                       f"projections are named {sorted(found)}")
  rngs = nnx.Rngs(seed)
  for t in cfg.targets:
    for path in found[t]:
      base = _get(model, path)
      if isinstance(base, LoRALinear):
        raise ValueError(f"lora: {'/'.join(map(str, path))} already has an adapter")
      parent = _get(model, path[:-1])
      setattr(parent, path[-1], LoRALinear(base, rank=cfg.rank, alpha=cfg.alpha, rngs=rngs))
  if mesh is not None:
    adapters = nnx.state(model, nnx.LoRAParam)
    nnx.update(model, jax.device_put(adapters, sharding_lib.state_shardings(adapters, mesh, rules or ())))
  return model


def has_lora(model: nnx.Module) -> bool:
  return any(isinstance(m, LoRALinear) for _, m in nnx.iter_modules(model))


def adapter_params(model: nnx.Module) -> nnx.State:
  """The weight-sync payload: a State holding only the LoRA params (A and B of every adapter)."""
  state = nnx.state(model, nnx.LoRAParam)
  if not nnx.to_flat_state(state):
    raise ValueError("adapter_params: the model has no LoRA adapters (apply_lora first)")
  return state


def load_adapter_params(model: nnx.Module, payload: nnx.State) -> None:
  """Writes an `adapter_params` payload into another copy of the model (same LoRA layout)."""
  have = {p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
  got = {p for p, _ in nnx.to_flat_state(payload)}
  if have != got:
    missing = sorted("/".join(map(str, p)) for p in have ^ got)
    raise ValueError(f"load_adapter_params: payload and model adapters differ at {missing[:4]} "
                     f"({len(missing)} paths); apply_lora with the same targets first")
  nnx.update(model, payload)


def zero_adapters(adapters: Any) -> Any:
  """The same adapters with B (and A) at zero: the model then computes exactly its base.

  This is how the reference policy is the base model without a second copy of the weights.
  """
  return jax.tree.map(jnp.zeros_like, adapters)


def merge_lora(model: nnx.Module) -> nnx.Module:
  """A copy of the model with every adapter folded into its kernel (W + scale A B), plain Linears.

  The input model is untouched. The copy has the base model's structure, so `save_pretrained`
  exports it as an ordinary checkpoint.
  """
  merged = nnx.merge(*nnx.split(model))
  for path, module in list(nnx.iter_modules(merged)):
    if not isinstance(module, LoRALinear):
      continue
    a = module.lora.lora_a[...].astype(jnp.float32)
    b = module.lora.lora_b[...].astype(jnp.float32)
    kernel = module.kernel[...]
    new_kernel = (kernel.astype(jnp.float32) + module.scale * (a @ b)).astype(kernel.dtype)
    plain = nnx.eval_shape(lambda m=module: nnx.Linear(
        m.in_features, m.out_features, use_bias=m.use_bias, dtype=m.dtype, param_dtype=m.param_dtype,
        precision=m.precision, dot_general=m.dot_general, promote_dtype=m.promote_dtype,
        preferred_element_type=m.preferred_element_type, rngs=nnx.Rngs(0)))
    plain.kernel = nnx.Param(new_kernel, **_metadata(module.kernel))
    plain.bias = module.bias if module.bias is not None else nnx.data(None)
    setattr(_get(merged, path[:-1]), path[-1], plain)
  return merged


def _metadata(var: nnx.Variable) -> dict:
  keep = ("out_sharding", "mesh", "eager_sharding")
  return {k: v for k, v in var.get_metadata().items() if k in keep}
