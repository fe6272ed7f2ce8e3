"""Weights from the learner hosts to the sampler hosts by cross-host `jax.device_put`.

JAX moves an array between device sets of different processes through its DCN transfer server
(`jax_cross_host_transfer_socket_address`; works on CPU, GPU and TPU) when the source and target
shardings are the same HLO sharding: the same device count and shard shapes. So each bucket of
weights crosses as flat buffers split evenly over a host's devices (a large array alone, the small
ones concatenated per dtype):

1. **pack**: one program over the learner mesh casts the bucket's arrays to the sampler's dtype and
   flattens them into buffers that every learner host holds whole, split over its own devices
   (`P('local')` on a (hosts, local) view of the learner mesh): each byte is gathered to a host
   once, not to every device, and an FSDP shard is already its device's part (nothing moves);
2. **transfer**: the sending host's D shards of each buffer are one array on its D devices, and one
   `jax.device_put` moves them to the sampler host's D devices in the same split: D streams in
   parallel (one per device pair), each byte crosses once;
3. **gather + unpack + place** (`unpack`): on the sampler host each buffer's pieces are copied onto
   one of its devices (the buffers spread over the devices by size), a program there cuts them into
   the arrays, and one batched `jax.device_put` copies each array into the sampler's layout (`specs`):
   a replica per device, or each device its slice. No collective, and each replica is written once.

An array of 1 MiB or more that the sampler's layout splits over its 'tensor' axis skips the flat
buffers: the pack reshards it to that layout on each learner host (an FSDP shard by rows that is
already a sampler device's part, uncast, is sent as it is), and its own transfer delivers each
device of the sampler host's first tensor group its part, which the other replicas (if any) copy.
With the tensor axis over a whole host the sampler host writes each byte once, as a plain copy does.

A packed buffer under 4 MiB (`WHOLE_BYTES`: LoRA adapters, norms) is not split: it crosses whole
from the sending host's first device to the sampler host's first device, is copied to its other
devices in one call, and one program cuts each device's copy into place (`_placer`): three steps
where a split buffer takes five (transfer, gather, cut, place), each of which costs a dispatch of a
millisecond or more on a loaded host. The version rides in that call of the first bucket: it
travels with the weights.

The sampler host acknowledges each bucket through the coordination service's key-value store; the
sender frees a bucket only then, and keeps at most two buckets in flight (bucket k+1 is packed and
sent while k is acknowledged), so the extra memory is about two buckets. A sampler host asks for a
bucket once the learner host says it is packed (a "packed" flag in the store), except a bucket of
whole buffers alone (a LoRA-only sync), asked for at once.

A sampler host's weights come from `layout.senders[s]`: a learner host, or a sampler host that
already has them (a relay); every process calls `send_across_hosts` for each version, in the same
order (JAX pairs the two ends of each cross-host transfer by the order the processes issue them).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tunixlike import mesh as mesh_lib
from tunixlike.hosts import kv
from tunixlike.hosts.layout import HostLayout, SAMPLER
from tunixlike.hosts.transfer_server import enable  # noqa: F401  (this module's entry point too)
from tunixlike.rl import weight_sync

IN_FLIGHT = 2  # buckets sent before the oldest one's acknowledgement is awaited
SMALL_BYTES = 2**20  # arrays under this travel packed together (`_wires`)
WHOLE_BYTES = 4 * 2**20  # a packed buffer under this crosses whole, not split (`_Wire.whole`)
FLAT = PartitionSpec("local")
WHOLE = PartitionSpec()


def _wait_ready(arrays, *, timeout_s: float, host: int, what: str) -> None:
  """block_until_ready with a timeout that names the host the data comes from."""
  done, error = threading.Event(), []

  def wait():
    try:
      jax.block_until_ready(arrays)
    except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
      error.append(e)
    finally:
      done.set()

  threading.Thread(target=wait, daemon=True, name="cross-host-wait").start()
  if not done.wait(timeout_s):
    raise kv.HostTimeout(f"{what}: nothing from host {host} within {timeout_s:g} s")
  if error:
    raise RuntimeError(f"{what}: the transfer from host {host} failed: {error[0]}") from error[0]


@dataclasses.dataclass(frozen=True)
class _Wire:
  """One flat buffer of a bucket: one large array alone, or the small arrays of one dtype
  concatenated. Split over a host's devices (padded to a multiple of their count), or, if `whole`,
  a copy on each device."""
  dtype: np.dtype
  leaves: tuple[int, ...]
  size: int  # elements, padded when split
  whole: bool = False


def _wires(leaves, dtypes, group, per_host: int) -> list[_Wire]:
  """A large array travels alone: flattening an array sharded along its first axis (FSDP) into a
  buffer split over a host's devices moves nothing, where concatenating it with others would copy it
  (on CPU, 5 ms against 480 ms for 32 MB in 32 arrays). Small ones travel packed per dtype: a
  transfer costs a fixed overhead. A packed buffer under WHOLE_BYTES (LoRA adapters, norms) crosses
  whole, first device to first device: the sampler host copies it to its other devices in one call
  and cuts it into place with one program, where a split one costs a gather, a cut and a copy per
  array per replica (`unpack`; on this 2-core CPU 3-6, 0.3 and 3-6 ms for 256 KiB of LoRA adapters)."""
  def padded(idx):
    n = sum(int(np.prod(leaves[i].shape)) for i in idx)
    return -(-n // per_host) * per_host

  out, small = [], collections.defaultdict(list)
  for i in group:
    if int(np.prod(leaves[i].shape)) * dtypes[i].itemsize >= SMALL_BYTES:
      out.append(_Wire(dtypes[i], (i,), padded([i])))
    else:
      small[dtypes[i]].append(i)
  for d, idx in small.items():
    n = sum(int(np.prod(leaves[i].shape)) for i in idx)
    whole = n * d.itemsize < WHOLE_BYTES
    out.append(_Wire(d, tuple(idx), n if whole else padded(idx), whole=whole))
  return out


@dataclasses.dataclass(frozen=True)
class _Bucket:
  """One bucket's arrays by how they cross: flat buffers split over a host's devices, packed buffers
  that cross whole, and the ids of the arrays that cross in the sampler's tensor layout."""
  split: tuple[_Wire, ...]
  whole: tuple[_Wire, ...]
  direct: tuple[int, ...]

  @property
  def wires(self) -> tuple[_Wire, ...]:
    return self.split + self.whole

  @property
  def flagged(self) -> bool:
    """A sampler host waits for the "packed" flag of this bucket: a bucket of whole buffers alone
    (LoRA adapters) is packed in a millisecond, where the flag's round trip costs as much."""
    return bool(self.split or self.direct)


