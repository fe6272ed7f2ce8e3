"""Weight sync from the learner submesh to the sampler submesh by `jax.device_put` resharding.

`WeightSync` is the object the runtime calls after every train step: built once per policy from
explicit arguments (the sampler's shardings, where the sampler's params sit among the learner
state's arrays, a mode, a dtype, a bucket size, a cross-host strategy), it returns the sampler's
params with the version they are (`Synced`). Its three modes:

- `full`: the whole model every sync, all its arrays in one `device_put` (no per-parameter
  round-trips, the overhead FIELD.md warns about);
- `lora`: the whole model once, then only the adapters (`state.params`), packed into one buffer right
  behind the train step (`after_step`) and kept packed on the sampler (`sampler.params.WithAdapters`:
  the engine splits it inside its own programs);
- `packed`: a small model on one process: the train step itself packs the sampler's params into
  one buffer replicated on the learner mesh (`step_output`, compiled into the step by the policy),
  and a sync is one transfer of it.

`sync` below is the function under all three (and what the warm start's and `tunixlike.eval`'s
one-off syncs call): an optional dtype cast (e.g. a bf16 sampler) happens on the learner devices
first so that half the bytes cross; small trees of many arrays are packed into one buffer; every
sync is timed.

Several processes (multi-controller JAX, no Pathways): when the learner's arrays span hosts, `sync`
hands the tree to a cross-host strategy (`across_hosts`, a `HostTransfer`). The one built in,
`gather_on_each_host`, all-gathers the learner arrays within the learner mesh, a bucket of at most
`bucket_bytes` at a time to bound the extra memory, which leaves a full copy on each host's
learner devices; then every host copies that to its own sampler devices (`mesh.make_meshes` keeps
each host's sampler mesh local): a device_put that never leaves the host. With whole sampler hosts
(mesh.sampler_hosts) the sampler's shardings are on other processes, and the strategy is
`hosts.weights.Sender` (a cross-host `jax.device_put`; the sampler hosts' end is
`hosts.weights.Receiver`, since they hold no learner state to call `sync` with). Every process
must call `sync` at the same point.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from tunixlike import trace as trace_lib
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
         bucket_bytes: int = DEFAULT_BUCKET_BYTES, keep_packed: bool = False,
         across_hosts: HostTransfer | None = None, version: int = 0) -> tuple[Any, float]:
  """Returns (the tree on the sampler shardings, milliseconds taken).

  `block=True` waits for the copy, and the time measured is the transfer's. With `block=False` it
  returns once the copy is enqueued (the learner's time in sync): the learner's next step may
  donate the source buffers at once (the runtime orders a donation after the reads queued before
  it), and the sampler's next call waits for the copy on its devices. The result never aliases the
  source: in the colocated layout the sampler keeps reading it while the learner donates its own
  buffers to the next step. `bucket_bytes` bounds the all-gathered bytes held at once on several
  hosts (unused on one; there each bucket is waited for). With `keep_packed`, a tree that takes the
  packed path comes back as a `Packed` buffer replicated on the sampler mesh (`Packed.unpack()`
  gives the tree; `Engine` accepts it alone or inside `WithAdapters`). `across_hosts` moves a tree
  whose arrays span processes, or whose targets are on other processes (default
  `gather_on_each_host`), with `version` (whole sampler hosts send it with the weights).
  """
  start = time.perf_counter()
  if isinstance(tree, params_lib.Packed):  # packed on the learner already (`pack`, cast included)
    out = _send_packed(tree, _flat_targets(tree.treedef, shardings), keep_packed)
  else:
    out = _sync_tree(tree, shardings, dtype, bucket_bytes, keep_packed, across_hosts or gather_on_each_host,
                     version)
  if block:
    out = jax.block_until_ready(out)
  return out, (time.perf_counter() - start) * 1e3


def _sync_tree(tree, shardings, dtype, bucket_bytes: int, keep_packed: bool, across_hosts: HostTransfer,
               version: int) -> Any:
  leaves, treedef = jax.tree.flatten(tree)  # once: flattening an nnx State is slow next to a LoRA sync
  targets = _flat_targets(treedef, shardings)
  if _spans_processes(leaves) or not _addressable(targets):
    return across_hosts(tree, shardings, dtype=dtype, bucket_bytes=bucket_bytes, version=version)
  if _on_same_devices(leaves, targets):  # colocated: one program reshards every array where it is
    return jax.tree.unflatten(treedef, _resharder(tuple(targets), _dtype_name(dtype))(leaves))
  if _packable(leaves, targets):
    return _send_packed(_pack(leaves, treedef, dtype), targets, keep_packed)
  return jax.device_put(_cast(tree, dtype), shardings, may_alias=False)


def _addressable(targets) -> bool:
  """Every target on this process's devices (not another host's sampler: `hosts.weights.Sender`)."""
  return all(t.is_fully_addressable for t in targets)


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
  targets = _flat_targets(treedef, shardings)
  if _spans_processes(leaves) or not _addressable(targets) or not _packable(leaves, targets):
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


class HostTransfer(Protocol):
  """A cross-host strategy: `tree` (learner arrays spanning processes, or bound for other processes'
  devices) on `shardings` (the sampler's), floats cast to `dtype`, holding at most about
  `bucket_bytes` of extra memory at once, as policy `version`. Returns the tree on this process's
  sampler devices (None where this process has none). Called by every process at the same point.

  Two are built in: `gather_on_each_host` (per-host split) and `hosts.weights.Sender` (whole
  sampler hosts, mesh.sampler_hosts; its other end is `hosts.weights.Receiver`)."""

  def __call__(self, tree: Any, shardings: Any, *, dtype, bucket_bytes: int, version: int = 0) -> Any: ...


def gather_on_each_host(tree: Any, shardings: Any, *, dtype, bucket_bytes: int, version: int = 0) -> Any:
  """The per-host split layout's strategy: all-gather each bucket within the learner mesh, then
  copy it from one of this host's learner devices to this host's sampler devices (the version
  stays with the caller: nothing leaves the host)."""
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


# ---- the object the runtime calls ---------------------------------------------------------------
MODES = ("full", "lora", "packed")


@dataclasses.dataclass(frozen=True)
class Synced:
  """The sampler's params (on its devices; the copy may still be in flight) and the policy version
  they are: the version travels with the weights."""

  params: Any
  version: int
  ms: float  # the caller's time in the sync (the copy itself is queued)


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """Where the sampler's params sit among a TrainState's model arrays (`state.params`, then
  `state.frozen`): their tree structure and each array's index. Matched once, it builds the sampler's
  tree from a state without an nnx merge and split (milliseconds per sync on a small model)."""

  treedef: Any
  indices: tuple[int, ...]

  @staticmethod
  def leaves(state) -> list:
    return jax.tree.leaves((state.params, state.frozen))

  @classmethod
  def match(cls, state, sampler_tree: Any) -> StateLayout | None:
    """The layout of `sampler_tree` (built from `state`, e.g. `nnx.split(model)[1]`) in `state`; None
    when its arrays are not the state's own (an offloaded learner's)."""
    index = {id(x): i for i, x in enumerate(cls.leaves(state))}
    full, treedef = jax.tree.flatten(sampler_tree)
    if not all(id(x) in index for x in full):
      return None
    return cls(treedef, tuple(index[id(x)] for x in full))

  def arrays(self, state) -> list:
    xs = self.leaves(state)
    return [xs[i] for i in self.indices]

  def __call__(self, state) -> Any:
    return jax.tree.unflatten(self.treedef, self.arrays(state))


class WeightSync:
  """The learner's weights to the sampler, one call per step: `sync(state, version) -> Synced`.

  Built once per policy (see the module docstring for the modes):
    targets: the sampler's param shardings (`Engine.param_shardings`);
    sampler_params: state -> the sampler's param tree on the learner (a `StateLayout`, or any function);
    mode: 'full', 'lora' (the adapters are `state.params`) or 'packed' (needs a `StateLayout`);
    dtype: the sampler's float dtype (None: as trained), cast on the learner before the transfer;
    bucket_bytes: bound on the extra bytes a cross-host strategy holds at once;
    learner_mesh: where 'packed' leaves its buffer (replicated);
    keep_packed: 'packed' only: the sampler takes the buffer as it is (its params replicated) and its
      programs split it, rather than one program splitting it into the sampler's shardings;
    across_hosts: the cross-host strategy (default `gather_on_each_host`).

  The policy calls `after_step(state, step_output)` right after each train step (before it waits for
  the step): 'lora' queues the adapters' packing behind the step there, 'packed' keeps the buffer the
  step computed. Every process calls `sync` at the same point.
  """

  def __init__(self, targets: Any, sampler_params: Callable[[Any], Any], *, mode: str = "full", dtype=None,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES, learner_mesh=None, keep_packed: bool = False,
               across_hosts: HostTransfer | None = None, tracer=None):
    if mode not in MODES:
      raise ValueError(f"weight sync mode {mode!r}: expected one of {MODES}")
    if mode == "packed" and (not isinstance(sampler_params, StateLayout) or learner_mesh is None):
      raise ValueError("weight sync mode 'packed' needs a StateLayout and the learner mesh")
    buckets([], bucket_bytes)  # checks it
    self.targets, self.sampler_params, self.mode, self.dtype = targets, sampler_params, mode, dtype
    self.bucket_bytes, self.keep_packed = bucket_bytes, keep_packed
    self.across_hosts = across_hosts or gather_on_each_host
    self.tracer = tracer or trace_lib.NULL_TRACER
    self.last: Synced | None = None  # what the sampler was last handed
    self._pending = None  # (the state it was computed from, its packed weights): sent by the next sync
    self._adapter_targets = None  # 'lora': the adapters' sampler shardings, looked up once
    self._shapes = None  # 'packed': the shapes of the arrays in the buffer, looked up once
    if mode == "packed":
      self._replicated = jax.sharding.NamedSharding(learner_mesh, jax.sharding.PartitionSpec())
      self._pack_now = jax.jit(self.step_output, out_shardings=self._replicated)  # before the first step, after a restore

  # ---- 'packed': the buffer the train step computes -------------------------------------------
  def step_output(self, state) -> jax.Array:
    """The sampler's arrays of `state`, cast as the sync casts them, in one flat buffer (traceable:
    'packed' compiles it into the train step, `step_output_sharding` on the learner mesh)."""
    return jnp.concatenate([x.reshape(-1) for x in cast_floats(self.sampler_params.arrays(state), self.dtype)])

  @property
  def step_output_sharding(self):
    return self._replicated

  # ---- the calls -----------------------------------------------------------------------------------
  def after_step(self, state, step_output=None) -> None:
    """Right after the train step that produced `state` (`step_output`: what `step_output` computed in it)."""
    if self.mode == "packed" and step_output is not None:
      self._pending = (state, step_output)
    elif self.mode == "lora" and self.last is not None:  # queued behind the step on the devices
      self._pending = (state, pack(state.params, self._adapters_targets(state), dtype=self.dtype))

  def sync(self, state, version: int) -> Synced:
    """The sampler's params of `state` (policy `version`) on the sampler's devices; the copy is
    queued, and the sampler's next call waits for it on its devices."""
    start = time.perf_counter()
    pending, self._pending = self._pending, None
    pending = pending[1] if pending is not None and pending[0] is state else None  # not if restored since
    with self.tracer.span("weight_sync", cat="sync", version=version, mode=self.mode):
      if self.mode == "packed":
        flat = self._pack_now(state) if pending is None else pending
        packed = params_lib.Packed(flat, self.sampler_params.treedef, self._packed_shapes(state))
        params, _ = sync(packed, self.targets, keep_packed=self.keep_packed, block=False)
      elif self.mode == "full" or self.last is None:
        params, _ = sync(self.sampler_params(state), self.targets, dtype=self.dtype, block=False,
                         bucket_bytes=self.bucket_bytes, across_hosts=self.across_hosts, version=version)
      else:  # 'lora': the adapters only, into the base the sampler already holds
        adapters = state.params if pending is None else pending
        synced, _ = sync(adapters, self._adapters_targets(state), dtype=self.dtype, keep_packed=True, block=False,
                         bucket_bytes=self.bucket_bytes, across_hosts=self.across_hosts, version=version)
        # None: the sampler is on other hosts (`hosts.weights.Sender`), which merge the adapters there.
        params = None if synced is None else replace_leaves(self.last.params, synced)
    self.last = Synced(params, version, (time.perf_counter() - start) * 1e3)
    return self.last

  @property
  def synced_params(self) -> Any:
    """The params last handed to the sampler as one plain tree (packed buffers unpacked), or None."""
    return None if self.last is None or self.last.params is None else params_lib.materialize(self.last.params)

  def _adapters_targets(self, state):
    if self._adapter_targets is None:
      self._adapter_targets = subtree_like(self.targets, state.params)
    return self._adapter_targets

  def _packed_shapes(self, state) -> tuple:
    if self._shapes is None:  # the same every step: looked up once (flattening the state costs ms)
      self._shapes = tuple(x.shape for x in self.sampler_params.arrays(state))
    return self._shapes


