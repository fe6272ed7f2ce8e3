"""Learner memory for PPO: what lives on the device vs the host, and what host offload costs per step.

  python benchmarks/memory.py [--devices 2] [--out FILE] [--quick]
      [--steps 3] [--only none|reference|optimizer|critic|all]

Prints one JSON object (and writes it to --out). It builds the learner state that has every
offloadable component: a PPOLearner over a policy plus a separate, smaller critic model
(`value.PolicyWithCritic`) with a token-level KL penalty in the rewards (so a reference copy
exists), AdamW, on a learner mesh of --devices CPU devices ('fsdp'). For each setting (no offload;
offload of the reference, the optimizer state or the critic alone; all three) it runs the real
train step (`HostOffload.train_step`: prepare the batch with the critic + GAE, then the update with
the components streamed in and written back) and reports:

  * bytes of each component, and the bytes that stay in device memory vs host memory between steps
    (counted from the arrays' memory kinds: this is what offload frees on an accelerator);
  * bytes moved per step (each offloaded component in and out);
  * step time (median of --steps timed steps after a compiling warm-up step) and its ratio to no offload;
  * the loss of the last step, which must equal the no-offload loss (offload moves bytes, not numbers);
  * peak device memory from the backend's memory stats: None on CPU (no stats). On GPU/TPU the peak
    is cumulative over the process, so take per-setting peaks with one process per --only setting.

On CPU "device" and "host" memory are the same DRAM: the figures show the bookkeeping (which bytes
leave the device) and the cost of the extra copies, not a saving of accelerator memory, and the
copies are memcpy-speed rather than PCIe / ICI-speed. Only a GPU/TPU run shows the freed HBM and
whether XLA overlaps the host transfers with compute. The machine may be shared: the load average is
recorded.
"""

from __future__ import annotations

import statistics
import time

import harness


SETTINGS = {"none": (), "reference": ("reference",), "optimizer": ("optimizer",), "critic": ("critic",),
            "all": ("reference", "optimizer", "critic")}


def _flags(p):
  p.add_argument("--devices", type=int, default=2, help="learner devices (the 'fsdp' axis)")
  p.add_argument("--steps", type=int, default=3, help="timed steps per setting (after one warm-up step)")
  p.add_argument("--only", choices=sorted(SETTINGS), default=None, help="run one setting (per-setting peaks)")


ARGS = harness.parse(__doc__, _flags, quick="tiny models and batch, settings none and all")
harness.host_devices(ARGS.devices)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from tunixlike import config as config_lib, mesh as mesh_lib, models  # noqa: E402
from tunixlike.learner import batch as batch_lib, offload as offload_lib  # noqa: E402
from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig  # noqa: E402
from tunixlike.learner.group_advantages import AdvantageConfig  # noqa: E402
from tunixlike.learner.ppo import PPOLearner  # noqa: E402
from tunixlike.learner.value import PolicyWithCritic  # noqa: E402
from tunixlike.rollout import Completion, RolloutGroup  # noqa: E402

# Groups no reward stage scored get their advantages in assemble_batch: the run's algo keys at their defaults.
UNSCORED = AdvantageConfig.from_config(config_lib.Config())

# The largest pair that runs the five settings in a few minutes on a 2-core CPU:
# policy ~25M params (6 layers, d_model 512, ffn 1536, vocab 8192, tied), critic ~5M (4 layers, d_model 256).
POLICY = dict(vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=64,
              intermediate_size=1536)
CRITIC = dict(vocab_size=8192, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
              intermediate_size=768)
BATCH = dict(rows=8, prompt=32, completion=96)
if ARGS.quick:
  POLICY = dict(POLICY, vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                intermediate_size=128)
  CRITIC = dict(CRITIC, vocab_size=256, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                intermediate_size=64)
  BATCH = dict(rows=4, prompt=8, completion=8)


