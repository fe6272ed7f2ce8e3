"""Both ends of the weight sync with whole sampler hosts (mesh.sampler_hosts > 0).

`Sender` is `WeightSync`'s cross-host strategy (`weight_sync.HostTransfer`) on the learner hosts:
`WeightSync` hands it the model (mode 'full', and the first sync of 'lora') or the LoRA adapters,
and it moves them with `transfer.send_across_hosts`. A sampler host holds no learner state, so
it cannot call `WeightSync.sync`: its end is `Receiver`, which knows both parts' structure
(abstract arrays and the sampler's partition specs) and issues the same transfers.

JAX pairs the two ends of a cross-host transfer by the order each process issues them, so every
transfer is announced first: learner host 0 writes its sequence number, version and part
('model' or 'adapters') to the key-value store, and each sampler host receives the transfers in
that order. Waiting for an announcement has no time limit (the learner may be evaluating or
checkpointing); the transfer itself has `timeout_s` on both ends. The announcement also carries a
checksum of the bits sent (`weight_sync.checksum`); the receiver computes it again on what arrived and stops
the run if they differ, so a sampler host never decodes with weights other than the learner's.

To debug a sync (mesh.save_synced_weights), both ends also write every array of every sync to
`{dump_dir}/v{version}_{part}.npz`: learner host 0 what it sent (cast as sent), each sampler host
what arrived, to compare with `np.array_equal`.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tunixlike.hosts import kv, transfer
from tunixlike.rl import weight_sync
from tunixlike.hosts.layout import HostLayout

PREFIX = "tunixlike/weights"
MODEL, ADAPTERS = "model", "adapters"


def _announcement(n: int) -> str:
  return f"{PREFIX}/next/{n}"


class ChecksumMismatch(RuntimeError):
  """The weights that arrived are not the bits the learner sent."""


def _cast(tree: Any, dtype) -> Any:
  """Floats as `dtype` (the sampler's, rl.sync_dtype), what the transfer sends; None: as they are."""
  return jax.tree.map(lambda x: x.astype(dtype) if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
                      else x, tree)


def gathered(tree: Any, dtype=None) -> Any:
  """`tree` (on one mesh, which may span hosts) cast as sent and gathered whole as numpy arrays on
  every process of that mesh: a collective there."""
  mesh = jax.tree.leaves(tree)[0].sharding.mesh
  whole = jax.jit(functools.partial(_cast, dtype=dtype), out_shardings=NamedSharding(mesh, PartitionSpec()))(tree)
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), whole)


def save_npz(directory: str, version: int, part: str, tree: Any) -> str:
  """`tree`'s numpy arrays as `directory/v{version}_{part}.npz`, each under its path in the tree."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f"v{version}_{part}.npz")
  np.savez(path, **{jax.tree_util.keystr(k): x for k, x in jax.tree_util.tree_flatten_with_path(tree)[0]})
  return path


def specs_of(shardings: Any) -> Any:
  """The partition specs of a tree of NamedShardings (the same on every sampler host's mesh)."""
  return jax.tree.map(lambda s: s.spec, shardings)


class Sender:
  """Learner hosts: a `HostTransfer` that sends `tree` to every sampler host. `parts`: the tree
  structure of each part that may be sent ('model', 'adapters'), to name it in the announcement.
  `dump_dir`: learner host 0 writes every sync's arrays there (see the module docstring)."""

  def __init__(self, layout: HostLayout, parts: dict[str, Any], *, timeout_s: float, dump_dir: str | None = None):
    self.layout, self.parts, self.timeout_s, self.dump_dir = layout, parts, timeout_s, dump_dir
    self.sent = 0

  def __call__(self, tree: Any, shardings: Any, *, dtype, bucket_bytes: int, version: int = 0) -> None:
    structure = jax.tree.structure(tree)
    part = next((name for name, s in self.parts.items() if s == structure), None)
    if part is None:
      raise ValueError(f"weight sync to the sampler hosts: the tree is none of the parts {sorted(self.parts)}")
    total = weight_sync.checksum(tree, dtype)  # every learner host: a collective over the learner mesh
    first = jax.process_index() == self.layout.learner_hosts[0]
    if self.dump_dir is not None:
      sent = gathered(tree, dtype)  # a collective too
      if first:
        save_npz(self.dump_dir, version, part, sent)
    if first:
      kv.put(_announcement(self.sent), json.dumps({"version": version, "part": part, "checksum": total}).encode())
    self.sent += 1
    transfer.send_across_hosts(tree, specs_of(shardings), layout=self.layout, version=version, dtype=dtype,
                               bucket_bytes=bucket_bytes, timeout_s=self.timeout_s)
    return None  # the learner hosts keep nothing: the weights are on the sampler hosts


class Receiver:
  """A sampler host's end: `receive()` returns the next weights as the sampler's params (a whole
  tree on this host's sampler mesh) with their version.

  parts: 'model' (and with LoRA 'adapters') -> (a tree of `jax.ShapeDtypeStruct`, the sampler's
  NamedShardings of it); dtype and bucket_bytes as the learner's `WeightSync` (rl.sync_dtype and its
  bucket size): both ends must cut the same buckets. `dump_dir`: every sync's arrays as they
  arrived are written there (see the module docstring).
  """

  def __init__(self, layout: HostLayout, parts: dict[str, tuple[Any, Any]], *, dtype, bucket_bytes: int,
               timeout_s: float, dump_dir: str | None = None):
    self.layout, self.dtype, self.bucket_bytes, self.timeout_s = layout, dtype, bucket_bytes, timeout_s
    self.dump_dir = dump_dir
    self.parts = {name: (abstract, specs_of(shardings)) for name, (abstract, shardings) in parts.items()}
    self.received = 0
    self.params = None  # the whole model as last received (adapters are merged into it)
    self.checked: list[tuple[int, str, int]] = []  # (version, part, checksum) of every transfer, verified

  def receive(self, should_stop: Callable[[], bool] = lambda: False, poll_s: float = 0.5):
    """(params, version) of the next transfer; None once `should_stop()` while none is announced."""
    while True:
      announced = kv.wait(_announcement(self.received), poll_s)
      if announced is not None:
        info = json.loads(announced)
        break
      if should_stop():  # nothing announced yet
        return None
    abstract, specs = self.parts[info["part"]]
    tree, version = transfer.send_across_hosts(abstract, specs, layout=self.layout, version=info["version"],
                                               dtype=self.dtype, bucket_bytes=self.bucket_bytes,
                                               timeout_s=self.timeout_s)
    self.received += 1
    got = weight_sync.checksum(tree)
    if got != info["checksum"]:
      raise ChecksumMismatch(f"weight sync v{version} ({info['part']}): checksum {got} on sampler host "
                             f"{jax.process_index()}, {info['checksum']} on the learner hosts")
    self.checked.append((version, info["part"], got))
    if self.dump_dir is not None:
      save_npz(self.dump_dir, version, info["part"], jax.tree.map(np.asarray, tree))
    self.params = tree if info["part"] == MODEL else nnx.merge_state(self.params, tree)
    return self.params, version


def abstract(tree: Any) -> Any:
  """`tree` as `jax.ShapeDtypeStruct`s: what a receiver needs of a part."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
