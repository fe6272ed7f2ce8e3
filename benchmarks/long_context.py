"""Long-context training: peak memory and step time of one learner step per row length, per attention kernel.

  python benchmarks/long_context.py [--lengths 2048,4096,8192,16384,32768] [--reference-max 4096]
      [--cp-lengths 65536] [--cp-devices 4] [--cp-schemes ring,all_gather] [--cp-layouts zigzag,contiguous]
      [--balance-lengths 8192] [--steps 2] [--run-max T]
      [--out FILE] [--quick]

Prints one JSON object (`harness.report`; also written to --out). Each measurement
runs in a fresh subprocess on one CPU device, so its peak resident memory (`ru_maxrss`) is its own:
the real `Learner.train_step` (GRPO ppo_clip loss, token-level TIS, AdamW, chunked log-probs) on
ONE row of T tokens (a 32-token prompt, the rest completion) of the 4M-parameter bench model
(4 layers, hidden 256, 4 heads, 2 KV heads of 64, vocab 512, fp32, as in learner_step.py).
`model.attention` is forced per run: `reference` (today's [B, H, T, T] attention, run up to
--reference-max: 8K needs ~20 GB) and `blockwise` (attention.py's flash kernel) at every length.
`--cp-lengths`: the same step with `optim.context_parallel` on --cp-devices CPU devices, the row's
tokens split over them, once per `model.context_parallel_attention` scheme of --cp-schemes and
`model.context_parallel_layout` of --cp-layouts (`models/context_parallel.py`; attention
`ring_zigzag_N`, `all_gather_contiguous_N`, ...): side by side, the peak RSS of the process (all N
devices: they share the host's memory), XLA's per-device account of the step (`compiled_gb`, also
for the runs that run), which is what one accelerator would hold, and per layout the causal
attention's (query block, key block) pairs per device (`block_pairs_per_device`: the work balance;
on an accelerator per device the ring's step waits for the busiest device, where N virtual CPU
devices share the host's cores and the step time follows the total).
`--balance-lengths`: per layout, each device's share of a T-token row's ring attention measured on
its own, one device after another on one CPU device: the forward and backward of all its N ring
steps (`context_parallel.fold_runs` / `grads_runs`, the ring's own pieces, at that device's block
offsets; the bench model's 4 heads, 2 KV heads of 64, fp32, one layer), best of --steps + 1 runs:
what N parallel devices would each take, and the busiest one's time (the ring's) per layout.
`step_s` is the best of --steps timed steps (at most one above 4K; --steps 0: the first step,
compilation included) after a first step that compiles (`first_step_s`). Rows longer than --run-max are compiled
but not run (`compile_only`): `compiled_gb` is XLA's memory account of the step (arguments, outputs,
temporaries, per device; `compiled_gb_all_devices` sums them over the devices) where running it
would take too long on a shared machine.

Targets (issue 41): blockwise peak memory 4K -> 32K grows <= 10x; 32K within 16 GB; blockwise step
time at 2K <= 1.1x the reference's (`auto` runs the reference up to attention.REFERENCE_MAX_LEN on
CPU, so the default is today's speed there). The machine may be shared: the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import harness  # benchmarks/harness.py: the shared flags, devices and JSON report
import learner_timing

BENCH_MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=64, qkv_bias=True)
PROMPT_LEN = 32


def bench_model(quick: bool) -> dict:
  """BENCH_MODEL; --quick: one layer (they are unrolled: compiling the step is most of a smoke run, per layer)."""
  return dict(BENCH_MODEL, num_layers=1) if quick else BENCH_MODEL


def _flags(p):
  p.add_argument("--lengths", default="2048,4096,8192,16384,32768", help="row lengths T (comma-separated)")
  p.add_argument("--reference-max", type=int, default=4096, help="longest T the reference attention runs at")
  p.add_argument("--cp-lengths", default="", help="row lengths run with context parallelism (comma-separated)")
  p.add_argument("--cp-devices", type=int, default=4, help="devices a --cp-lengths row is split over")
  p.add_argument("--cp-schemes", default="ring,all_gather", help="model.context_parallel_attention values to run")
  p.add_argument("--cp-layouts", default="zigzag", help="model.context_parallel_layout values to run")
  p.add_argument("--balance-lengths", default="", help="row lengths whose ring attention is timed per device, "
                 "for every layout (comma-separated)")
  p.add_argument("--steps", type=int, default=3, help="timed steps per run up to 4K (the best is reported)")
  p.add_argument("--run-max", type=int, default=None,
                 help="longer rows are compiled, not run: XLA's memory account of the step instead of a measurement")
  p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # impl:T, run in a child process


def _parse(argv=None):
  return harness.parse(__doc__, _flags, argv, quick="short rows, one layer")


def _compiled_gb(learner, state, batch) -> dict:
  """XLA's memory account of the compiled step, GiB per device (arguments, outputs, temporaries)."""
  import jax
  mem = learner._step.lower(state, batch, jax.random.key(0)).compile().memory_analysis()
  return {k: getattr(mem, f"{k}_size_in_bytes") / 2**30 for k in ("argument", "output", "temp")}


