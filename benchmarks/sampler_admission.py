"""The sampler's cost per RL step of the main job, and how much of it is admission (prefill + insert).

  python benchmarks/sampler_admission.py [--rl-steps 20] [--repeats 3] [--lengths answer] [--out FILE] [--quick]

Prints one JSON object. The workload is the main job's sampler (configs/addition_grpo.py): its model
(random weights: no checkpoint is needed) and Engine on a 4-device sampler mesh of 8 virtual CPU
devices, 128 slots, 32 prompts x 8 samples per RL step, max_new_tokens 8, steps_per_call 4, the
task's prompts. A `RolloutDriver` samples `--rl-steps` steps' prompts alone (no learner), after
`Engine.warmup` (timed: `warmup_s`, `programs_compiled_by_warmup`) and an untimed run, so its wall
time is the sampler's busy time; `programs_compiled_after_warmup` counts compilations after the warm-up.
`--lengths answer` caps each prompt's completions at its answer's length + 1 (digits and EOS: what a
trained model writes, 3-4 tokens, so groups end and slots free at different times); `model` lets the
untrained model run (almost always to 8 tokens).

Figures per RL step: `wall_ms` (median over `--repeats` runs), `prefill_calls` and `insert_calls`
(program calls, counted on the Engine's jitted functions), `generate_calls`. `blocking` repeats one
run with every program call waited for, so each call's whole cost lands on it: ms per RL step in
prefill, insert and generate calls. Only the driver's public API is used, so the script also runs
against an earlier checkout (PYTHONPATH=that checkout) for a before/after comparison.
"""

from __future__ import annotations

import os
import statistics
import time

import harness


def _flags(p):
  p.add_argument("--rl-steps", type=int, default=20, help="RL steps' worth of prompts per timed run")
  p.add_argument("--repeats", type=int, default=3, help="timed runs (the median is reported)")
  p.add_argument("--lengths", choices=("answer", "model"), default="answer")


ARGS = harness.parse(__doc__, _flags, quick="2 RL steps, 1 repeat, a one-layer model",
                     seed="config.seed (the model's weights)")
harness.host_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tunixlike import config as config_lib  # noqa: E402
from tunixlike import mesh as mesh_lib  # noqa: E402
from tunixlike.rl import build  # noqa: E402
from tunixlike.sampler import Engine, PromptRequest, RolloutDriver  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "addition_grpo.py")
# The Engine's jitted programs, by kind (names from this and earlier versions; absent ones are skipped).
PROGRAMS = {"prefill": ("_prefill_fn",), "insert": ("_insert_fn",), "generate": ("_generate_fn",)}
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"  # jax.monitoring: one per trace of a function


class CallCounter:
  """Wraps the engine's jitted programs: counts calls and host time per kind (optionally waiting for each)."""

  def __init__(self, engine):
    self.calls = {kind: 0 for kind in PROGRAMS}
    self.seconds = {kind: 0.0 for kind in PROGRAMS}
    self.block = False
    for kind, names in PROGRAMS.items():
      for name in names:
        if hasattr(engine, name):
          setattr(engine, name, self._wrap(kind, getattr(engine, name)))

  def _wrap(self, kind, fn):
    def call(*args, **kwargs):
      t0 = time.perf_counter()
      out = fn(*args, **kwargs)
      if self.block:
        jax.block_until_ready(out)
      self.calls[kind] += 1
      self.seconds[kind] += time.perf_counter() - t0
      return out
    return call

  def reset(self):
    self.calls = dict.fromkeys(self.calls, 0)
    self.seconds = dict.fromkeys(self.seconds, 0.0)


def requests(task, tok, n: int, lengths: str) -> list[PromptRequest]:
  source = task.source("train", seed=0)
  out = []
  for i in range(n):
    record = source[i]
    cap = min(len(record["answer"]) + 1, 8) if lengths == "answer" else None
    out.append(PromptRequest(prompt_id=i, token_ids=np.asarray(tok.encode(record["prompt"]), np.int32),
                             max_new_tokens=cap))
  return out


