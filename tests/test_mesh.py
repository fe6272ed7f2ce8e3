import jax
import pytest

from tunixlike import mesh as mesh_lib


def test_split_4_plus_4_with_axes():
  meshes = mesh_lib.make_meshes(4, 4, 2, 1, layout="split")
  assert meshes.sampler.axis_names == ("replica", "tensor")
  assert meshes.learner.axis_names == ("fsdp", "tensor")
  assert dict(meshes.sampler.shape) == {"replica": 2, "tensor": 2}
  assert dict(meshes.learner.shape) == {"fsdp": 4, "tensor": 1}
  s = set(meshes.sampler.devices.flat)
  l = set(meshes.learner.devices.flat)
  assert not s & l and len(s | l) == 8


def test_colocated_puts_both_submeshes_on_every_device_in_the_same_order():
  meshes = mesh_lib.make_meshes(4, 4, 2, 1, layout="colocated")
  assert dict(meshes.sampler.shape) == {"replica": 4, "tensor": 2}
  assert dict(meshes.learner.shape) == {"fsdp": 8, "tensor": 1}
  assert list(meshes.sampler.devices.flat) == list(meshes.learner.devices.flat) == jax.devices()
  assert meshes.colocated and not mesh_lib.make_meshes(4, 4, 1, 1, layout="split").colocated
  with pytest.raises(mesh_lib.MeshError, match="mesh.layout='shared' must be 'split' or 'colocated'"):
    mesh_lib.make_meshes(4, 4, 1, 1, layout="shared")
  # Colocated, only the total counts: 8 + 0 is every device (one accelerator is 1 + 0).
  whole = mesh_lib.make_meshes(8, 0, 1, 1, layout="colocated")
  assert list(whole.sampler.devices.flat) == list(whole.learner.devices.flat) == jax.devices()
  with pytest.raises(mesh_lib.MeshError, match="learner_devices=0 only with mesh.layout='colocated'"):
    mesh_lib.make_meshes(8, 0, 1, 1, layout="split")


def test_sizes_that_do_not_add_up_or_divide():
  with pytest.raises(mesh_lib.MeshError, match="= 7, but there are 8 devices"):
    mesh_lib.make_meshes(4, 3, 1, 1, layout="split")
  with pytest.raises(mesh_lib.MeshError, match="mesh.sampler_tensor=3"):
    mesh_lib.make_meshes(4, 4, 3, 1, layout="split")


def test_tensor_parallelism_must_give_each_device_whole_heads():
  mesh_lib.check_whole_heads(14, 2, sampler_tensor=2, learner_tensor=1)  # Qwen2.5-0.5B: 7 heads, 1 KV head each
  with pytest.raises(mesh_lib.MeshError, match=r"mesh.sampler_tensor=4 does not divide the model's 14 attention "
                                               r"heads and 2 KV heads.*one of \[1, 2\]"):
    mesh_lib.check_whole_heads(14, 2, sampler_tensor=4, learner_tensor=1)
  with pytest.raises(mesh_lib.MeshError, match="mesh.learner_tensor=3"):
    mesh_lib.check_whole_heads(8, 4, sampler_tensor=4, learner_tensor=3)


def test_a_parameter_its_mesh_axis_does_not_divide_names_the_mesh_keys():
  from tunixlike.models import sharding
  mesh = mesh_lib.make_meshes(4, 4, 2, 1, layout="split").sampler
  with pytest.raises(sharding.ShardingError, match=r"embed_tokens: dimension 'vocab' of size 83 does not divide "
                                                   r"mesh axis 'tensor' of size 2.*mesh.sampler_tensor"):
    sharding.partition_spec((83, 64), ("vocab", "embed"), mesh, mesh_lib.SAMPLER_RULES, what="embed_tokens")


def test_per_host_split_takes_first_local_devices_of_each_process():
  # Two fake "hosts" are not available in one process; check the single-process rule on a subset.
  devs = jax.devices()[:6]
  sampler, learner = mesh_lib.split_devices(2, 4, devs)
  assert sampler == devs[:2] and learner == devs[2:]


def test_logical_rules_map_to_mesh_axes():
  spec = mesh_lib.logical_to_mesh(("vocab", "embed"), mesh_lib.LEARNER_RULES)
  assert spec == jax.sharding.PartitionSpec("tensor", "fsdp")
  with pytest.raises(KeyError, match="no sharding rule"):
    mesh_lib.logical_to_mesh(("nonsense",), mesh_lib.LEARNER_RULES)
