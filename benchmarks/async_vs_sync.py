"""Async vs sync RL: the same config and learner steps at max_staleness=0 (sync) and >= 1 (async).

  python benchmarks/async_vs_sync.py [--out FILE] [--quick]

Prints one JSON object (and writes it to --out). Both modes run the real runtime
(`build.build` -> `build_rl` -> `make_runtime` -> `AsyncRuntime.run(threaded=True)`) on
`--sampler-devices` + `--learner-devices` CPU devices (default 1 + 1); sync mode is the same code
with `rl.max_staleness=0` (one batch in flight). The default is the fastest layout of sync mode, the
baseline, on this project's 2-core machines: one sampler device decodes faster than 4 data-parallel
replicas (as in sampler_throughput.py), and one learner device trains the long-tail batches,
grouped by length, 2x faster than 4 FSDP devices (whose per-call collectives dominate at this
size). A comparison against a slowed baseline would credit async with hiding that slowness.
`--sampler-devices 4 --learner-devices 4` measures the main job's 4 + 4 layout.
Two workloads:
  (a) long_tail: completion lengths with a geometric tail. The model is untrained (no warm start),
      so each token is <eos> with probability about 1/vocab and completions end at EOS at
      geometrically distributed lengths (mean about 84), cut at `sampler.max_new_tokens` (320). The
      reward is exact match on the reverse task, which the untrained model cannot solve, so the tail
      stays. In sync mode every batch waits for its longest completion while the freed slots sit
      idle; async refills them with the next batches' groups. The learner groups rows by length
      (`optim.group_by_length`), so a step costs about the mean length, not the longest, in both modes.
  (b) slow_reward: 2-digit addition from a model warm-started once (supervised) to about 20%
      held-out accuracy; the reward is exact match behind a verifier that takes 50-200 ms per call
      (one call per group of G completions, seeded by the prompt id, like a tool call or remote
      grader; it sleeps, so it costs latency, not CPU). The reward pool has `rl.reward_workers`
      threads.
Both modes of a workload start from the same weights and seed, and both compile every sampler
program before they start (`sampler.warmup`: each attention window and prompt bucket, as JetStream's
model warm-up), so neither is timed compiling a decode window it meets for the first time (before
2026-11-25 those compilations fell inside the timed steps of both modes, 0.1-0.2 s/step of sync's
time on the long tail, and made the figures swing). Timing skips the first `--skip-steps` learner
steps (the learner's compilation) and covers the rest; busy fractions are busy seconds over the
timed window (learner: train step + weight sync; sampler: the driver's device calls, 0 when it had
sampled every step's groups before the window; the runtime's cumulative figures, compilation
included, are kept as `*_runtime`); final reward is the mean `reward/mean` of the last
`--final-steps` steps (training batches: in async mode those were sampled by policies up to
max_staleness versions older than the learner's, so this figure lags the policy);
`final_eval_accuracy` scores the final policy itself on the held-out split (greedy, the task's
verifier, after the timed run), and the notes judge both within two standard errors; staleness is
the max of `staleness/max` over all steps. The machine may be shared: the load average is recorded (`harness.py`).
"""

from __future__ import annotations

import pathlib
import threading
import time
import zlib

import harness


def _flags(p):
  p.add_argument("--steps", type=int, default=None, help="learner steps per run (default 40; quick 2)")
  p.add_argument("--skip-steps", type=int, default=None, help="steps excluded from timing (compilation)")
  p.add_argument("--final-steps", type=int, default=8, help="steps averaged for the final reward")
  p.add_argument("--async-staleness", type=int, default=None,
                 help="rl.max_staleness of the async mode for every workload (default: long_tail 2, slow_reward 1)")
  p.add_argument("--workloads", default="long_tail,slow_reward")
  p.add_argument("--sampler-devices", type=int, default=1, help="mesh.sampler_devices (data-parallel replicas)")
  p.add_argument("--learner-devices", type=int, default=1, help="mesh.learner_devices (FSDP)")