def host_batch(vocab: int) -> dict:
  """One PPO batch of real RolloutGroups (random tokens, 0/1 rewards) through `assemble_batch`."""
  rng = np.random.default_rng(ARGS.seed)
  groups = []
  for gi in range(BATCH["rows"] // 2):
    n = BATCH["completion"]
    comps = [Completion(rng.integers(1, vocab, n).astype(np.int32), np.full(n, -3.0, np.float32),
                        np.zeros(n, np.int32), "length") for _ in range(2)]
    groups.append(RolloutGroup(prompt_id=gi, prompt_token_ids=rng.integers(1, vocab, BATCH["prompt"]).astype(np.int32),
                               completions=comps, rewards=rng.integers(0, 2, 2).astype(np.float32)))
  t = BATCH["prompt"] + BATCH["completion"]
  return batch_lib.assemble_batch(groups, num_rows=BATCH["rows"], seq_buckets=(t,), sampling_mask=False, routing=False,
                                  unscored=UNSCORED)


def make_learner(mesh) -> PPOLearner:
  policy = models.create_sharded(models.ModelConfig(**POLICY), mesh, mesh_lib.LEARNER_RULES, seed=ARGS.seed)
  critic = models.create_sharded(models.ModelConfig(**CRITIC), mesh, mesh_lib.LEARNER_RULES, seed=ARGS.seed + 1)
  cfg = LearnerConfig(algo=AlgoConfig(kl_reward_coef=0.05), optim=OptimConfig(learning_rate=1e-4, weight_decay=0.01),
                      logprob_chunk_size=64)
  return PPOLearner(PolicyWithCritic.create(policy, critic, seed=0), cfg, mesh=mesh, rules=mesh_lib.LEARNER_RULES)


def where_bytes(state) -> dict[str, int]:
  """Bytes of `state` in device memory and in host memory (pinned_host arrays or numpy arrays)."""
  out = {"device": 0, "host": 0}
  for x in jax.tree.leaves(state):
    on_host = not isinstance(x, jax.Array) or x.sharding.memory_kind != "device"
    out["host" if on_host else "device"] += int(x.size * x.dtype.itemsize)
  return out


def run_setting(name: str, mesh, devices, placed_host) -> dict:
  learner = make_learner(mesh)
  components = SETTINGS[name]
  off = offload_lib.HostOffload(learner, components) if components else None
  state = off.offload(learner.state) if off else learner.state
  learner.state = None  # the offloaded state is the only copy
  step = off.train_step if off else learner.train_step
  placed = learner.put_batch(placed_host)
  times, metrics = [], None
  for i in range(1 + ARGS.steps):
    t0 = time.perf_counter()
    state, metrics = step(state, placed, jax.random.key(i))
    jax.block_until_ready((state, metrics))
    if i:  # step 0 compiles
      times.append(time.perf_counter() - t0)
  out = {"components": list(components), "memory_kind": off.memory_kind if off else None,
         "bytes_between_steps": where_bytes(state), "bytes_moved_per_step": off.bytes_per_step if off else 0,
         "step_s": statistics.median(times), "loss_last_step": float(metrics["loss"]),
         "peak_device_bytes": offload_lib.peak_device_memory(devices)}
  del state, learner, off
  return out


def main():
  devices = jax.devices()[:ARGS.devices]
  mesh = Mesh(np.array(devices).reshape(ARGS.devices, 1), ("fsdp", "tensor"))
  probe = make_learner(mesh)
  sizes = offload_lib.component_bytes(probe.state)
  n_params = {k: int(sum(x.size for x in jax.tree.leaves(probe.state.params[k]))) for k in ("policy", "critic")}
  del probe
  placed_host = host_batch(POLICY["vocab_size"])
  # --quick: no offload and all three (every component still moves), to keep the smoke test short
  names = [ARGS.only] if ARGS.only else (["none", "all"] if ARGS.quick else list(SETTINGS))
  results = {n: run_setting(n, mesh, devices, placed_host) for n in names}
  base = results.get("none")
  for r in results.values():
    if base:
      r["step_time_ratio"] = r["step_s"] / base["step_s"]
      r["loss_equal_to_no_offload"] = bool(abs(r["loss_last_step"] - base["loss_last_step"]) <= 1e-5 * max(1.0, abs(base["loss_last_step"])))
  report = {
      "benchmark": "memory", "devices": ARGS.devices,
      "model": {"policy": POLICY, "critic": CRITIC, "params": n_params, "dtype": "float32"},
      "batch": BATCH, "component_bytes": sizes, "settings": results,
      "peak_device_memory_reported": any(r["peak_device_bytes"] is not None for r in results.values()),
      "note": ("CPU: device and host memory are the same DRAM; bytes_between_steps shows what leaves the device, "
               "step_s the cost of the copies at memcpy speed. Freed HBM and transfer/compute overlap need a GPU/TPU run."),
  }
  harness.report(report, ARGS)


if __name__ == "__main__":
  main()
