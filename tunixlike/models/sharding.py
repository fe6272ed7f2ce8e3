"""Logical axis names -> mesh shardings.

Parameters carry logical names ('vocab', 'embed', 'heads', 'kv_heads', 'head_dim', 'mlp', 'norm') in
their `out_sharding` metadata (nnx.with_partitioning). Rules, a sequence of (logical_name,
mesh_axis_or_None), say where each goes on a given mesh; the same model maps onto the sampler mesh
and the learner mesh with different rules. A name without a rule is replicated.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

Rules = Sequence[tuple[str, Any]]


class ShardingError(ValueError):
  """A parameter dimension that its mesh axis does not divide (the mesh's sizes are config keys)."""


def _axis_size(mesh: jax.sharding.Mesh, axis) -> int:
  axes = axis if isinstance(axis, tuple) else (axis,)
  size = 1
  for a in axes:
    if a not in mesh.shape:
      raise ValueError(f"sharding rule maps to mesh axis {a!r}, mesh has axes {tuple(mesh.shape)}")
    size *= mesh.shape[a]
  return size


def partition_spec(shape, logical_axes, mesh: jax.sharding.Mesh, rules: Rules, *, strict: bool = True,
                   what: str = "array") -> PartitionSpec:
  """PartitionSpec for an array of `shape` with `logical_axes` under `rules`.

  strict=True raises when a dimension does not divide its mesh axis (parameters: an uneven layout
  is almost always a configuration mistake); strict=False replicates that dimension instead.
  """
  table = dict(rules)
  if logical_axes is None:
    return PartitionSpec()
  if len(logical_axes) != len(shape):
    raise ValueError(f"{what}: logical axes {logical_axes} do not match shape {tuple(shape)}")
  spec, used = [], set()
  for dim, name in zip(shape, logical_axes):
    axis = table.get(name) if name is not None else None
    if axis is not None:
      size = _axis_size(mesh, axis)
      flat = axis if isinstance(axis, tuple) else (axis,)
      if dim % size or used.intersection(flat):
        if strict and dim % size:
          raise ShardingError(f"{what}: dimension {name!r} of size {dim} does not divide mesh axis {axis!r} of "
                              f"size {size}; choose mesh sizes that divide it (mesh.sampler_tensor, "
                              "mesh.learner_tensor, mesh.*_devices) or change the sharding rules")
        axis = None
      else:
        used.update(flat)
    spec.append(axis)
  return PartitionSpec(*spec)


def named_sharding(shape, logical_axes, mesh, rules: Rules, *, strict: bool = True,
                   what: str = "array") -> NamedSharding:
  return NamedSharding(mesh, partition_spec(shape, logical_axes, mesh, rules, strict=strict, what=what))


def logical_axes(tree) -> Any:
  """The logical axis names of every Variable in an nnx State / Module (None where unannotated)."""
  state = nnx.state(tree) if isinstance(tree, nnx.Module) else tree
  return jax.tree.map(lambda v: v.get_metadata().get("out_sharding"), state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(tree, mesh: jax.sharding.Mesh, rules: Rules) -> Any:
  """A State of NamedShardings for a model (or its State, abstract or concrete) under `rules`.

  Use it for `jax.jit(..., out_shardings=...)`, optimizer-state shardings and weight sync
  (`jax.device_put(learner_state, state_shardings(sampler_model, sampler_mesh, SAMPLER_RULES))`).
  """
  state = nnx.state(tree) if isinstance(tree, nnx.Module) else tree
  flat = []
  for path, var in nnx.to_flat_state(state):
    name = "/".join(str(p) for p in path)
    axes = var.get_metadata().get("out_sharding")
    flat.append((path, var.replace(named_sharding(var.get_value().shape, axes, mesh, rules, what=name))))
  return nnx.from_flat_state(flat)


# (mesh, rules) of the function being traced: a context variable, so that the sampler's thread never
# sees the learner's rules.
_ACTIVATION_RULES: contextvars.ContextVar = contextvars.ContextVar("activation_rules", default=None)


@contextlib.contextmanager
def activation_rules(mesh: jax.sharding.Mesh | None, rules: Rules):
  """Within it, `constrain` pins activations to `mesh` by `rules` (mesh None: no constraints)."""
  token = _ACTIVATION_RULES.set(None if mesh is None else (mesh, tuple(rules)))
  try:
    yield
  finally:
    _ACTIVATION_RULES.reset(token)


def traced_under_rules(fn, mesh: jax.sharding.Mesh | None, rules: Rules):
  """`fn` entering `activation_rules(mesh, rules)` on every call (wrap the function given to jit)."""
  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    with activation_rules(mesh, rules):
      return fn(*args, **kwargs)
  return wrapper


def activation_axis(logical: str) -> tuple[jax.sharding.Mesh, str] | None:
  """(mesh, mesh axis) that the active `activation_rules` split logical activation axis `logical`
  over (more than one device), else None: e.g. 'length', a row's tokens split over devices
  (context parallelism: the attention then runs `context_parallel.attend` over that axis)."""
  active = _ACTIVATION_RULES.get()
  if active is None:
    return None
  mesh, rules = active
  axis = dict(rules).get(logical)
  if axis is None or _axis_size(mesh, axis) == 1:
    return None
  return mesh, axis


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """`x` constrained to `logical_axes` under the active `activation_rules`; `x` itself outside them.
  A dimension its mesh axis does not divide is replicated (strict=False)."""
  active = _ACTIVATION_RULES.get()
  if active is None:
    return x
  mesh, rules = active
  return jax.lax.with_sharding_constraint(x, named_sharding(x.shape, logical_axes, mesh, rules, strict=False))
