"""Weight sync learner -> sampler: full vs the memcpy floor, full vs LoRA-only, and the alternatives.

  python benchmarks/weight_sync.py [--out FILE] [--quick]

Prints one JSON object (and writes it to --out). On 4 learner + 4 sampler devices it builds a model
born sharded on the learner submesh (LEARNER_RULES, fsdp) and times `tunixlike.rl.weight_sync.sync`
to the sampler shardings (SAMPLER_RULES), exactly as `WeightSync.sync` does, for two
sampler layouts:
  * `replicated`: sampler_tensor=1, the default config: every one of the 4 decode replicas holds a
    whole copy, so a sync must deliver 4x the model's bytes;
  * `tensor`: sampler_tensor=4: one copy split over the 4 sampler devices (model bytes delivered).
The floor is `np.copyto` of the same bytes into a preallocated buffer in the same run, both of the
model's bytes and of the bytes the sync delivers. LoRA-only sync (rank 8, all projections) moves
`adapter_params` only, as the runtime does (`WeightSync.sync`): packed into one
buffer on the learner, one transfer, kept packed on the sampler (`keep_packed=True`; the engine
splits it inside its own programs); `lora_sync_unpacked_ms` adds the separate unpack. The runtime
packs the adapters right behind the train step (`weight_sync.pack`, dispatched before the learner
waits for the step), so its sync is the transfer alone: `lora_sync_ms` times that, with the pack
dispatched behind the fresh copy that stands for the train step; `lora_sync_with_pack_ms` times
packing and transfer together (`full_vs_lora_with_pack`).
Alternatives to the library's one-call `device_put` are timed too, to say
which change to weight_sync.py would be fastest: per-leaf device_put, an explicit host round trip
(device_get + device_put), and a two-step reshard (jit all-gather on the learner devices into the
sampler's layout, then a same-layout device-to-device copy).

Every repetition syncs freshly computed learner arrays (a jitted copy, as after a train step): a jax
Array caches its host value, so re-syncing the same arrays would time a cache hit, not a transfer.
Figures are medians over repetitions after warm-up; the machine may be shared, so the load average
is recorded.
"""

from __future__ import annotations

import time

import harness


def _flags(p):
  p.add_argument("--repeats", type=int, default=9, help="timed repetitions per method (after warm-up)")
  p.add_argument("--warmup", type=int, default=2)


ARGS = harness.parse(__doc__, _flags, quick="tiny model and few repetitions")
harness.host_devices(8)  # 4 learner + 4 sampler devices

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

from tunixlike import config as config_lib, mesh as mesh_lib, models  # noqa: E402
from tunixlike.models import lora as lora_lib  # noqa: E402
from tunixlike.rl import weight_sync  # noqa: E402

# ~15.9M fp32 params = 63 MB: 4 layers, d_model 512, ffn 2048, vocab 256 (tied embeddings).
FULL = dict(vocab_size=256, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64,
            intermediate_size=2048)
QUICK = dict(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
             intermediate_size=512)
# ~63M fp32 params = 252 MB: the LoRA-vs-full ratio grows with the model (the adapters grow with
# the hidden size only, the full model with its square), so it is reported at both sizes.
LARGE = dict(vocab_size=256, hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=8, head_dim=64,
             intermediate_size=4096)
LORA_RANK = 8
LORA = lora_lib.LoRAConfig.from_config(config_lib.Config(), rank=LORA_RANK)  # the run's alpha and targets


def model_config(sizes) -> models.ModelConfig:
  return models.ModelConfig(**sizes, rope_theta=1e4, rms_norm_eps=1e-6, qkv_bias=False, qk_norm=False,
                            tie_embeddings=True, rope_scaling=None, param_dtype="float32", dtype="float32",
                            remat=False)


class Fresh:
  """Hands out new learner-side arrays each call (same values, same shardings, new buffers).

  `then(tree)`, if given, is dispatched right behind the copy, before waiting for it, as the learner
  dispatches `weight_sync.pack` right behind its train step; its result is handed out instead."""

  def __init__(self, tree, then=None):
    leaves, self.treedef = jax.tree.flatten(tree)
    self._copy = jax.jit(lambda xs: [x * 1 for x in xs], out_shardings=[x.sharding for x in leaves])
    self._leaves, self._then = leaves, then

  def __call__(self):
    self._leaves = self._copy(self._leaves)
    tree = jax.tree.unflatten(self.treedef, self._leaves)
    out = tree if self._then is None else self._then(tree)
    jax.block_until_ready((self._leaves, out))
    return out


def timed(fn, fresh, repeats: int, warmup: int) -> dict:
  """Median / min / max milliseconds of fn(fresh_tree), blocking on the result."""
  times = []
  for i in range(warmup + repeats):
    tree = fresh()
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(tree))
    dt = (time.perf_counter() - t0) * 1e3
    del out
    if i >= warmup:
      times.append(dt)
  return {"median_ms": float(np.median(times)), "min_ms": float(np.min(times)), "max_ms": float(np.max(times))}


