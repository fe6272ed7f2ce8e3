"""The sampler host's end of a weight transfer on one process: the buffers that arrived split over
its devices become the sampler's arrays by device-to-device copies and a program whose inputs are all
replicated, with no collective (on CPU with jax.distributed every collective goes through gloo over TCP)."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunixlike.hosts import transfer

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def test_unpack_cuts_the_split_buffers_into_the_sampler_layout_without_a_collective():
  devices = jax.devices()[:4]
  flat_mesh = Mesh(np.array(devices), ("local",))
  sampler = Mesh(np.array(devices).reshape(2, 2), ("replica", "tensor"))  # sampler_tensor=2
  a = np.arange(24, dtype=np.float32).reshape(4, 6)
  b = -np.arange(7, dtype=np.float32)
  c = np.arange(64, dtype=np.float32).reshape(16, 4)
  packed = np.concatenate([a.reshape(-1), b, np.zeros(1, np.float32)])  # two arrays, padded to 32 elements
  flats = [jax.device_put(x, NamedSharding(flat_mesh, P("local"))) for x in (packed, c.reshape(-1))]
  shapes = (((4, 6), (7,)), ((16, 4),))
  targets = (NamedSharding(sampler, P(None, "tensor")), NamedSharding(sampler, P()), NamedSharding(sampler, P()))
  stages = []
  got = transfer.unpack(flats, shapes, targets, flat_mesh, lap=lambda stage, arrays: stages.append(stage))
  assert stages == ["spread", "unpack"]
  for x, want, target in zip(got, (a, b, c), targets):
    assert x.sharding == target
    np.testing.assert_array_equal(np.asarray(x), want)
    for shard in x.addressable_shards:  # each device holds its own part of the exact values
      np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
  pieces = tuple(transfer._spread(x, flat_mesh) for x in flats)  # each piece whole on every device, in order
  for flat, wire in zip((packed, c.reshape(-1)), pieces):
    for k, piece in enumerate(wire):
      assert piece.sharding.is_fully_replicated and set(piece.devices()) == set(devices)
      np.testing.assert_array_equal(np.asarray(piece.addressable_shards[3].data), flat[8 * k:8 * k + 8] if
                                    flat.size == 32 else flat[16 * k:16 * k + 16])
  hlo = transfer._unpacker(shapes, targets).lower(pieces).compile().as_text()
  assert not [name for name in COLLECTIVES if name in hlo], hlo
