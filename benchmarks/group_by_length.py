"""Learner step on a long-tailed batch: padded to the longest row vs micro-batches grouped by length.

  python benchmarks/group_by_length.py [--devices 1] [--steps 8] [--groups 8] [--out FILE] [--quick]

Prints one JSON object. The model and batch are those of the long-tail workload of
benchmarks/async_vs_sync.py: the main job's model (2 layers, hidden 64), 32 rows of a 12-token prompt
plus a completion of geometric length (EOS probability 1/83 per token, mean about 84) cut at 320
tokens, padded to T = 336, with a real `Learner.train_step` (GRPO ppo_clip, TIS, AdamW) on a learner
mesh of `--devices` CPU devices (FSDP). Three settings, the same batches, in one run:
  padded:       one micro-batch of 32 rows x 336 positions;
  micro:        `optim.micro_batches=16` (2 rows each, every one at 336 positions; 8 micro-batches
                on 4 devices, so that each holds a row per device);
  grouped:      the same micro-batches with `optim.group_by_length=8` (`--groups`): rows sorted by
                length, each micro-batch run at the shortest of 42, 84, ..., 336 positions that holds it.
Each figure is the median step time over `--steps` batches after one compiling step; the losses of
the three settings on the first batch (from the compiling step's metrics) are reported to show they
train the same objective.
"""

from __future__ import annotations

import pathlib
import time

import harness


def _flags(p):
  p.add_argument("--devices", type=int, default=1, help="learner devices (FSDP)")
  p.add_argument("--steps", type=int, default=8, help="timed steps per setting (median reported)")
  p.add_argument("--groups", type=int, default=8, help="optim.group_by_length of the grouped setting (each "
                 "group is a branch of the compiled step: fewer compile faster)")


ARGS = harness.parse(__doc__, _flags, quick="short rows, 2 steps, one layer")
harness.host_devices(ARGS.devices + 1)  # one sampler device (unused) + the learner devices

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tunixlike import config as config_lib  # noqa: E402
from tunixlike.rl import build  # noqa: E402

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"

ROWS, PROMPT, EOS_P = 32, 12, 1 / 83
# At least one row per learner device in each micro-batch: 16 on 1 or 2 devices, 8 on 4.
MICRO = min(16, ROWS // ARGS.devices)
SETTINGS = {"padded": (1, 0), "micro": (MICRO, 0), "grouped": (MICRO, ARGS.groups)}


def long_tailed_batch(rng, max_new: int) -> dict[str, np.ndarray]:
  t = PROMPT + max_new
  ends = PROMPT + np.minimum(rng.geometric(EOS_P, size=ROWS), max_new)
  pos = np.arange(t)[None]
  mask = ((pos >= PROMPT) & (pos < ends[:, None])).astype(np.float32)
  return {"tokens": rng.integers(1, 80, (ROWS, t)).astype(np.int32), "loss_mask": mask,
          "behaviour_logprobs": np.where(mask > 0, -3.0, 0.0).astype(np.float32),
          "versions": np.zeros((ROWS, t), np.int32), "advantages": rng.normal(size=ROWS).astype(np.float32)}


def time_setting(micro: int, group: int, batches) -> dict:
  cfg = config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_grpo.py"))
  # The batches are synthetic: the run's prompts are never read. --quick reads 1,024 of them, not 50,000
  # (each formatted and length-checked when the run is built: about 4 CPU-s per setting), and has one layer
  # (unrolled: compiling each setting's step is most of a smoke run).
  data = dict(task="reverse", max_prompt_length=16, **(dict(train_size=1024) if ARGS.quick else {}))
  quick = dict(model=dict(num_layers=1)) if ARGS.quick else {}
  cfg = config_lib.replace(cfg, data=data, warm_start=dict(max_steps=0), **quick,
                           mesh=dict(sampler_devices=1, learner_devices=ARGS.devices),
                           optim=dict(micro_batches=micro, group_by_length=group, share_prompts=False))
  setup = build.build(cfg, say=lambda *a: None)
  learner = build.build_learner(cfg, setup.model, setup.meshes.learner)
  state, times = learner.state, []
  for i, b in enumerate([batches[0]] + batches):  # the first call compiles
    placed = learner.put_batch(b)
    t0 = time.perf_counter()
    state, metrics = learner.train_step(state, placed, jax.random.key(i))
    jax.block_until_ready(metrics)
    if i:
      times.append(time.perf_counter() - t0)
    else:  # the step's loss is taken before its update (no separate loss_and_grads program to compile)
      first_loss = float(metrics["loss"])
  return {"micro_batches": micro, "group_by_length": group, "median_ms": 1e3 * float(np.median(times)),
          "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times), "first_batch_loss": first_loss}


def main():
  max_new = 24 if ARGS.quick else 320
  steps = 2 if ARGS.quick else ARGS.steps
  rng = np.random.default_rng(ARGS.seed)
  batches = [long_tailed_batch(rng, max_new) for _ in range(steps)]
  settings = {name: time_setting(m, g, batches) for name, (m, g) in SETTINGS.items()}
  lengths = np.concatenate([b["loss_mask"].sum(1) for b in batches])
  ms = {k: v["median_ms"] for k, v in settings.items()}
  result = {
      "benchmark": "group_by_length", "quick": ARGS.quick, "learner_devices": ARGS.devices,
      "rows": ROWS, "seq_len": PROMPT + max_new,
      "completion_length": {"mean": float(lengths.mean()), "p50": float(np.median(lengths)), "max": int(lengths.max())},
      "padded_ms": ms["padded"], "micro_ms": ms["micro"], "grouped_ms": ms["grouped"],
      "grouped_vs_padded": ms["padded"] / ms["grouped"], "grouped_vs_micro": ms["micro"] / ms["grouped"],
      "settings": settings,
  }
  harness.report(result, ARGS)


if __name__ == "__main__":
  main()