def run(engine, params, reqs) -> tuple[float, RolloutDriver]:
  driver = RolloutDriver(engine, params, source=iter(reqs), sink=lambda g: None)
  t0 = time.perf_counter()
  driver.run(max_wall_s=1800)
  return time.perf_counter() - t0, driver


def main():
  a = ARGS
  rl_steps, repeats = (2, 1) if a.quick else (a.rl_steps, a.repeats)
  cfg = config_lib.replace(config_lib.from_config_dict(config_lib.load(CONFIG)), seed=a.seed)
  if a.quick:  # one layer: compiling every program at warm-up is most of a smoke run (the same calls are counted)
    cfg = config_lib.replace(cfg, model=dict(num_layers=1))
  tok, task = build.build_task(cfg)
  m = cfg.mesh
  meshes = mesh_lib.make_meshes(m.sampler_devices, m.learner_devices, m.sampler_tensor, m.learner_tensor, layout=m.layout)
  model = build.build_model(cfg, tok, meshes.learner)
  s_cfg = build.sampler_config(cfg, tok, decoders=1)  # one process decodes
  engine = Engine(model, s_cfg, mesh=meshes.sampler)
  params = engine.load_params()
  per_step = cfg.rl.prompts_per_step
  reqs = requests(task, tok, rl_steps * per_step, a.lengths)
  traced = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, secs, fun_name="", **kw: traced.append(fun_name) if event == TRACE_EVENT else None)
  t0 = time.perf_counter()
  engine.warmup(params)
  warmup_s = time.perf_counter() - t0
  compiled_by_warmup, traced[:] = len([f for f in traced if f.endswith("_impl")]), []
  counter = CallCounter(engine)
  run(engine, params, reqs)

  walls = []
  for _ in range(repeats):
    counter.reset()
    wall, driver = run(engine, params, reqs)
    walls.append(wall)
  calls = {k: v / rl_steps for k, v in counter.calls.items()}
  stats = driver.stats
  counter.reset()
  counter.block = True
  blocked_wall, _ = run(engine, params, reqs)
  result = dict(
      workload=dict(prompts_per_step=per_step, group_size=s_cfg.group_size, slots=s_cfg.max_concurrent_decodes,
                    max_new_tokens=s_cfg.max_new_tokens, steps_per_call=s_cfg.steps_per_call,
                    sampler_devices=len(meshes.sampler.devices.flat), lengths=a.lengths, rl_steps=rl_steps,
                    mean_completion_tokens=round(stats.tokens_generated / stats.completions, 2)),
      wall_ms_per_step=round(1e3 * statistics.median(walls) / rl_steps, 1),
      wall_ms_per_step_runs=[round(1e3 * w / rl_steps, 1) for w in walls],
      busy_ms_per_step=round(1e3 * stats.busy_time_s / rl_steps, 1),
      prefill_calls_per_step=calls["prefill"], insert_calls_per_step=calls["insert"],
      generate_calls_per_step=calls["generate"], prefills_per_step=stats.prefills / rl_steps,
      slot_occupancy=round(stats.slot_occupancy, 3),
      warmup_s=round(warmup_s, 2), programs_compiled_by_warmup=compiled_by_warmup,
      programs_compiled_after_warmup=len([f for f in traced if f.endswith("_impl")]),
      blocking=dict(wall_ms_per_step=round(1e3 * blocked_wall / rl_steps, 1),
                    **{f"{k}_ms_per_step": round(1e3 * v / rl_steps, 1) for k, v in counter.seconds.items()},
                    **{f"{k}_ms_per_call": round(1e3 * counter.seconds[k] / max(counter.calls[k], 1), 2)
                       for k in PROGRAMS}))
  harness.report(result, a)


if __name__ == "__main__":
  main()
