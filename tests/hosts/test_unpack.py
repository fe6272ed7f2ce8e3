"""The sampler host's end of a weight transfer on one process: the buffers that arrived split over
its devices become the sampler's arrays by device-to-device copies and programs of one device, with
no collective (on CPU with jax.distributed every collective goes through gloo over TCP)."""

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
  assert stages == ["gather", "unpack", "place"]
  for x, want, target in zip(got, (a, b, c), targets):
    assert x.sharding == target
    np.testing.assert_array_equal(np.asarray(x), want)
    for shard in x.addressable_shards:  # each device holds its own part of the exact values
      np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
  # the two buffers are cut on two different devices (the larger first), each by a program of one device
  assert transfer._lanes([x.nbytes for x in flats], 4) == [1, 0]
  for flat, shape in zip(flats, shapes):
    piece = jax.ShapeDtypeStruct((flat.shape[0] // 4,), flat.dtype)
    hlo = transfer._cutter((shape,)).lower(((piece,) * 4,)).compile().as_text()
    assert not [name for name in COLLECTIVES if name in hlo], hlo


def test_lanes_balance_the_buffers_over_the_devices():
  assert transfer._lanes([4, 16, 16, 16, 16], 4) == [0, 0, 1, 2, 3]
  assert transfer._lanes([10, 1, 1, 1], 2) == [0, 1, 1, 1]
  assert transfer._lanes([5], 1) == [0]


def test_arrays_split_over_the_tensor_axis_alone_travel_in_the_samplers_layout():
  assert transfer._tensor_split((8, 16), P(None, "tensor"), 4)
  assert transfer._tensor_split((16, 8), P("tensor"), 4)
  assert not transfer._tensor_split((8, 16), P(None, "tensor"), 1)  # one device per tensor group: nothing split
  assert not transfer._tensor_split((8, 16), P(), 4)  # replicated
  assert not transfer._tensor_split((8, 18), P(None, "tensor"), 4)  # uneven parts
  assert not transfer._tensor_split((8, 16), P("replica", "tensor"), 2)  # split over the replicas too
  assert not transfer._tensor_split((8, 16), P(("replica", "tensor")), 2)


def test_a_learner_array_already_in_the_samplers_layout_is_sent_without_a_copy():
  devices = np.array(jax.devices()[:4])
  learner = Mesh(devices.reshape(4, 1), ("fsdp", "tensor"))
  tensor_view = Mesh(devices.reshape(1, 1, 4), ("hosts", "replica", "tensor"))  # one learner host, tensor 4
  x = jax.device_put(np.zeros((8, 16), np.float32), NamedSharding(learner, P("fsdp")))  # FSDP: by rows
  assert transfer._sendable_as_is(x, x.dtype, NamedSharding(tensor_view, P("tensor", None)))
  assert not transfer._sendable_as_is(x, x.dtype, NamedSharding(tensor_view, P(None, "tensor")))  # by columns
  assert not transfer._sendable_as_is(x, np.dtype("float16"), NamedSharding(tensor_view, P("tensor", None)))  # a cast
  two = Mesh(devices.reshape(1, 2, 2), ("hosts", "replica", "tensor"))  # tensor 2: the first group sends halves
  assert not transfer._sendable_as_is(x, x.dtype, NamedSharding(two, P("tensor", None)))


def test_a_whole_buffer_is_cut_into_the_sampler_layout_by_one_program_without_a_collective():
  # small arrays (LoRA adapters, norms) cross as one buffer whole on each device; each device slices
  # its own copy: a replicated array and one split over the sampler's tensor axis
  devices = jax.devices()[:4]
  flat_mesh = Mesh(np.array(devices), ("local",))
  sampler = Mesh(np.array(devices).reshape(2, 2), ("replica", "tensor"))
  a = np.arange(24, dtype=np.float32).reshape(4, 6)
  b = -np.arange(7, dtype=np.float32)
  whole = jax.device_put(np.concatenate([a.reshape(-1), b]), NamedSharding(flat_mesh, P()))
  targets = (NamedSharding(sampler, P(None, "tensor")), NamedSharding(sampler, P()))
  placer = transfer._placer((((4, 6), (7,)),), targets)
  for x, want, target in zip(placer((whole,)), (a, b), targets):
    assert x.sharding == target
    for shard in x.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
  hlo = placer.lower((whole,)).compile().as_text()
  assert not [name for name in COLLECTIVES if name in hlo], hlo
