"""Weights from the learner hosts to the sampler hosts by cross-host `jax.device_put`.

JAX moves an array between device sets of different processes through its DCN transfer server
(`jax_cross_host_transfer_socket_address`; works on CPU, GPU and TPU) when the source and target
shardings are the same HLO sharding: the same device count and shard shapes. So the learner hosts
first all-gather each bucket within the learner mesh (a collective of the learner hosts only; the
cast to the sampler's dtype happens in the same program), the learner host that serves a sampler
host stages one replica of it on its own devices in the sampler's layout (`HostLayout.staging`),
and one `jax.device_put` of the bucket lands on that sampler host's first replica
(`HostLayout.landing`): each byte crosses once, and the sampler host copies it to its other
replicas locally. The receiver acknowledges through the coordination service's key-value store;
only then does the sender free the bucket, so the extra memory is about one bucket. The version is one more array of the first bucket: it travels
with the weights. Many small arrays (LoRA adapters) are packed into one buffer first.

Every process of the layout calls `send_across_hosts` for each version, in the same order (JAX
pairs the two ends of each cross-host transfer by the order the processes issue them).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tunixlike.hosts import kv
from tunixlike.hosts.transfer_server import enable  # noqa: F401  (this module's entry point too)
from tunixlike.hosts.layout import HostLayout, SAMPLER
from tunixlike.rl import weight_sync

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


@functools.lru_cache(maxsize=64)
def _gatherer(out_shardings: tuple, dtype: str | None, packed: bool):
  """Cast + all-gather over the learner mesh (+ concatenation into one buffer when packed)."""
  def gather(xs):
    xs = weight_sync.cast_floats(list(xs), dtype)
    return [jnp.concatenate([x.reshape(-1) for x in xs])] if packed else xs
  return jax.jit(gather, out_shardings=list(out_shardings))


@functools.lru_cache(maxsize=32)
def _unpacker(shapes: tuple, out_shardings: tuple):
  def unpack(flat):
    out, at = [], 0
    for shape in shapes:
      size = int(np.prod(shape))
      out.append(flat[at:at + size].reshape(shape))
      at += size
    return out
  return jax.jit(unpack, out_shardings=list(out_shardings))


def _out_dtype(x, dtype) -> np.dtype:
  if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.dtype(dtype)
  return jnp.dtype(x.dtype)


def _packable(leaves, dtypes, specs) -> bool:
  nbytes = sum(int(np.prod(x.shape)) * d.itemsize for x, d in zip(leaves, dtypes))
  return (len(leaves) >= weight_sync.PACK_MIN_LEAVES and nbytes <= weight_sync.PACK_MAX_BYTES
          and len(set(dtypes)) == 1 and all(s == PartitionSpec() for s in specs))


def send_across_hosts(tree: Any, specs: Any, *, layout: HostLayout, version: int, dtype=None,
                      bucket_bytes: int = weight_sync.DEFAULT_BUCKET_BYTES, timeout_s: float = 60.0,
                      tag: str = "weights") -> tuple[Any, int]:
  """Moves `tree` from the learner hosts to every sampler host in the sampler's layout.

  Every process calls it for each version in the same order. On learner hosts `tree` holds the
  learner's arrays (global over the learner mesh; the gather is their collective); on a sampler host it is the
  same structure of `jax.ShapeDtypeStruct`s (`jax.eval_shape`). `specs`: the sampler's
  PartitionSpec of every leaf (mesh.SAMPLER_RULES). Returns (on a sampler host the tree on its own
  devices, else None; the version that arrived with it). Raises `kv.HostTimeout` naming the host
  when a peer does not deliver or acknowledge within `timeout_s`.
  """
  if bucket_bytes <= 0:
    raise ValueError(f"weight sync bucket_bytes={bucket_bytes} must be > 0")
  me = jax.process_index()
  sampler = layout.role(me) == SAMPLER
  receivers = [me] if sampler else layout.receivers(me)
  leaves, treedef = jax.tree.flatten(tree)
  spec_leaves = treedef.flatten_up_to(specs)
  dtypes = [_out_dtype(x, dtype) for x in leaves]
  dtype_name = None if dtype is None else jnp.dtype(dtype).name
  packed = _packable(leaves, dtypes, spec_leaves)
  # Items that cross: (shape, dtype, spec, leaf indices): one per leaf, or the one packed buffer.
  if packed:
    size = sum(int(np.prod(x.shape)) for x in leaves)
    items = [((size,), dtypes[0], PartitionSpec(), list(range(len(leaves))))]
  else:
    items = [(tuple(x.shape), d, s, [i]) for i, (x, d, s) in enumerate(zip(leaves, dtypes, spec_leaves))]
  groups = weight_sync.buckets([int(np.prod(shape)) * d.itemsize for shape, d, _, _ in items], bucket_bytes)
  received = [None] * len(items)
  arrived_version = version
  for b, group in enumerate(groups):
    bucket = [items[k] for k in group]
    gathered = None
    if not sampler:  # every learner host: the collective gather of this bucket
      xs = [leaves[i] for _, _, _, idx in bucket for i in idx]
      replicated = NamedSharding(layout.learner, PartitionSpec())
      outs = 1 if packed else len(xs)
      gathered = _gatherer((replicated,) * outs, dtype_name, packed)(xs)
    puts = []
    # Every process issues every sampler host's transfer, in the same order: JAX pairs the two ends
    # of a cross-host transfer by the order each process issues them (one learner host sending to
    # two sampler hosts hangs otherwise); where a process holds neither end the call does nothing.
    for s in layout.sampler_hosts:
      sends = me == layout.senders[s]
      shardings = [NamedSharding(layout.staging[s], spec) for _, _, spec, _ in bucket]
      targets = [NamedSharding(layout.landing[s], spec) for _, _, spec, _ in bucket]
      if sends:
        staged = [jax.device_put(g.addressable_shards[0].data, sh) for g, sh in zip(gathered, shardings)]
      else:
        staged = [jax.make_array_from_single_device_arrays(shape, sh, [], dtype=d)
                  for (shape, d, _, _), sh in zip(bucket, shardings)]
      if b == 0:  # the version rides in the first bucket
        vs = NamedSharding(layout.staging[s], PartitionSpec())
        staged.append(jax.device_put(np.asarray(version, np.int32), vs) if sends
                      else jax.make_array_from_single_device_arrays((), vs, [], dtype=np.int32))
        targets.append(NamedSharding(layout.landing[s], PartitionSpec()))
      out = jax.device_put(staged, targets)
      if s in receivers:
        puts.append((s, staged, out))
    what = f"weight sync v{version} bucket {b + 1}/{len(groups)}"
    for s, staged, out in puts:
      key = f"tunixlike/{tag}/{version}/{b}/{s}"
      if sampler:
        _wait_ready(out, timeout_s=timeout_s, host=layout.senders[s], what=what)
        kv.put(key, b"ok")
        if b == 0:
          arrived_version = int(np.asarray(out.pop().addressable_shards[0].data))
        fan_out = [NamedSharding(layout.samplers[s], spec) for _, _, spec, _ in bucket]
        for k, x in zip(group, jax.device_put(out, fan_out), strict=True):  # to every replica, locally
          received[k] = x
      else:  # the bucket stays alive until the sampler host has it
        kv.get(key, timeout_s=timeout_s, host=s, what=what)
        kv.delete(key)
    del gathered, puts
  if not sampler:
    return None, version
  if packed:
    targets = tuple(NamedSharding(layout.samplers[me], s) for s in spec_leaves)
    out_leaves = _unpacker(tuple(tuple(x.shape) for x in leaves), targets)(received[0])
  else:
    out_leaves = received
  return jax.tree.unflatten(treedef, out_leaves), arrived_version
