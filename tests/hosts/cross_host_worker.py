"""One process of tests/hosts/test_cross_host.py: learner hosts send, sampler hosts receive.

argv: sampler_hosts, sampler_tensor. Reads JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID. The learner
hosts run a jitted step over their FSDP mesh (the sampler hosts take no part), then send its result
to every sampler host: the full tree in small buckets, a LoRA-like tree (the sampler host asks for
it 2 s after the learner hosts sent it), a bf16 cast (with a profile of its stages), the full tree
through a relay (sampler host to sampler host); then a learner host waits for an acknowledgement
nobody gives. Prints lines the test reads:
  LAYOUT <line>     the start-up lines (one per host)
  GOT <what> <v>    a sampler host received exactly the expected values, version v, on its devices
  STAGES <names>    the stages this process timed in the profiled sync
  TIMEOUT <msg>     the HostTimeout's message
"""

import dataclasses
import os
import sys
import time

import numpy as np


def expected_full():
  rng = np.random.default_rng(0)
  tree = {"embed": rng.standard_normal((64, 16), np.float32),
          "mlp": {"up": rng.standard_normal((16, 32), np.float32),
                  "down": rng.standard_normal((32, 16), np.float32)},
          "count": np.arange(12, dtype=np.int32).reshape(3, 4),
          # large enough to travel alone (transfer.SMALL_BYTES, also cast to bf16): one split over the
          # sampler's tensor axis (it travels in that layout), one replicated whose size needs padding
          "big": rng.standard_normal((512, 1024), np.float32), "odd": rng.standard_normal((1025, 257), np.float32),
          # split by rows on both sides: with one learner host and sampler_tensor=4 its FSDP shards are
          # the sampler's parts already, sent without a copy (as long as nothing casts it)
          "rows": rng.standard_normal((1024, 512), np.float32)}
  step = lambda t: {k: (step(v) if isinstance(v, dict) else (v * 2 + 1 if v.dtype == np.float32 else v + 1))
                    for k, v in t.items()}
  return tree, step


def lora_like():
  return {f"layer{i}": {"a": np.full((16, 2), i, np.float32), "b": np.full((2, 16), -i, np.float32)}
          for i in range(6)}


def main(sampler_hosts: int, sampler_tensor: int):
  from tunixlike import distributed
  from tunixlike.hosts import kv, layout as layout_lib, rendezvous, transfer
  me = int(os.environ["JAX_PROCESS_ID"])
  assert rendezvous.initialize(distributed.DistributedConfig(timeout_s=20), rendezvous.Hello({}, 20))
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  layout = layout_lib.make_host_layout(sampler_hosts, sampler_tensor=sampler_tensor, learner_tensor=1)
  for line in layout.describe():
    print("LAYOUT " + line, flush=True)
  host_tree, step = expected_full()
  specs = {"embed": P(None, None), "mlp": {"up": P(None, "tensor"), "down": P("tensor", None)},
           "count": P(), "big": P(None, "tensor"), "odd": P(), "rows": P("tensor", None)}
  want = step(host_tree)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host_tree)
  sampler = layout.role() == layout_lib.SAMPLER
  if sampler:
    full, lora = abstract, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), lora_like())
  else:  # FSDP on the learner hosts only; a jitted step the sampler hosts never join
    fsdp = {"embed": P("fsdp"), "mlp": {"up": P("fsdp"), "down": P("fsdp")}, "count": P(), "big": P("fsdp"),
            "odd": P(), "rows": P("fsdp")}
    shardings = jax.tree.map(lambda s: NamedSharding(layout.learner, s), fsdp)
    params = jax.device_put(host_tree, shardings)
    full = jax.jit(step, out_shardings=shardings)(params)
    lora = jax.device_put(lora_like(), NamedSharding(layout.learner, P()))
  lora_specs = jax.tree.map(lambda _: P(), lora_like())

  def check(got, version, want, what, dtype=None):
    mesh = layout.samplers[me]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      assert g.sharding.mesh == mesh and g.is_fully_addressable, g.sharding
      w = np.asarray(w).astype(dtype) if dtype and w.dtype == np.float32 else w
      np.testing.assert_array_equal(np.asarray(g), w)
    print(f"GOT {what} {version}", flush=True)

  out, v = transfer.send_across_hosts(full, specs, layout=layout, version=1, bucket_bytes=4096, timeout_s=30)
  if sampler:
    check(out, v, want, "full")
  if sampler:  # a sampler host picks a sync up late (after a decode step): the sender waits for it
    time.sleep(2)
  out, v = transfer.send_across_hosts(lora, lora_specs, layout=layout, version=2, timeout_s=30)
  if sampler:
    check(out, v, lora_like(), "lora")
  profile = {}
  out, v = transfer.send_across_hosts(full, specs, layout=layout, version=3, dtype="bfloat16", timeout_s=30,
                                      profile=profile)
  if sampler:
    check(out, v, want, "bf16", dtype=jax.numpy.bfloat16)
  print(f"STAGES {' '.join(sorted(k for k, t in profile.items() if t >= 0))}", flush=True)
  # A relay: the first sampler host gets the weights from its learner host, each next one from the
  # sampler host before it.
  chain = {s: (layout.senders[s] if k == 0 else layout.sampler_hosts[k - 1])
           for k, s in enumerate(layout.sampler_hosts)}
  relay = dataclasses.replace(layout, senders=chain)
  out, v = transfer.send_across_hosts(full, specs, layout=relay, version=4, bucket_bytes=4096, timeout_s=30)
  if sampler:
    check(out, v, want, "relay")
  # Faults: nobody acknowledges version 5 (the sampler hosts skip it); the sender names its host.
  if not sampler:
    try:
      transfer.send_across_hosts(full, specs, layout=layout, version=5, timeout_s=3)
      if layout.receivers():
        raise AssertionError("a send without a receiver returned")
    except kv.HostTimeout as e:
      print(f"TIMEOUT {e}", flush=True)
  distributed_barrier = kv.client().wait_at_barrier
  distributed_barrier("tunixlike/test/end", 60_000)
  print("DONE", flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]))