def for_learner(learner, targets: Any, *, dtype=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                across_hosts: HostTransfer | None = None, tracer=None) -> WeightSync:
  """The weight sync of `learner`'s policy to `targets` (the sampler's shardings), its mode chosen here:

  'lora' for a LoRA learner; 'packed' for a small model on one process whose sampler arrays are the
  state's own and of one dtype after the cast (at most PACK_MAX_BYTES): one transfer per sync
  instead of one per array (the learner's time per sync for the main job's model, idle machine:
  4.5 ms per array, 1.4 ms split on the sampler by one program, 0.7 ms kept packed, 2026-11-26);
  otherwise 'full'.
  """
  from tunixlike.learner.train_step import Learner
  state, mesh = learner.state, learner.mesh
  layout = StateLayout.match(state, learner.sampler_params(state))
  sampler_params = layout or learner.sampler_params
  common = dict(dtype=dtype, bucket_bytes=bucket_bytes, across_hosts=across_hosts, tracer=tracer)
  if learner.lora:
    return WeightSync(targets, sampler_params, mode="lora", **common)
  one_process = mesh is not None and len({d.process_index for d in mesh.devices.flat}) == 1
  here = all(s.is_fully_addressable for s in jax.tree.leaves(targets))  # not another host's sampler
  if layout is not None and one_process and here and isinstance(learner, Learner):
    arrays = jax.eval_shape(lambda s: cast_floats(layout.arrays(s), dtype), state)
    if len({x.dtype for x in arrays}) == 1 and sum(x.size * x.dtype.itemsize for x in arrays) <= PACK_MAX_BYTES:
      keep = all(s.is_fully_replicated for s in jax.tree.leaves(targets))
      return WeightSync(targets, layout, mode="packed", learner_mesh=mesh, keep_packed=keep, **common)
  return WeightSync(targets, sampler_params, mode="full", **common)


@functools.partial(jax.jit, static_argnums=1)
def _checksum(leaves, dtype):
  total = jnp.uint32(0)
  for k, x in enumerate(leaves):
    if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
      x = x.astype(dtype)
    if x.dtype == jnp.bool_ or x.dtype.itemsize not in (1, 2, 4):
      bits = x.astype(jnp.uint32)
    else:
      bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
    total += bits.astype(jnp.uint32).sum(dtype=jnp.uint32) * jnp.uint32(k + 1)
  return total


def checksum(tree: Any, dtype=None) -> int:
  """The bits of every array of `tree` (floats cast to `dtype` first) summed as uint32, each array
  weighted by its place: integer sums wrap and do not depend on the order of reduction, so the
  learner's sharded arrays and the sampler's copy give the same number exactly when their bits
  are the same. A collective where `tree` spans hosts."""
  name = None if dtype is None else jnp.dtype(dtype).name
  return int(np.asarray(_checksum(jax.tree.leaves(tree), name).addressable_data(0)))
