"""Weight sync from the learner submesh to the sampler submesh by `jax.device_put` resharding.

One device_put over the whole pytree moves every array to its sampler sharding in a single call (the
runtime batches the transfers: no per-parameter round-trips, the overhead FIELD.md warns about).
An optional dtype cast (e.g. a bf16 sampler) happens on the learner devices first so that half the
bytes cross. LoRA-only sync passes just the adapter pytree, packed into one buffer (many small
arrays would each pay a fixed per-transfer cost); with `keep_packed` it stays one buffer on the
sampler (`sampler.params.Packed`), and the engine splits it inside its own jitted programs, which
saves the dispatch of a separate unpack program. `pack` lets the learner queue the packing right
behind its train step, so that the sync itself is one transfer; a small model's whole params come
packed by the train step itself (`Policy`, `Learner.fuse_into_step`). Every sync is timed.

Several processes (multi-controller JAX, no Pathways) refuse a device_put between different device
sets across hosts. There the learner arrays span every host and each host's sampler mesh is local
(`mesh.make_meshes`), so `sync` first all-gathers the learner arrays within the learner mesh, a
bucket of at most `bucket_bytes` at a time to bound the extra memory, which leaves a full copy on
each host's learner devices; then every host copies that to its own sampler devices: a local
device_put that never leaves the host. Every process must call `sync` at the same point.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp

from tunixlike.sampler import params as params_lib


def cast_floats(tree: Any, dtype) -> Any:
  """`tree` with its floating arrays as `dtype` (None: unchanged); traceable, for inside a program."""
  if dtype is None:
    return tree
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


_cast_floats = jax.jit(cast_floats, static_argnums=1)


def _cast(tree: Any, dtype) -> Any:
  return tree if dtype is None else _cast_floats(tree, jnp.dtype(dtype).name)


DEFAULT_BUCKET_BYTES = 256 * 2**20


def _spans_processes(leaves) -> bool:
  """True if any array has shards on other processes (multi-controller learner params)."""
  return any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves)


def sync(tree: Any, shardings: Any, *, dtype=None, block: bool = True,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES, keep_packed: bool = False) -> tuple[Any, float]:
  """Returns (the tree on the sampler shardings, milliseconds taken).

  `block=True` waits for the copy, and the time measured is the transfer's. With `block=False` it
  returns once the copy is enqueued (the learner's time in sync): the learner's next step may
  donate the source buffers at once (the runtime orders a donation after the reads queued before
  it), and the sampler's next call waits for the copy on its devices. The result never aliases the
  source: in the colocated layout the sampler keeps reading it while the learner donates its own
  buffers to the next step. `bucket_bytes` bounds the all-gathered bytes held at once on several
  hosts (unused on one; there each bucket is waited for). With `keep_packed`, a tree that takes the
  packed path comes back as a `Packed` buffer replicated on the sampler mesh (`Packed.unpack()`
  gives the tree; `Engine` accepts it alone or inside `WithAdapters`).
  """
  start = time.perf_counter()
  if isinstance(tree, params_lib.Packed):  # packed on the learner already (`pack`, cast included)
    out = _send_packed(tree, _flat_targets(tree.treedef, shardings), keep_packed)
  else:
    out = _sync_tree(tree, shardings, dtype, bucket_bytes, keep_packed)
  if block:
    out = jax.block_until_ready(out)
  return out, (time.perf_counter() - start) * 1e3


def _sync_tree(tree, shardings, dtype, bucket_bytes: int, keep_packed: bool) -> Any:
  leaves, treedef = jax.tree.flatten(tree)  # once: flattening an nnx State is slow next to a LoRA sync
  if _spans_processes(leaves):
    return _sync_across_hosts(tree, shardings, dtype, bucket_bytes)
  targets = _flat_targets(treedef, shardings)
  if _on_same_devices(leaves, targets):  # colocated: one program reshards every array where it is
    return jax.tree.unflatten(treedef, _resharder(tuple(targets), _dtype_name(dtype))(leaves))
  if _packable(leaves, targets):
    return _send_packed(_pack(leaves, treedef, dtype), targets, keep_packed)
  return jax.device_put(_cast(tree, dtype), shardings, may_alias=False)


def _dtype_name(dtype) -> str | None:
  return None if dtype is None else jnp.dtype(dtype).name


def _on_same_devices(leaves: list, targets: list) -> bool:
  """Every source array and every target on one and the same device set (the colocated layout)."""
  devices = {getattr(x, "sharding", None) and frozenset(x.sharding.device_set) for x in leaves}
  devices |= {frozenset(t.device_set) for t in targets}
  return len(devices) == 1 and None not in devices


@functools.lru_cache(maxsize=32)
def _resharder(targets: tuple, dtype: str | None):
  """One jitted cast and reshard of every array onto `targets` on the devices they are on: a single
  dispatch per sync, and outputs in new buffers (the learner donates its own to its next step)."""
  return jax.jit(lambda xs: cast_floats(list(xs), dtype), out_shardings=list(targets))


# Many small arrays (LoRA adapters: A and B of every projection) cost a fixed overhead each when
# moved one by one; packed into one buffer they cross in a single transfer.
PACK_MAX_BYTES = 16 * 2**20  # above this, per-array overhead is small next to the bytes
PACK_MIN_LEAVES = 8


def _mesh_of(sharding):
  return getattr(sharding, "mesh", None)


# The same shardings object comes back every sync (the runtime looks it up once): its flattening
# (an nnx State, slow to flatten next to a LoRA sync) is kept. Each entry holds the object, so its
# id cannot be reused while cached.
_TARGETS_CACHE: dict = {}


def _flat_targets(treedef, shardings) -> list:
  key = (treedef, id(shardings))
  hit = _TARGETS_CACHE.get(key)
  if hit is None or hit[0] is not shardings:
    if len(_TARGETS_CACHE) >= 16:
      _TARGETS_CACHE.pop(next(iter(_TARGETS_CACHE)))
    hit = _TARGETS_CACHE[key] = (shardings, treedef.flatten_up_to(shardings))
  return hit[1]


def _packable(leaves: list, targets: list) -> bool:
  """Small, one dtype, replicated on one source mesh, and one target mesh (all named shardings).

  Sharded sources (an FSDP learner's full model) are not packed: the all-gather that packing them
  needs costs more than the per-array transfers it saves (13.3 vs 6.0 ms for the 2 MB model of
  `benchmarks/weight_sync.py --quick` on 4 + 4 CPU devices; 6.4 vs 4.0 ms of the learner's time for
  the main job's 0.5 MB model with the copy queued rather than waited for).
  """
  if len(leaves) < PACK_MIN_LEAVES:
    return False
  nbytes, dtypes, sources = 0, set(), set()
  for x in leaves:
    sharding = getattr(x, "sharding", None)
    if sharding is None or not sharding.is_fully_replicated:
      return False
    nbytes += x.size * x.dtype.itemsize
    dtypes.add(x.dtype)
    sources.add(_mesh_of(sharding))
  targets_meshes = {_mesh_of(t) for t in targets}
  return (nbytes <= PACK_MAX_BYTES and len(dtypes) == 1 and len(sources) == 1 and len(targets_meshes) == 1
          and None not in sources | targets_meshes)


# Sources are replicated (`_packable`), so they are packed on one of their devices: the same
# program on every device of the learner mesh would write the buffer once per device.
_pack_one_device = jax.jit(lambda xs: jnp.concatenate([x.reshape(-1) for x in xs]))


@functools.lru_cache(maxsize=32)
def _unpacker(treedef, targets: tuple):
  return jax.jit(params_lib.Packed.unpack, out_shardings=jax.tree.unflatten(treedef, list(targets)))


def pack(tree: Any, shardings: Any, *, dtype=None) -> params_lib.Packed | None:
  """`tree` concatenated into one buffer on the learner, ready for `sync`; None if `tree` does not
  take the packed path (large, mixed dtypes, sharded, several meshes or hosts).

  `sync` packs by itself. Called right after the train step that produced `tree`, before the host
  waits for that step, the pack is queued behind the step on the devices, and the sync that follows
  is one transfer (what `Policy` does for LoRA). The learner keeps LoRA adapters replicated
  (`models.lora`), so the concatenation gathers nothing and runs on one device.
  """
  leaves, treedef = jax.tree.flatten(tree)
  if _spans_processes(leaves) or not _packable(leaves, _flat_targets(treedef, shardings)):
    return None
  return _pack(leaves, treedef, dtype)


def _pack(leaves: list, treedef, dtype) -> params_lib.Packed:
  leaves = _cast(leaves, dtype)
  flat = _pack_one_device([x.addressable_data(0) for x in leaves])
  return params_lib.Packed(flat, treedef, tuple(x.shape for x in leaves))


def _send_packed(packed: params_lib.Packed, targets: list, keep_packed: bool) -> Any:
  """One transfer of the packed buffer, replicated on the sampler mesh; then split there unless
  `keep_packed` (a third dispatch after pack and transfer)."""
  flat = jax.device_put(packed.flat, jax.sharding.NamedSharding(_mesh_of(targets[0]), jax.sharding.PartitionSpec()))
  packed = dataclasses.replace(packed, flat=flat)
  return packed if keep_packed else _unpacker(packed.treedef, tuple(targets))(packed)


def buckets(nbytes: list[int], bucket_bytes: int) -> list[list[int]]:
  """Consecutive index groups whose sizes sum to <= bucket_bytes (an oversized array goes alone)."""
  if bucket_bytes <= 0:
    raise ValueError(f"weight sync bucket_bytes={bucket_bytes} must be > 0")
  out, size = [[]], 0
  for i, n in enumerate(nbytes):
    if out[-1] and size + n > bucket_bytes:
      out.append([])
      size = 0
    out[-1].append(i)
    size += n
  return [b for b in out if b]


@functools.lru_cache(maxsize=64)
def _gatherer(out_shardings: tuple, dtype: str | None):
  """A jitted cast + all-gather: every output replicated over the learner mesh (compiled once per bucket)."""
  return jax.jit(lambda xs: cast_floats(list(xs), dtype), out_shardings=list(out_shardings))


def _sync_across_hosts(tree: Any, shardings: Any, dtype, bucket_bytes: int) -> Any:
  leaves, treedef = jax.tree.flatten(tree)
  targets = treedef.flatten_up_to(shardings)
  for x, t in zip(leaves, targets):
    if not t.is_fully_addressable:
      raise ValueError(f"weight sync on {jax.process_count()} processes: the sampler sharding {t} spans "
                       "other hosts; each host's sampler mesh must hold only its own devices "
                       "(tunixlike.mesh.make_meshes)")
  dtype_name = _dtype_name(dtype)
  out = [None] * len(leaves)
  sizes = [x.size * (jnp.dtype(dtype_name).itemsize if dtype_name else x.dtype.itemsize) for x in leaves]
  spread = [i for i, x in enumerate(leaves) if not x.is_fully_addressable]
  for i in sorted(set(range(len(leaves))) - set(spread)):  # already on this host: a local copy
    out[i] = jax.device_put(_cast(leaves[i], dtype), targets[i], may_alias=False)
  for bucket in buckets([sizes[i] for i in spread], bucket_bytes):
    bucket = [spread[j] for j in bucket]
    xs = [leaves[i] for i in bucket]
    replicated = tuple(jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())
                       for x in xs)
    gathered = _gatherer(replicated, dtype_name)(xs)
    for i, g in zip(bucket, gathered):
      # A full copy on one of this host's learner devices -> this host's sampler devices.
      out[i] = jax.device_put(g.addressable_shards[0].data, targets[i])
    jax.block_until_ready([out[i] for i in bucket])  # frees the gathered bucket: extra memory ~ one bucket
    del gathered
  return jax.tree.unflatten(treedef, out)


def subtree_like(full: Any, part: Any) -> Any:
  """The entries of nnx State `full` at the paths of `part` (e.g. the LoRA adapters' shardings)."""
  from flax import nnx
  table = dict(nnx.to_flat_state(full))
  return nnx.from_flat_state([(path, table[path]) for path, _ in nnx.to_flat_state(part)])


def replace_leaves(full: Any, part: Any) -> Any:
  """`full` with the entries at `part`'s paths replaced (LoRA sync: new adapters, same base).
  A `Packed` part stays packed: the engine merges it inside its programs."""
  if isinstance(full, params_lib.WithAdapters):
    full = full.base
  if isinstance(part, params_lib.Packed):
    return params_lib.WithAdapters(full, part)
  from flax import nnx
  return nnx.merge_state(full, part)