ARGS = harness.parse(__doc__, _flags)
harness.host_devices(ARGS.sampler_devices + ARGS.learner_devices)  # the two submeshes

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tunixlike import config as config_lib, rewards  # noqa: E402
from tunixlike.rewards import basic  # noqa: E402
from tunixlike.rl import build  # noqa: E402
from tunixlike.rl.prompts import PromptStream  # noqa: E402

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"

SLOW_MIN_S, SLOW_MAX_S = 0.05, 0.2
# Async mode's staleness bound per workload: the least that hides the workload's waiting (the targets
# allow <= 2). The long tail needs 2: a straggler started at version v must finish before the
# learner trains version v + max_staleness, so a bound of 1 gives a batch's longest completion one
# learner step. The verifier's latency hides behind one step; at 2 the final reward of the slow-reward
# workload came out below sync's in 2 of 3 40-step runs (stale gradients, 2026-11-25).
ASYNC_STALENESS = {"long_tail": 2, "slow_reward": 1}
_LENGTHS: list[int] = []  # completion lengths seen by the long-tail reward (to describe the tail)
_LENGTHS_LOCK = threading.Lock()
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"  # jax.monitoring: one per trace of a function
# The Engine's jitted bodies (JAX names a trace after the function it traces).
ENGINE_PROGRAMS = {"_prefill_impl", "_insert_impl", "_release_impl", "_generate_impl", "_resize_impl", "_move_impl"}


@rewards.register("bench_exact_match")
def bench_exact_match(prompts, completions, *, answer, completion_lengths, **_):
  """`exact_match`, recording the lengths for the report."""
  with _LENGTHS_LOCK:
    _LENGTHS.extend(int(n) for n in completion_lengths)
  return basic.exact_match(prompts, completions, answer=answer)


@rewards.register("bench_slow_exact_match")
def bench_slow_exact_match(prompts, completions, *, answer, prompt_ids, **kw):
  """Exact match behind a 50-200 ms verifier call; the latency is seeded by the prompt id."""
  u = zlib.crc32(str(prompt_ids[0]).encode()) / 2**32
  time.sleep(SLOW_MIN_S + (SLOW_MAX_S - SLOW_MIN_S) * u)
  return basic.exact_match(prompts, completions, answer=answer)


def workload_config(name: str, steps: int, quick: bool):
  cfg = config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_grpo.py"))
  # quick: 1,024 training prompts, not 50,000 (each formatted and length-checked at every build: about
  # 4 CPU-s per build, five builds); a quick run samples a few dozen of them
  size = dict(train_size=1024) if quick else {}
  common = dict(seed=ARGS.seed, log=dict(progress_bar=False, tensorboard=False, trace=False),
                # quick: one layer (the layers are unrolled: compiling is most of a smoke run, per layer)
                **(dict(model=dict(num_layers=1)) if quick else {}),
                eval=dict(every_steps=0),
                mesh=dict(sampler_devices=ARGS.sampler_devices, learner_devices=ARGS.learner_devices))
  if name == "long_tail":
    # 8 prompts x 4 samples = 32 completions per step on 32 slots: sync starts a whole batch at once
    # and waits for the longest; the random model's EOS rate (~1/83 per token) gives a mean length
    # near 84, a median near 60 and a tail to max_new_tokens.
    # Groups of 4, not 8: admission counts groups ((max_staleness + 1) batches of them), and a group
    # holds its admission until its longest sample ends; at G=8 nearly every group has a straggler
    # past 200 tokens, so async could start little new work while stragglers ran (1.1x at G=8).
    new = 24 if quick else 320
    return config_lib.replace(
        cfg, data=dict(task="reverse", num_eval_examples=8, max_prompt_length=16, **size),
        warm_start=dict(max_steps=0),
        sampler=dict(max_concurrent_decodes=16 if quick else 32, max_new_tokens=new, max_prefill_length=16,
                     steps_per_call=8, warmup=True),
        # quick: 2 length groups, not 8 (each is a branch of the compiled step: 8 took 36 s to compile)
        optim=dict(micro_batches=2 if quick else 16, group_by_length=2 if quick else 8, share_prompts=False),
        algo=dict(group_size=4), rl=dict(num_steps=steps, prompts_per_step=2 if quick else 8, reward_workers=4), **common)
  if name == "slow_reward":
    # Short completions (<= 4 tokens), so generation and training are cheap and the verifier's
    # latency is the larger part of a synchronous step, as with tool calls on a small model.
    return config_lib.replace(
        cfg, data=dict(digits=2, num_eval_examples=16 if quick else 500, **size),
        warm_start=dict(max_steps=2 if quick else 1500, eval_every=10 if quick else 20, target_accuracy=0.3),
        sampler=dict(max_concurrent_decodes=16 if quick else 64, warmup=True),
        # Enough reward workers that the verifier's latency, not its throughput, is what a step
        # waits for (as with remote graders or tools): sync mode waits for the slowest call of
        # every batch, async overlaps it with decoding and training.
        rl=dict(num_steps=steps, prompts_per_step=2 if quick else 16, reward_workers=48), **common)
  raise ValueError(f"unknown workload {name!r} (long_tail | slow_reward)")