def memcpy_ms(nbytes: int, repeats: int, warmup: int) -> float:
  src = np.random.default_rng(ARGS.seed).random(nbytes // 4, dtype=np.float32)
  dst = np.empty_like(src)
  times = []
  for i in range(warmup + repeats):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    if i >= warmup:
      times.append((time.perf_counter() - t0) * 1e3)
  return float(np.median(times))


def delivered_bytes(tree) -> int:
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)


def staging_shardings(flat_targets, learner_mesh: Mesh):
  """The sampler's layout on the learner devices: same mesh shape, axis names and specs."""
  sampler_mesh = flat_targets[0].mesh
  mesh = Mesh(np.array(list(learner_mesh.devices.flat)).reshape(sampler_mesh.devices.shape),
              sampler_mesh.axis_names)
  return [NamedSharding(mesh, s.spec) for s in flat_targets]


def check_equal(out, ref_tree, targets):
  for a, b, s in zip(jax.tree.leaves(out), jax.tree.leaves(ref_tree), jax.tree.leaves(targets)):
    assert a.sharding == s, (a.sharding, s)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def bench_layout(sampler_tensor: int, sizes, repeats: int, warmup: int) -> dict:
  meshes = mesh_lib.make_meshes(4, 4, sampler_tensor, 1, layout="split")
  model = models.create_sharded(model_config(sizes), meshes.learner, mesh_lib.LEARNER_RULES, seed=ARGS.seed)
  params = nnx.state(model, nnx.Param)
  targets = models.state_shardings(params, meshes.sampler, mesh_lib.SAMPLER_RULES)
  flat_targets = jax.tree.leaves(targets)
  model_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  fresh = Fresh(params)

  synced, _ = weight_sync.sync(fresh(), targets)
  check_equal(synced, params, targets)
  out_bytes = delivered_bytes(synced)
  del synced

  stage = staging_shardings(flat_targets, meshes.learner)
  regather = jax.jit(lambda xs: xs, out_shardings=stage)

  def two_step(tree):
    return jax.device_put(regather(jax.tree.leaves(tree)), flat_targets)

  check_equal(jax.tree.unflatten(jax.tree.structure(params), two_step(fresh())), params, targets)
  methods = {
      "library_sync": lambda t: weight_sync.sync(t, targets)[0],
      "per_leaf_device_put": lambda t: [jax.device_put(x, s) for x, s in zip(jax.tree.leaves(t), flat_targets)],
      "host_round_trip": lambda t: jax.device_put(jax.device_get(jax.tree.leaves(t)), flat_targets),
      "two_step_regather": two_step,
  }
  times = {name: timed(fn, fresh, repeats, warmup) for name, fn in methods.items()}
  # The library's own timer (what the runtime logs as sync/ms), on fresh arrays too.
  lib_ms = []
  for i in range(warmup + repeats):
    _, ms = weight_sync.sync(fresh(), targets)
    if i >= warmup:
      lib_ms.append(ms)
  mem_model = memcpy_ms(model_bytes, repeats, warmup)
  mem_out = memcpy_ms(out_bytes, repeats, warmup)
  full = times["library_sync"]["median_ms"]

  # LoRA-only: rank-8 adapters on every projection, synced to their sampler shardings.
  lora_lib.apply_lora(model, LORA, seed=ARGS.seed, mesh=meshes.learner,
                      rules=mesh_lib.LEARNER_RULES)
  adapters = lora_lib.adapter_params(model)
  lora_targets = models.state_shardings(adapters, meshes.sampler, mesh_lib.SAMPLER_RULES)
  lora_fresh = Fresh(adapters)
  lora, lora_with_pack = lora_sync_times(adapters, lora_targets, repeats, warmup)
  lora_unpacked = timed(lambda t: weight_sync.sync(t, lora_targets)[0], lora_fresh, repeats, warmup)
  lora_bytes = sum(x.nbytes for x in jax.tree.leaves(adapters))
  return {
      "sampler_mesh": dict(meshes.sampler.shape), "learner_mesh": dict(meshes.learner.shape),
      "num_params": int(n_params), "model_bytes": int(model_bytes), "delivered_bytes": int(out_bytes),
      "num_leaves": len(flat_targets),
      "full_sync_ms": full, "full_sync_ms_library_timer": float(np.median(lib_ms)),
      "memcpy_model_bytes_ms": mem_model, "memcpy_delivered_bytes_ms": mem_out,
      "full_vs_memcpy_model_bytes": full / mem_model, "full_vs_memcpy_delivered_bytes": full / mem_out,
      "sync_GBps_delivered": out_bytes / full / 1e6, "memcpy_GBps": model_bytes / mem_model / 1e6,
      "lora_rank": LORA_RANK, "lora_bytes": int(lora_bytes), "lora_sync_ms": lora["median_ms"],
      "full_vs_lora": full / lora["median_ms"],
      "lora_sync_with_pack_ms": lora_with_pack["median_ms"], "full_vs_lora_with_pack": full / lora_with_pack["median_ms"],
      # The same sync split back into arrays on the sampler (a third dispatch the runtime skips).
      "lora_sync_unpacked_ms": lora_unpacked["median_ms"],
      "methods_ms": times,
  }


