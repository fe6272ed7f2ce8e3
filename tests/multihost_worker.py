"""One process of the 2-process test (tests/test_multihost.py launches two of these).

Reads JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, runs a few async RL steps
through the trainer's own functions on the per-host meshes, then checks that this process's sampler
holds exactly the learner's (all-gathered) weights, and prints lines the test compares:
  LOSSES <json>      losses of every step (must match across processes: one global train step)
  EVAL <json>        combined held-out accuracy (must match across processes)
  SYNC_OK <n> ...    every synced array equals the learner's full value and lives on local devices
  CKPT_OK <step>     a multi-process orbax save + restore round trip (both data-stream positions kept)
"""

import json
import pathlib
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from tunixlike import checkpoint as checkpoint_lib, config as config_lib, rewards
from tunixlike.rl import build, trainer, weight_sync
from tunixlike.rl.prompts import PromptStream

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def main(num_steps: int, workdir: str):
  cfg = config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_grpo.py", "size=tiny"))
  cfg = config_lib.replace(
      cfg, data=dict(digits=2, num_eval_examples=8), warm_start=dict(max_steps=0),
      log=dict(progress_bar=False, tensorboard=False), sampler=dict(max_concurrent_decodes=16),
      mesh=dict(sampler_devices=4, learner_devices=4),
      rl=dict(num_steps=num_steps, prompts_per_step=4, max_staleness=1, wait_timeout_s=60.0))
  setup = build.build(cfg)  # initializes jax.distributed from the JAX_* environment variables
  assert jax.process_count() == 2, jax.process_count()
  me = jax.process_index()
  print(f"PROCESS {me} sampler {dict(setup.meshes.sampler.shape)} learner {dict(setup.meshes.learner.shape)}",
        flush=True)
  # Rewards with variance: weights move.
  rl = build.build_rl(setup, reward=rewards.CombinedReward(["stopped"], timeout_s=cfg.rl.reward_timeout_s))
  initial = multihost_utils.process_allgather(rl.policy.full_params(), tiled=True)
  losses = []
  stream = PromptStream(setup.train_pipe)
  runtime = build.make_runtime(setup, rl, stream)
  runtime.hooks.add(lambda info: losses.append((info.step, info.metrics["loss"], info.metrics["grad_norm"])))
  runtime.run()
  print("LOSSES " + json.dumps(losses), flush=True)
  assert rl.policy.version == num_steps, rl.policy.version

  # The last sync happened after the last step: the sampler's arrays must equal the learner's.
  synced = rl.policy.synced_params
  learner = multihost_utils.process_allgather(rl.policy.full_params(), tiled=True)
  local_sampler = set(setup.meshes.sampler.devices.flat)
  assert all(d.process_index == me for d in local_sampler)
  n = changed = 0
  for a, b, c in zip(jax.tree.leaves(synced), jax.tree.leaves(learner), jax.tree.leaves(initial)):
    assert a.is_fully_addressable and set(a.devices()) <= local_sampler, a.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    n += 1
    changed += not np.array_equal(np.asarray(a), c)
  assert changed > 0, "the learner's weights never changed: a sync of stale weights would pass unnoticed"
  # The same path with small buckets (several all-gathers, each freed before the next) and a cast.
  small, _ = weight_sync.sync(rl.policy.full_params(), rl.engine.param_shardings, dtype="bfloat16",
                              bucket_bytes=8192)
  for a, b in zip(jax.tree.leaves(small), jax.tree.leaves(learner)):
    assert a.dtype == jax.numpy.bfloat16 and set(a.devices()) <= local_sampler
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(jax.numpy.bfloat16))
  print(f"SYNC_OK {n} arrays equal the learner's, {changed} changed since the start", flush=True)

  out = build.evaluate(setup, rl)  # each process evaluates its shard; the accuracy is combined
  print("EVAL " + json.dumps({k: out[k] for k in ("eval/accuracy", "eval/num_prompts")}), flush=True)

  # Orbax saves the global learner state from both processes; the meta keeps each host's stream.
  ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.workdir_checkpoints(workdir),
                                     checkpoint_lib.CheckpointSchedule.from_config(cfg, keep=1))
  meta = trainer.checkpoint_meta(setup, rl, stream, {"groups_trained": 0})
  ckpt.save(rl.policy.version, rl.policy.state, meta, force=True)
  ckpt.wait()
  state, meta = ckpt.restore(abstract_state=checkpoint_lib.abstract_like(rl.policy.state))
  ckpt.close()
  assert len(meta["streams"]) == 2 and meta["streams"][me] == stream.state(), (meta["streams"], stream.state())
  restored = multihost_utils.process_allgather(state.params, tiled=True)
  live = multihost_utils.process_allgather(rl.policy.state.params, tiled=True)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(live)):
    np.testing.assert_array_equal(a, b)
  print(f"CKPT_OK {meta['version']}", flush=True)
  print("DONE", flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2])