def run_mode(cfg, staleness: int, init_params, reward_name: str, skip: int, final: int) -> dict:
  cfg = config_lib.replace(cfg, rl=dict(max_staleness=staleness))
  setup = build.build(cfg, say=lambda *a: None)
  if init_params is not None:
    nnx.update(setup.model, init_params)
  rl = build.build_rl(setup, reward=rewards.CombinedReward([reward_name], timeout_s=cfg.rl.reward_timeout_s))
  records = []
  runtime = build.make_runtime(setup, rl, PromptStream(iter(setup.train_pipe)))
  # With the sampler's busy seconds so far, read exactly at each step (its fraction is over the whole run).
  runtime.hooks.add(lambda info: records.append((time.monotonic(), info.step, dict(
      info.metrics, sampler_busy_s=runtime.driver.stats.busy_time_s))))
  with _LENGTHS_LOCK:
    _LENGTHS.clear()
  # make_runtime compiled every decode program (sampler.warmup): count the Engine's programs JAX
  # traces (so compiles) during the run, from its own trace events (the learner compiles its step).
  compiled_in_run = []

  def listener(event, secs, fun_name="", **kw):
    if event == TRACE_EVENT and fun_name in ENGINE_PROGRAMS:
      compiled_in_run.append(fun_name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  busy_at_start = runtime.driver.stats.busy_time_s
  t0 = time.monotonic()
  runtime.run(threaded=True)
  total = time.monotonic() - t0
  jax.monitoring.unregister_event_duration_listener(listener)
  held_out = build.evaluate(setup, rl)  # the final policy itself, after the timed run
  times = [t for t, _, _ in records]
  timed_steps = len(records) - skip
  wall = times[-1] - times[skip - 1] if skip else times[-1] - t0
  last = records[-1][2]
  # Busy fractions over the timed window (the runtime's are cumulative from the start, compile included).
  sampler_busy_s = last["sampler_busy_s"] - (records[skip - 1][2]["sampler_busy_s"] if skip else busy_at_start)
  learner_busy_s = sum(m["learner/step_s"] + m["sync/ms"] / 1e3 for _, _, m in records[skip:])
  rewards_per_step = [m["reward/mean"] for _, _, m in records]
  out = {
      "max_staleness_config": staleness,
      "wall_s": wall, "timed_steps": timed_steps, "s_per_step": wall / timed_steps, "wall_s_total": total,
      "learner_busy_frac": learner_busy_s / wall, "sampler_busy_frac": sampler_busy_s / wall,
      "learner_busy_frac_runtime": last["learner/busy_frac"], "sampler_busy_frac_runtime": last["sampler/busy_frac"],
      "final_reward": float(np.mean(rewards_per_step[-final:])),
      # Standard error of that mean (steps' rewards as samples): what "no worse" is judged against.
      "final_reward_se": float(np.std(rewards_per_step[-final:], ddof=1) / np.sqrt(final)) if final > 1 else 0.0,
      "reward_per_step": [round(r, 4) for r in rewards_per_step],
      "max_staleness": int(max(m["staleness/max"] for _, _, m in records)),
      "mean_staleness": float(np.mean([m["staleness/mean"] for _, _, m in records])),
      "dropped_stale": int(last["queue/dropped_stale"]),
      "sampler_tokens_per_s": last["sampler/tokens_per_s"], "slot_occupancy": last["sampler/slot_occupancy"],
      "learner_step_s_mean": float(np.mean([m["learner/step_s"] for _, _, m in records[skip:]])),
      "learner_wait_s_mean": float(np.mean([m["learner/wait_s"] for _, _, m in records[skip:]])),
      "sync_ms_mean": float(np.mean([m["sync/ms"] for _, _, m in records])),
      "steps": len(records), "learner_version": rl.policy.version,
      "sampler_programs_compiled_during_run": len(compiled_in_run),
      "final_eval_accuracy": float(held_out["eval/accuracy"]), "eval_prompts": int(held_out["eval/num_prompts"]),
  }
  with _LENGTHS_LOCK:
    if _LENGTHS:
      n = np.asarray(_LENGTHS)
      out["completion_length"] = {"mean": float(n.mean()), "p50": float(np.median(n)),
                                  "p90": float(np.percentile(n, 90)), "max": int(n.max()),
                                  "frac_at_limit": float(np.mean(n >= cfg.sampler.max_new_tokens))}
  return out


def warm_started_params(cfg):
  """Warm-start once; both modes then start from these weights (host copy)."""
  setup = build.build(cfg, say=lambda *a: None)
  t0 = time.monotonic()
  info = build.warm_start(setup, say=lambda *a: None)
  return jax.device_get(nnx.state(setup.model)), {**{k: float(v) for k, v in info.items()},
                                                  "warm_start_s": time.monotonic() - t0}


def bench_workload(name: str, steps: int, skip: int, final: int, staleness: int, quick: bool) -> dict:
  cfg = workload_config(name, steps, quick)
  init, extra = None, {}
  if name == "slow_reward":
    init, extra = warm_started_params(cfg)
    cfg = config_lib.replace(cfg, warm_start=dict(max_steps=0))
  # long_tail scores the reverse task by exact match: the untrained model cannot solve it, so its
  # EOS-driven lengths stay long-tailed for the whole run (rewarding stopping would erase the tail
  # within a few steps and measure something else).
  reward = "bench_exact_match" if name == "long_tail" else "bench_slow_exact_match"
  sync = run_mode(cfg, 0, init, reward, skip, final)
  async_ = run_mode(cfg, staleness, init, reward, skip, final)
  s, c = cfg.sampler, cfg.rl
  return {
      "speedup": sync["wall_s"] / async_["wall_s"],
      "sync": sync, "async": async_,
      "setup": {"task": cfg.data.task, "reward": reward, "prompts_per_step": c.prompts_per_step,
                "group_size": cfg.algo.group_size, "slots": s.max_concurrent_decodes,
                "max_new_tokens": s.max_new_tokens, "reward_workers": c.reward_workers, "steps": steps,
                "skip_steps": skip, "model": {"hidden": cfg.model.hidden_size, "layers": cfg.model.num_layers},
                **({"reward_latency_s": [SLOW_MIN_S, SLOW_MAX_S], "latency_per": "call (one per group)"}
                   if name == "slow_reward" else {"lengths": "untrained model: EOS ~1/vocab per token "
                                                            "(geometric), cut at max_new_tokens",
                                                  "micro_batches": cfg.optim.micro_batches,
                                                  "group_by_length": cfg.optim.group_by_length}),
                **extra},
  }


def main():
  steps = ARGS.steps or (2 if ARGS.quick else 40)
  skip = ARGS.skip_steps if ARGS.skip_steps is not None else (1 if ARGS.quick else 2)
  if not 0 <= skip < steps:
    raise ValueError(f"--skip-steps={skip} must be in [0, --steps={steps})")
  names = [n for n in ARGS.workloads.split(",") if n]
  t0 = time.time()
  staleness = {n: ARGS.async_staleness if ARGS.async_staleness is not None else ASYNC_STALENESS[n] for n in names}
  detail = {n: bench_workload(n, steps, skip, ARGS.final_steps, staleness[n], ARGS.quick) for n in names}
  result: dict = {"benchmark": "async_vs_sync", "quick": ARGS.quick, "devices": jax.device_count(),
                  "mesh": {"sampler_devices": ARGS.sampler_devices, "learner_devices": ARGS.learner_devices},
                  "async_max_staleness_config": staleness}
  for n in names:
    result[f"speedup_{n}"] = detail[n]["speedup"]
  runs = [detail[n][m] for n in names for m in ("sync", "async")]
  result["final_reward_sync"] = {n: detail[n]["sync"]["final_reward"] for n in names}
  result["final_reward_async"] = {n: detail[n]["async"]["final_reward"] for n in names}
  result["final_eval_accuracy_sync"] = {n: detail[n]["sync"]["final_eval_accuracy"] for n in names}
  result["final_eval_accuracy_async"] = {n: detail[n]["async"]["final_eval_accuracy"] for n in names}
  result["max_staleness"] = max(r["max_staleness"] for r in runs)
  result["workloads"] = detail
  result["wall_s"] = time.time() - t0
  result["notes"] = notes(result, names)
  harness.report(result, ARGS)


def _eval_verdict(sync: dict, async_: dict) -> str:
  """The final policies' held-out accuracy, async against sync, within two binomial standard errors."""
  p, q, n = sync["final_eval_accuracy"], async_["final_eval_accuracy"], max(sync["eval_prompts"], 1)
  return _verdict(q - p, 2 * float(np.hypot(np.sqrt(p * (1 - p) / n), np.sqrt(q * (1 - q) / n))))


def _reward_verdict(sync: dict, async_: dict) -> str:
  """Async's final reward against sync's, within two standard errors of their difference."""
  diff = async_["final_reward"] - sync["final_reward"]
  return _verdict(diff, 2 * float(np.hypot(sync["final_reward_se"], async_["final_reward_se"])))


def _verdict(diff: float, two_se: float) -> str:
  if diff >= -two_se:
    return f"async - sync = {diff:+.3f}: no worse within 2 SE ({two_se:.3f})"
  return f"async - sync = {diff:+.3f}: WORSE, beyond 2 SE ({two_se:.3f})"


def notes(result, names) -> list[str]:
  """What the figures mean against the targets (filled from the measurements, not assumed)."""
  load = harness.load_average()
  out = [f"machine: 2 CPU cores shared with other jobs (loadavg {load['before'][0]:.1f} -> "
         f"{load['after'][0]:.1f}); sampler and learner submeshes share those cores, so async "
         "overlaps latency (idle slots, reward waits) but not compute."]
  targets = {"long_tail": 1.5, "slow_reward": 1.8}
  for n in names:
    d = result["workloads"][n]
    sp, sy, asy = d["speedup"], d["sync"], d["async"]
    verdict = "meets" if sp >= targets.get(n, 0) else "below"
    out.append(f"{n}: speedup {sp:.2f} ({verdict} target {targets.get(n)}); sync {sy['s_per_step']:.2f} s/step "
               f"(sampler busy {sy['sampler_busy_frac']:.2f}, learner busy {sy['learner_busy_frac']:.2f}), "
               f"async {asy['s_per_step']:.2f} s/step (sampler busy {asy['sampler_busy_frac']:.2f}, learner busy "
               f"{asy['learner_busy_frac']:.2f}); final reward sync {sy['final_reward']:.3f} ± "
               f"{sy['final_reward_se']:.3f} vs async {asy['final_reward']:.3f} ± {asy['final_reward_se']:.3f} "
               f"({_reward_verdict(sy, asy)}); held-out accuracy of the final policy sync "
               f"{sy['final_eval_accuracy']:.3f} vs async {asy['final_eval_accuracy']:.3f} on {sy['eval_prompts']} "
               f"prompts ({_eval_verdict(sy, asy)}); max staleness {asy['max_staleness']}.")
  return out


if __name__ == "__main__":
  main()