def _staged(shape, sharding: NamedSharding, x, dtype, mine: bool) -> jax.Array:
  """The sender's shards of `x` on `sharding`'s devices as one array (no copy); on the other end of
  the transfer (`mine` False) the empty array of the same shape that `jax.device_put` pairs it with."""
  on = set(sharding.mesh.devices.flat)
  shards = [shard.data for shard in x.addressable_shards if shard.device in on] if mine else []
  return jax.make_array_from_single_device_arrays(shape, sharding, shards, dtype=dtype)


def _tensor_split(shape: tuple, spec: PartitionSpec, tensor: int) -> bool:
  """True if `spec` splits an array of `shape` over the sampler's 'tensor' axis (of size `tensor`)
  evenly and over no other axis: each device of a tensor group then holds a part of its own."""
  axes = [a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)]
  if tensor <= 1 or set(axes) != {"tensor"} or len(axes) != 1:
    return False
  dim = next(d for d, entry in enumerate(spec) if entry is not None)
  return shape[dim] % tensor == 0


@functools.lru_cache(maxsize=64)
def _packer(wires: tuple, direct_specs: tuple, dtype: str | None, host_view: Mesh, tensor_mesh: Mesh):
  """Cast + flatten (+ concatenate) into flat buffers, each split over every learner host's devices
  (`host_view`: ('hosts', 'local')) or, if `whole`, a copy on each; and cast + reshard the arrays
  that travel in the sampler's layout (`direct_specs`) onto each learner host's devices in that
  layout (`tensor_mesh`: ('hosts', 'replica', 'tensor'))."""
  def pack(xs, direct):
    out = []
    for parts, wire in zip(xs, wires):
      parts = weight_sync.cast_floats(list(parts), dtype)
      flat = jnp.concatenate([x.reshape(-1) for x in parts]) if len(parts) > 1 else parts[0].reshape(-1)
      out.append(flat if flat.shape[0] == wire.size else jnp.pad(flat, (0, wire.size - flat.shape[0])))
    return out, weight_sync.cast_floats(list(direct), dtype)
  wire_shardings = [NamedSharding(host_view, WHOLE if w.whole else FLAT) for w in wires]
  return jax.jit(pack, out_shardings=(wire_shardings, [NamedSharding(tensor_mesh, s) for s in direct_specs]))