def lora_vs_full(sizes, repeats: int, warmup: int) -> dict:
  """Full vs LoRA-only (rank 8) sync of one model, default sampler layout (4 replicas)."""
  meshes = mesh_lib.make_meshes(4, 4, 1, 1, layout="split")
  model = models.create_sharded(model_config(sizes), meshes.learner, mesh_lib.LEARNER_RULES, seed=ARGS.seed)
  params = nnx.state(model, nnx.Param)
  targets = models.state_shardings(params, meshes.sampler, mesh_lib.SAMPLER_RULES)
  full = timed(lambda t: weight_sync.sync(t, targets)[0], Fresh(params), repeats, warmup)["median_ms"]
  model_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  del params
  lora_lib.apply_lora(model, LORA, seed=ARGS.seed, mesh=meshes.learner,
                      rules=mesh_lib.LEARNER_RULES)
  adapters = lora_lib.adapter_params(model)
  lora_targets = models.state_shardings(adapters, meshes.sampler, mesh_lib.SAMPLER_RULES)
  lora, lora_with_pack = (t["median_ms"] for t in lora_sync_times(adapters, lora_targets, repeats, warmup))
  return {"model_mb": model_bytes / 2**20, "lora_mb": sum(x.nbytes for x in jax.tree.leaves(adapters)) / 2**20,
          "full_sync_ms": full, "lora_sync_ms": lora, "full_vs_lora": full / lora,
          "lora_sync_with_pack_ms": lora_with_pack, "full_vs_lora_with_pack": full / lora_with_pack}


def lora_sync_times(adapters, lora_targets, repeats: int, warmup: int) -> tuple[dict, dict]:
  """LoRA sync as the runtime does it (`Policy`: packed right behind the train step, then
  one transfer, kept packed on the sampler), and with the packing inside the timed sync."""
  prepacked = Fresh(adapters, then=lambda t: weight_sync.pack(t, lora_targets))
  runtime = timed(lambda p: weight_sync.sync(p, lora_targets, keep_packed=True)[0], prepacked, repeats, warmup)
  with_pack = timed(lambda t: weight_sync.sync(t, lora_targets, keep_packed=True)[0], Fresh(adapters), repeats,
                    warmup)
  return runtime, with_pack


def main():
  sizes = QUICK if ARGS.quick else FULL
  repeats, warmup = (3, 1) if ARGS.quick else (ARGS.repeats, ARGS.warmup)
  t0 = time.time()
  layouts = {"replicated": bench_layout(1, sizes, repeats, warmup), "tensor": bench_layout(4, sizes, repeats, warmup)}
  main_layout = layouts["replicated"]  # the default config's sampler layout
  larger = lora_vs_full(QUICK if ARGS.quick else LARGE, repeats, warmup)
  result = {
      "benchmark": "weight_sync", "devices": jax.device_count(), "model_sizes": sizes, "repeats": repeats, "warmup": warmup,
      "headline_layout": "replicated (default config: mesh.sampler_tensor=1, 4 decode replicas)",
      "full_sync_ms": main_layout["full_sync_ms"],
      # "The same bytes": what the sync physically writes (4 replicas) ...
      "memcpy_ms": main_layout["memcpy_delivered_bytes_ms"],
      "full_vs_memcpy": main_layout["full_vs_memcpy_delivered_bytes"],
      # ... and the strict reading: one copy of the model's bytes.
      "memcpy_model_bytes_ms": main_layout["memcpy_model_bytes_ms"],
      "full_vs_memcpy_model_bytes": main_layout["full_vs_memcpy_model_bytes"],
      "lora_sync_ms": main_layout["lora_sync_ms"], "full_vs_lora": main_layout["full_vs_lora"],
      # The packing timed inside the sync too (it is queued behind the train step in the runtime).
      "lora_sync_with_pack_ms": main_layout["lora_sync_with_pack_ms"],
      "full_vs_lora_with_pack": main_layout["full_vs_lora_with_pack"],
      "model_bytes": main_layout["model_bytes"], "delivered_bytes": main_layout["delivered_bytes"],
      "lora_bytes": main_layout["lora_bytes"], "num_params": main_layout["num_params"],
      # The same comparison on a 4x larger model: LoRA sync is a fixed cost of dispatches here.
      "full_vs_lora_larger_model": larger["full_vs_lora"], "larger_model": larger,
      "layouts": layouts,
      "wall_s": time.time() - t0,
  }
  harness.report(result, ARGS)


if __name__ == "__main__":
  main()
