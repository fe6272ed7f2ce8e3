"""The sampler host's end of a weight transfer on one process: the buffers that arrived split over
its devices become the sampler's arrays, whole on every replica, by device-to-device copies and a
program with no collective (on CPU with jax.distributed every collective goes through gloo over TCP)."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunixlike.hosts import transfer

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def test_spread_puts_every_piece_on_every_device_in_order():
  mesh = Mesh(np.array(jax.devices()[:4]), ("local",))
  values = np.arange(16, dtype=np.float32)
  pieces = transfer.spread(jax.device_put(values, NamedSharding(mesh, P("local"))), mesh)
  assert len(pieces) == 4
  for k, piece in enumerate(pieces):
    assert piece.sharding.is_fully_replicated and set(piece.devices()) == set(mesh.devices.flat)
    for shard in piece.addressable_shards:  # each device's own copy holds the k-th quarter
      np.testing.assert_array_equal(np.asarray(shard.data), values[4 * k:4 * k + 4])


def test_unpack_slices_replicated_pieces_into_the_sampler_layout_without_a_collective():
  devices = jax.devices()[:4]
  flat_mesh = Mesh(np.array(devices), ("local",))
  sampler = Mesh(np.array(devices).reshape(2, 2), ("replica", "tensor"))  # sampler_tensor=2
  a = np.arange(24, dtype=np.float32).reshape(4, 6)
  b = -np.arange(8, dtype=np.float32)
  flat = np.concatenate([a.reshape(-1), b])  # one packed wire of two arrays, 32 elements
  pieces = transfer.spread(jax.device_put(flat, NamedSharding(flat_mesh, P("local"))), flat_mesh)
  targets = (NamedSharding(sampler, P(None, "tensor")), NamedSharding(sampler, P()))
  unpack = transfer._unpacker((((4, 6), (8,)),), targets)
  got_a, got_b = unpack((pieces,))
  np.testing.assert_array_equal(np.asarray(got_a), a)
  np.testing.assert_array_equal(np.asarray(got_b), b)
  assert got_a.sharding == targets[0] and got_b.sharding == targets[1]
  hlo = unpack.lower((pieces,)).compile().as_text()
  assert not [c for c in COLLECTIVES if c in hlo], hlo