def _lanes(nbytes: list[int], devices: int) -> list[int]:
  """Each wire's lane: the device of the sampler host it is cut on, the largest wire first onto the
  least loaded device, so that the cutting and the copies out of each device are balanced."""
  load, lanes = [0] * devices, [0] * len(nbytes)
  for w in sorted(range(len(nbytes)), key=lambda w: -nbytes[w]):
    lanes[w] = min(range(devices), key=lambda d: load[d])
    load[lanes[w]] += nbytes[w]
  return lanes


def _cut(flat, shapes) -> list:
  """A flat buffer -> its arrays, of `shapes`, in order."""
  at, out = 0, []
  for shape in shapes:
    size = int(np.prod(shape))
    out.append(flat[at:at + size].reshape(shape))
    at += size
  return out


@functools.lru_cache(maxsize=64)
def _cutter(shapes: tuple):
  """A wire's pieces, all on one device -> its arrays (`shapes[w]`: wire w's arrays' shapes), on that
  device: a program of one device, no collective."""
  def cut(wires):
    out = []
    for pieces, wire_shapes in zip(wires, shapes):
      out += _cut(jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0], wire_shapes)
    return out
  return jax.jit(cut)


@functools.lru_cache(maxsize=64)
def _placer(shapes: tuple, targets: tuple):
  """Whole buffers (each a copy on every device of the sampler host; `shapes[w]`: buffer w's arrays'
  shapes) -> their arrays in the sampler's layout (`targets`, in order): one program in which each
  device slices its own copy: no collective, no copy between devices."""
  return jax.jit(lambda wholes: [x for flat, wire_shapes in zip(wholes, shapes) for x in _cut(flat, wire_shapes)],
                 out_shardings=list(targets))


def unpack(flats, shapes: tuple, targets: tuple, mesh: Mesh, lap=lambda stage, arrays: None) -> list[jax.Array]:
  """A bucket's buffers as they arrived, each split over this host's devices (`FLAT` on `mesh`) ->
  its arrays in the sampler's layout (`targets`, in wire order; `shapes[w]`: wire w's arrays'
  shapes), by copies and programs of one device, with no collective:

  1. gather: each buffer's pieces are copied onto one device, its lane (`_lanes`: the buffers
     spread over the devices by size), in one batched `jax.device_put`;
  2. unpack: on each lane one program cuts its buffers into their arrays;
  3. place: one batched `jax.device_put` puts every array into its target layout: a copy per other
     device for a replicated one (the lane's own is the array itself), a slice per device for a
     tensor-sharded one.

  A replicated array of W bytes costs the host's D devices W (D - 1) / D + W + W (D - 1) bytes
  written after the transfer's W, against W (D - 1) + W D if every device received every piece and
  cut its own copy: 5.75 against 8 times the weights for D = 4, on the CPU backend all in one RAM.
  On the CPU backend with jax.distributed started every XLA collective goes through gloo over TCP,
  even among one process's devices, so the all-gather that an unpack program would otherwise use
  is slower than copies. `lap(stage, arrays)`: the
  profile's clock."""
  devices = list(mesh.devices.flat)
  lanes = [devices[d] for d in _lanes([flat.nbytes for flat in flats], len(devices))]
  shards = [sorted(flat.addressable_shards, key=lambda shard: shard.index[0].start or 0) for flat in flats]
  moves = [(shard.data, lane) for wire, lane in zip(shards, lanes) for shard in wire if shard.device != lane]
  moved = iter(jax.device_put([x for x, _ in moves], [d for _, d in moves]))
  pieces = [tuple(shard.data if shard.device == lane else next(moved) for shard in wire)
            for wire, lane in zip(shards, lanes)]
  lap("gather", pieces)
  starts = np.cumsum([0] + [len(wire_shapes) for wire_shapes in shapes])  # wire w's arrays: starts[w]:starts[w+1]
  arrays: list = [None] * int(starts[-1])
  for lane in dict.fromkeys(lanes):  # each lane's wires, cut by one program on its device
    wires = [w for w, l in enumerate(lanes) if l == lane]
    cut = _cutter(tuple(shapes[w] for w in wires))(tuple(pieces[w] for w in wires))
    at = iter(cut)
    for w in wires:
      for i in range(starts[w], starts[w + 1]):
        arrays[i] = next(at)
  del pieces
  lap("unpack", arrays)
  arrays = jax.device_put(arrays, list(targets))
  lap("place", arrays)
  return arrays