def run_one(impl: str, t: int, steps: int, compile_only: bool = False, quick: bool = False) -> dict:
  """One learner step on one row of T tokens with `impl` attention (`SCHEME_LAYOUT_N`, e.g.
  `ring_zigzag_4`: context parallelism over N devices with that scheme and layout), in this (fresh) process."""
  import jax
  import numpy as np
  from jax.sharding import Mesh

  from tunixlike import mesh as mesh_lib, models
  from tunixlike.learner import AlgoConfig, Learner, LearnerConfig, OptimConfig
  from tunixlike.models.config import CONTEXT_PARALLEL_SCHEMES

  rest, _, n = impl.rpartition("_")
  scheme, _, layout = rest.rpartition("_")
  devices = int(n) if scheme in CONTEXT_PARALLEL_SCHEMES else 1
  cfg = models.ModelConfig(**bench_model(quick), max_position_embeddings=max(t, 512),
                           attention="blockwise" if devices > 1 else impl,
                           **({"context_parallel_attention": scheme, "context_parallel_layout": layout}
                              if devices > 1 else {}))
  lcfg = LearnerConfig(algo=AlgoConfig(loss="ppo_clip", is_mode="tis"),
                       optim=OptimConfig(learning_rate=1e-5, context_parallel=devices > 1), logprob_chunk_size=128)
  if devices > 1:
    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(devices, 1), mesh_lib.LEARNER_AXES)
    model = models.create_sharded(cfg, mesh, mesh_lib.LEARNER_RULES, seed=0)
    learner = Learner(model, lcfg, mesh, mesh_lib.LEARNER_RULES)
  else:
    learner = Learner(models.Transformer(cfg, rngs=__import__("flax").nnx.Rngs(0)), lcfg)
  batch = learner.put_batch(learner_timing.synthetic_batch(np.random.default_rng(0), cfg.vocab_size, 1, t, PROMPT_LEN))
  state = learner.state
  mem = {}
  if compile_only or devices > 1:  # XLA's own account of the step's memory (per device)
    per_device = _compiled_gb(learner, state, batch)
    mem = {"devices": devices, "compiled_gb": per_device, "compiled_gb_all_devices": sum(per_device.values()) * devices}
  if compile_only:
    return {"attention": impl, "length": t, "compile_only": True, **mem,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
  _, first, times, metrics = learner_timing.timed_steps(learner, batch, steps)
  times = times or [first]  # --steps 0: the first step (compilation included) only
  return {"attention": impl, "length": t, "step_s": min(times), "step_s_all": times, "first_step_s": first,
          "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, **mem,
          "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}


def _child(impl: str, t: int, steps: int, compile_only: bool = False, devices: int = 1, quick: bool = False) -> dict:
  env = harness.device_env(devices)
  cmd = [sys.executable, __file__, "--one", f"{impl}:{t}", "--steps", str(steps)] + (
      ["--compile-only"] if compile_only else []) + (["--quick"] if quick else [])
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
  if proc.returncode:
    lines = [line for line in proc.stderr.strip().splitlines() if not line.lstrip().startswith("@")]
    return {"attention": impl, "length": t, "error": lines[-1:]}  # the message, not a native stack frame
  return json.loads(proc.stdout.strip().splitlines()[-1])


def ring_work(layout: str, t: int, n: int, repeats: int) -> dict:
  """Seconds of each of n devices' ring attention (forward + backward, every ring step) over a causal
  T-token row in `layout`, each device's work run alone on this process's first device."""
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np

  from tunixlike.models import attention, context_parallel as cp
  block, tp = cp.padded_length(t, n, layout)
  row_runs = cp.runs(layout, n)
  h, kv, d = BENCH_MODEL["num_heads"], BENCH_MODEL["num_kv_heads"], BENCH_MODEL["head_dim"]
  r = np.random.default_rng(0)
  q, k, v = (jnp.asarray(r.normal(size=(1, tp // n, x, d)), jnp.float32) for x in (h, kv, kv))
  st = attention.static_args(q, k, block, None, False)
  q, k, v, seg, pre, _ = attention.to_blocks(st, q, k, v)
  nc = q.shape[0]

  @jax.jit
  def device(q, k, v, seg, pre, me):  # the keys' values do not change the work: causality is in the block offsets
    offs = lambda s: cp.run_offsets(row_runs, (me - s) % n, nc)
    state = attention.softmax_init(q)
    for s in range(n):
      state = cp.fold_runs(st, q, k, v, seg, pre, seg, cp.run_offsets(row_runs, me, nc), offs(s), state)
    o, lse = attention.softmax_finish(state, q.dtype)
    delta, dq, dk = attention.output_delta(o, o), jnp.zeros(q.shape, jnp.float32), 0.0
    for s in range(n):
      dq, dk_s, _ = cp.grads_runs(st, q, k, v, seg, pre, seg, cp.run_offsets(row_runs, me, nc), offs(s), o, lse,
                                  delta, dq)
      dk = dk + dk_s
    return o, dq, dk

  seconds = []
  for me in range(n):
    args = (q, k, v, seg, pre, jnp.int32(me))
    jax.block_until_ready(device(*args))  # compiled once (me is traced), warm
    best = float("inf")
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(device(*args))
      best = min(best, time.perf_counter() - start)
    seconds.append(best)
  pairs = cp.causal_block_pairs(layout, n, nc // len(row_runs[0]))
  return {"seconds": seconds, "busiest_s": max(seconds), "busiest_to_mean": max(seconds) * n / sum(seconds),
          "block_pairs": pairs}


def _side_by_side(out: dict, a: str, b: str, t: int, by: dict, compiled: dict) -> None:
  """out[f"{a}_vs_{b}_{t}"]: two context-parallel runs of the same row, where both ran or compiled:
  per-device temporaries, peak RSS, step time and loss."""
  ca, cb = compiled.get((a, t)), compiled.get((b, t))
  if not (ca and cb):
    return
  side = {"temp_gb_per_device": {a: ca["temp"], b: cb["temp"]}, "temp_ratio": ca["temp"] / cb["temp"]}
  ra, rb = by.get((a, t)), by.get((b, t))
  if ra and rb:
    side.update(peak_rss_gb={a: ra["peak_rss_gb"], b: rb["peak_rss_gb"]}, step_s={a: ra["step_s"], b: rb["step_s"]},
                step_time_ratio=ra["step_s"] / rb["step_s"], loss_abs_diff=abs(ra["loss"] - rb["loss"]))
  out[f"{a}_vs_{b}_{t}"] = side


def main(argv=None):
  args = _parse(argv)
  if args.one:
    impl, t = args.one.split(":")
    print(json.dumps(run_one(impl, int(t), args.steps, args.compile_only, args.quick)))
    return
  lengths = [128, 256] if args.quick else [int(x) for x in args.lengths.split(",") if x]
  cp_lengths = [128] if args.quick else [int(x) for x in args.cp_lengths.split(",") if x]
  ref_max = 128 if args.quick else args.reference_max
  steps = 1 if args.quick else args.steps
  runs = []
  for t in lengths:
    for impl in ("reference", "blockwise"):
      if impl == "reference" and t > ref_max:
        continue
      compile_only = args.run_max is not None and t > args.run_max
      runs.append(_child(impl, t, steps if t <= 4096 else min(steps, 1), compile_only,  # a 32K step takes minutes here
                         quick=args.quick))
      print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
  n = args.cp_devices
  schemes = [s for s in args.cp_schemes.split(",") if s]
  layouts = [s for s in args.cp_layouts.split(",") if s]
  cp = [(scheme, layout, f"{scheme}_{layout}_{n}") for layout in layouts for scheme in schemes]
  for t in cp_lengths:
    compile_only = args.run_max is not None and t > args.run_max
    for _, _, impl in cp:
      runs.append(_child(impl, t, steps if t <= 4096 else min(steps, 1), compile_only, n, args.quick))
      print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
  by = {(r["attention"], r["length"]): r for r in runs if "error" not in r and not r.get("compile_only")}
  compiled = {(r["attention"], r["length"]): r["compiled_gb"] for r in runs if "compiled_gb" in r}
  out = {"benchmark": "long_context", "devices": 1, "context_parallel_devices": n, "model": bench_model(args.quick),
         "loss": "ppo_clip + token TIS, one row", "runs": runs}
  blk = {t: by[("blockwise", t)] for t in lengths if ("blockwise", t) in by}
  if len(blk) >= 2:
    lo, hi = min(blk), max(blk)
    out[f"blockwise_memory_growth_{lo}_to_{hi}"] = blk[hi]["peak_rss_gb"] / blk[lo]["peak_rss_gb"]
    if 4096 in blk and 32768 in blk:
      out["memory_growth_4k_to_32k"] = blk[32768]["peak_rss_gb"] / blk[4096]["peak_rss_gb"]
      out["memory_growth_target_met"] = out["memory_growth_4k_to_32k"] <= 10
      out["peak_rss_gb_32k"] = blk[32768]["peak_rss_gb"]
      out["fits_16gb_at_32k"] = blk[32768]["peak_rss_gb"] <= 16
  from tunixlike.models import context_parallel
  for t in cp_lengths:  # issue 41's target: a 64K-token row over 4 devices within 24 GB
    for layout in layouts:  # the causal work per device: what the layout balances
      block, tp = context_parallel.padded_length(t, n, layout)
      runs_per_device = len(context_parallel.runs(layout, n)[0])
      pairs = context_parallel.causal_block_pairs(layout, n, tp // (block * runs_per_device * n))
      out[f"block_pairs_per_device_{layout}_{n}_{t}"] = {"pairs": pairs, "busiest_to_mean": max(pairs) * n / sum(pairs)}
    for _, _, impl in cp:
      r = by.get((impl, t))
      if r is not None:
        out[f"{impl}_{t}"] = {"peak_rss_gb": r["peak_rss_gb"], "within_24gb": r["peak_rss_gb"] <= 24,
                              "step_s": r["step_s"]}
        if ("blockwise", t) in by:  # the same step on one device: the same loss
          out[f"{impl}_{t}"]["loss_abs_diff"] = abs(r["loss"] - by[("blockwise", t)]["loss"])
    for a, b in ((f"ring_{layouts[0]}_{n}", f"all_gather_{layouts[0]}_{n}"),
                 (f"ring_zigzag_{n}", f"ring_contiguous_{n}")):
      _side_by_side(out, a, b, t, by, compiled)
  for t in ([512] if args.quick else [int(x) for x in args.balance_lengths.split(",") if x]):
    work = {layout: ring_work(layout, t, n, steps + 1) for layout in context_parallel.LAYOUTS}
    for layout, w in work.items():
      out[f"ring_work_per_device_{layout}_{n}_{t}"] = w
    out[f"ring_busiest_device_zigzag_to_contiguous_{n}_{t}"] = work["zigzag"]["busiest_s"] / work["contiguous"]["busiest_s"]
  for t in lengths:
    if ("reference", t) in by and t in blk:
      ref = by[("reference", t)]
      out[f"blockwise_vs_reference_{t}"] = {"step_time_ratio": blk[t]["step_s"] / ref["step_s"],
                                           "memory_ratio": blk[t]["peak_rss_gb"] / ref["peak_rss_gb"],
                                           "loss_abs_diff": abs(blk[t]["loss"] - ref["loss"])}
  harness.report(out, args)


if __name__ == "__main__":
  main()