def _shapes(leaves, wires) -> tuple:
  """Each wire's arrays' shapes."""
  return tuple(tuple(tuple(leaves[i].shape) for i in w.leaves) for w in wires)


def _out_dtype(x, dtype) -> np.dtype:
  if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.dtype(dtype)
  return jnp.dtype(x.dtype)


def _host_mesh(layout: HostLayout, process: int) -> Mesh:
  """`process`'s devices as one flat ('local',) mesh, in the order its other meshes use them."""
  mesh = layout.samplers[process] if process in layout.samplers else layout.learner
  return Mesh(np.array([d for d in mesh.devices.flat if d.process_index == process]), ("local",))


def _sendable_as_is(x: jax.Array, dtype, target: NamedSharding) -> bool:
  """True if the learner's `x` needs no cast and every device of each learner host's first tensor
  group (`target.mesh[:, 0, :]`, which sends) holds the part of it that `target` gives that device:
  e.g. an FSDP shard by rows of an array the sampler splits by rows over as many devices."""
  if x.dtype != dtype:
    return False
  have, want = x.sharding.devices_indices_map(x.shape), target.devices_indices_map(x.shape)
  norm = lambda index: tuple(s.indices(n) for s, n in zip(index, x.shape))
  return all(d in have and norm(have[d]) == norm(want[d]) for d in target.mesh.devices[:, 0, :].flat)


def _first(host: Mesh) -> Mesh:
  """A host's first device (of its flat mesh `host`): where the whole buffers cross between hosts."""
  return Mesh(host.devices[:1], ("local",))


def _tensor_group(host: Mesh, tensor: int) -> Mesh:
  """A host's first `tensor` devices (of its flat mesh `host`) as a sampler mesh of one replica: where
  the arrays split over the 'tensor' axis cross between hosts."""
  return Mesh(host.devices[:tensor].reshape(1, tensor), mesh_lib.SAMPLER_AXES)


def send_order(layout: HostLayout) -> list[int]:
  """The sampler hosts in an order where each one's sender already has the weights (a learner host,
  or a sampler host earlier in the list)."""
  order, have = [], set(layout.learner_hosts)
  todo = list(layout.sampler_hosts)
  while todo:
    ready = [s for s in todo if layout.senders[s] in have]
    if not ready:
      raise ValueError(f"layout.senders {layout.senders}: sampler hosts {todo} never get the weights "
                       "(each sender must be a learner host or a sampler host that gets them first)")
    order += ready
    have.update(ready)
    todo = [s for s in todo if s not in have]
  return order


class _Clock:
  """Seconds per stage, when asked for (`profile`): each stage then ends with a wait for its
  result, which also stops the buckets from overlapping."""

  def __init__(self, profile: dict | None):
    self.profile = profile
    self.t = time.perf_counter()

  def lap(self, stage: str, arrays=None) -> None:
    if self.profile is None:
      return
    if arrays is not None:
      jax.block_until_ready(arrays)
    now = time.perf_counter()
    self.profile[stage] = self.profile.get(stage, 0.0) + now - self.t
    self.t = now


def send_across_hosts(tree: Any, specs: Any, *, layout: HostLayout, version: int, dtype=None,
                      bucket_bytes: int = weight_sync.DEFAULT_BUCKET_BYTES, timeout_s: float,
                      tag: str = "weights", profile: dict | None = None) -> tuple[Any, int]:
  """Moves `tree` from the learner hosts to every sampler host in the sampler's layout.

  Every process calls it for each version in the same order. On learner hosts `tree` holds the
  learner's arrays (global over the learner mesh; the packing is their collective); on a sampler
  host it is the same structure of `jax.ShapeDtypeStruct`s (`jax.eval_shape`). `specs`: the
  sampler's PartitionSpec of every leaf (mesh.SAMPLER_RULES). Returns (on a sampler host the tree on
  its own devices, else None; the version that arrived with it). Raises `kv.HostTimeout` naming the
  host when a peer does not deliver or acknowledge within `timeout_s`. `profile`: a dict to add this
  process's seconds per stage to (learner hosts: pack, ack; sampler hosts: wait_for_pack, transfer
  until the bytes are there, gather, unpack, place); it makes every stage wait for the last, so time a sync
  without it.

  A large array that the sampler's layout splits over its 'tensor' axis (`_tensor_split`) does not
  travel flat: the pack reshards it to that layout on each learner host, and one transfer delivers
  each device of the sampler host's first tensor group its own part (`_tensor_group`: the same HLO
  sharding on both ends, as cross-host device_put requires), which the other replicas copy (none
  when the tensor axis spans the host). The sampler host then writes each byte once, as a plain copy
  does, where a replicated array costs it the gather, the cut and a copy per replica (`unpack`).
  """
  if bucket_bytes <= 0:
    raise ValueError(f"weight sync bucket_bytes={bucket_bytes} must be > 0")
  me = jax.process_index()
  sampler = layout.role(me) == SAMPLER
  leaves, treedef = jax.tree.flatten(tree)
  spec_leaves = treedef.flatten_up_to(specs)
  dtypes = [_out_dtype(x, dtype) for x in leaves]
  dtype_name = None if dtype is None else jnp.dtype(dtype).name
  per_host = len(_host_mesh(layout, me).devices)
  nbytes = [int(np.prod(x.shape)) * d.itemsize for x, d in zip(leaves, dtypes)]
  groups = weight_sync.buckets(nbytes, bucket_bytes)
  tensor = next(iter(layout.samplers.values())).shape["tensor"]
  direct = [n >= SMALL_BYTES and _tensor_split(tuple(x.shape), spec, tensor)
            for n, x, spec in zip(nbytes, leaves, spec_leaves)]
  host_view = Mesh(layout.learner.devices.reshape(len(layout.learner_hosts), -1), ("hosts", "local"))
  tensor_view = Mesh(host_view.devices.reshape(len(layout.learner_hosts), -1, tensor),
                     ("hosts", *mesh_lib.SAMPLER_AXES))  # each learner host's devices as a sampler mesh
  def plan(group) -> _Bucket:
    wires = _wires(leaves, dtypes, [i for i in group if not direct[i]], per_host)
    return _Bucket(tuple(w for w in wires if not w.whole), tuple(w for w in wires if w.whole),
                   tuple(i for i in group if direct[i]))
  plans = [plan(group) for group in groups]
  received: list = [None] * len(leaves)
  arrived_version = version
  pending = collections.deque()  # (bucket, [(sampler host, arrays it receives)]) not yet acknowledged
  clock = _Clock(profile)

  def settle(b, arrivals):
    """Waits for bucket b: a receiver acknowledges it (and unpacks it), a sender for the ack."""
    nonlocal arrived_version
    what = f"weight sync v{version} bucket {b + 1}/{len(groups)}"
    for s, (flats, wholes, parts) in arrivals:
      key = f"tunixlike/{tag}/{version}/{b}/{s}"
      if s == me:
        _wait_ready((flats, wholes, parts), timeout_s=timeout_s, host=layout.senders[s], what=what)
        clock.lap("transfer")
        kv.put(key, b"ok")
        if b == 0:
          arrived_version = int(np.asarray(wholes.pop().addressable_shards[0].data)[0])
        split, whole = plans[b].split, plans[b].whole
        target = lambda i: NamedSharding(layout.samplers[me], spec_leaves[i])
        if split:
          arrays = unpack(flats, _shapes(leaves, split), tuple(target(i) for w in split for i in w.leaves),
                          _host_mesh(layout, me), lap=clock.lap)
          for i, x in zip([i for w in split for i in w.leaves], arrays, strict=True):
            received[i] = x
        if whole:  # a copy on each device (one call), which cuts its own into place (one program)
          wholes = jax.device_put(wholes, [NamedSharding(_host_mesh(layout, me), WHOLE)] * len(wholes))
          arrays = _placer(_shapes(leaves, whole), tuple(target(i) for w in whole for i in w.leaves))(tuple(wholes))
          for i, x in zip([i for w in whole for i in w.leaves], arrays, strict=True):
            received[i] = x
          clock.lap("place", arrays)
        if parts:  # the other replicas' copies of the tensor-split arrays (none if one replica)
          placed = jax.device_put(parts, [target(i) for i in plans[b].direct])
          for i, x in zip(plans[b].direct, placed, strict=True):
            received[i] = x
          clock.lap("place", placed)
      else:  # the sender keeps the bucket alive until the sampler host has it
        kv.get(key, timeout_s=timeout_s, host=s, what=what)
        kv.delete(key)
        clock.lap("ack")
    if not sampler and plans[b].flagged:
      kv.delete(packed_key(b, me))

  packed_key = lambda b, learner: f"tunixlike/{tag}/{version}/{b}/packed/{learner}"
  # A sampler host asks for a bucket only once it is packed (the "packed" flag, `_Bucket.flagged`):
  # a receive issued before its send made whole syncs 1.1-3.8x slower than the same sync with this
  # wait (JAX 0.10.2, CPU, load 20-36).
  order = send_order(layout)
  for b, bucket in enumerate(plans):
    wires, split, whole, ids = bucket.wires, bucket.split, bucket.whole, bucket.direct
    packed = None
    if not sampler:  # every learner host: the collective packing of this bucket
      xs = tuple(tuple(leaves[i] for i in w.leaves) for w in wires)
      # an array the learner holds in the sampler's layout already (no cast) is sent as it is: no copy
      as_is = {i for i in ids if _sendable_as_is(leaves[i], dtypes[i], NamedSharding(tensor_view, spec_leaves[i]))}
      reshard = [i for i in ids if i not in as_is]
      out, parts = _packer(wires, tuple(spec_leaves[i] for i in reshard), dtype_name, host_view,
                           tensor_view)(xs, [leaves[i] for i in reshard])
      parts = iter(parts)
      packed = (out[:len(split)], out[len(split):], [leaves[i] if i in as_is else next(parts) for i in ids])
      clock.lap("pack", packed)
      if bucket.flagged:
        jax.block_until_ready(packed)
        kv.put(packed_key(b, me), b"ok")
    elif layout.senders[me] in layout.learner_hosts and bucket.flagged:
      kv.get(packed_key(b, layout.senders[me]), timeout_s=timeout_s,
             host=layout.senders[me], what=f"weight sync v{version} bucket {b + 1}/{len(groups)}")
      clock.lap("wait_for_pack")
    arrivals, held = [], {}  # held: process -> this bucket's (split buffers, whole buffers, tensor-split arrays) on it
    if packed is not None:
      held[me] = packed
    # Every process issues every sampler host's transfers, in the same order: JAX pairs the two ends
    # of a cross-host transfer by the order each process issues them (one learner host sending to
    # two sampler hosts hangs otherwise); where a process holds neither end the call does nothing.
    for s in order:
      sender = layout.senders[s]
      src, dst = _host_mesh(layout, sender), _host_mesh(layout, s)
      flats, wholes, parts = held.get(me, ((), (), ())) if me == sender else ((), (), ())
      # the sender's D shards of each split buffer, and its first device's copy of each whole one, as
      # arrays on its own devices (no copy); one call per pair of device sets: every array of a
      # cross-host device_put call has the same shardings (a call mixing two pairs of them hung)
      on_src = lambda ws, xs, mesh, spec: [_staged((w.size,), NamedSharding(mesh, spec), x, w.dtype, me == sender)
                                           for w, x in itertools.zip_longest(ws, xs)]
      put = lambda xs, mesh, spec: jax.device_put(xs, [NamedSharding(mesh, spec)] * len(xs)) if xs else []
      out = put(on_src(split, flats, src, FLAT), dst, FLAT)
      out_whole = on_src(whole, wholes, _first(src), WHOLE)
      if b == 0:  # the version rides in the first bucket with the whole buffers
        out_whole.append(jax.device_put(np.full(1, version, np.int32), NamedSharding(_first(src), WHOLE))
                         if me == sender else jax.make_array_from_single_device_arrays(
                             (1,), NamedSharding(_first(src), WHOLE), [], dtype=np.int32))
      out_whole = put(out_whole, _first(dst), WHOLE)
      # the tensor-split arrays: the sender's first tensor group to the receiver's, a third call
      src_group, dst_group = _tensor_group(src, tensor), _tensor_group(dst, tensor)
      staged = [_staged(leaves[i].shape, NamedSharding(src_group, spec_leaves[i]), x, dtypes[i], me == sender)
                for i, x in itertools.zip_longest(ids, parts)]
      out_parts = jax.device_put(staged, [NamedSharding(dst_group, spec_leaves[i]) for i in ids]) if staged else []
      del staged
      if me == s:
        held[s] = (out, out_whole[:len(whole)], out_parts)  # a relay sends on what it received
        arrivals.append((s, (list(out), list(out_whole), list(out_parts))))
      elif me == sender:
        arrivals.append((s, ((), (), ())))
    pending.append((b, arrivals))
    del packed, held
    if len(pending) >= IN_FLIGHT or profile is not None:
      settle(*pending.popleft())
  while pending:
    settle(*pending.popleft())
  if not sampler:
    return None, version
  return jax.tree.unflatten(treedef, received), arrived_version
