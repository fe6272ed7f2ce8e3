"""Two co-evolving policies with long-tailed turns: synchronous vs group-level vs episode-level async.

  python benchmarks/multi_agent.py [--steps 24] [--skip-steps 4] [--episodes 8] [--median-tokens 24] [--max-tokens 256]
      [--modes sync,group,episode] [--seed 0] [--learning-rate 1.25e-4]
      [--sampler-devices 4] [--learner-devices 4] [--out FILE] [--quick]

Prints one JSON object. The self-play task (`multi_agent.ProposeSolveEnv`, 2-digit problems, 4 solver
attempts) on the main job's model and warm start (configs/addition_grpo.py, seed `--seed`), two
policies (proposer, solver) cloned from the warm-started model, each with its own learner (two
length-grouped micro-batches) and sampler (paged KV cache) on the CPU submeshes (4 + 4 virtual
devices by default). Every turn's token limit is drawn from a log-normal distribution (median
`--median-tokens`, p90 5x the median, capped at sampler.max_new_tokens) and EOS is off, so each turn
decodes exactly its drawn length; a turn's answer is what it starts with (the proposer's `a+b`, the
solver's digits). Each mode trains `--steps` batches of `--episodes` episodes from the same weights:
  sync      every turn waits for its batch (`lockstep`), one batch in flight (max_staleness 0);
  group     episodes leave in whole groups of 4 (each group waits for its slowest), max_staleness 1;
  episode   each episode leaves when it ends, 2 batches of episodes in flight (over-provisioned;
            the learner takes the oldest finished), max_staleness 1.
Reported per mode: wall-clock seconds per trained episode after `--skip-steps` (compilation),
where a timed step's seconds go (`s_per_step`; `learner_s_per_step`: both policies' train steps and
weight syncs; `sampler_busy_s_per_step`: both samplers' device calls, fetching results included),
the episode wait (admission to end) p90 over median, the turn lengths' p90 over median per agent,
the final solver and proposer rewards (mean over the last 5 steps, with the standard error over
those steps; `reward_curve` has every step's), and `short_episode_bias`: the mean tokens of an
episode trained in the episode mode over the synchronous mode's (which trains every episode it
starts), below 1 if taking the first finished episodes favours short ones.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sys
import time

import numpy as np

import harness

REPO = pathlib.Path(__file__).resolve().parent.parent
MODES = ("sync", "group", "episode")
P90_Z = 1.2815515655446004  # the standard normal's 90th percentile


def _flags(p):
  p.add_argument("--steps", type=int, default=24)
  p.add_argument("--skip-steps", type=int, default=4)
  p.add_argument("--episodes", type=int, default=8, help="episodes per learner step")
  p.add_argument("--median-tokens", type=float, default=24.0, help="median turn length")
  p.add_argument("--max-tokens", type=int, default=256, help="sampler.max_new_tokens (the longest turn)")
  p.add_argument("--modes", default=",".join(MODES))
  # The main job's 5e-4 moved a policy 0.05-0.17 nats per token in one step here, and at staleness 1
  # the proposer drifted to invalid problems in 5 of 8 async runs (docs/benchmarks.md).
  p.add_argument("--learning-rate", type=float, default=1.25e-4, help="optim.learning_rate of both policies' RL")
  p.add_argument("--sampler-devices", type=int, default=4, help="mesh.sampler_devices (both policies' samplers)")
  p.add_argument("--learner-devices", type=int, default=4, help="mesh.learner_devices (both policies' learners)")


ARGS = harness.parse(__doc__, _flags, quick="tiny model, no warm start, few steps",
                     seed="config.seed: the warm start's batch order and the sampling noise")
harness.host_devices(ARGS.sampler_devices + ARGS.learner_devices)  # the two submeshes

from tunixlike import config as config_lib  # noqa: E402
from tunixlike.multi_agent import ProposeSolveEnv, build as ma_build  # noqa: E402
from tunixlike.multi_agent.self_play import PROPOSER, SOLVER  # noqa: E402
from tunixlike.rl import build  # noqa: E402


def _setup(a):
  cfg = config_lib.from_config_dict(config_lib.load(REPO / "configs" / "addition_grpo.py",
                                                    "size=tiny" if a.quick else None))
  cfg = config_lib.replace(cfg, seed=a.seed, log=dict(progress_bar=False, tensorboard=False),
                           sampler=dict(max_concurrent_decodes=32),
                           mesh=dict(sampler_devices=a.sampler_devices, learner_devices=a.learner_devices))
  setup = build.build(cfg, say=lambda *x: None)
  if not a.quick:  # a smoke run checks the modes run, not what they learn: no warm start (20 steps, 5 evals)
    build.warm_start(setup, say=lambda *x: None)  # at the main job's lengths (long turns only in RL)
  # Long-tailed turns padded to the longest cost the learner 5x its work (1.17 s of a 1.87 s
  # synchronous step): two micro-batches, each trimmed to its own longest row, as the library
  # recommends for long-tailed batches (docs/learner.md), in every mode.
  return dataclasses.replace(setup, cfg=config_lib.replace(
      cfg, sampler=dict(max_new_tokens=a.max_tokens),
      optim=dict(learning_rate=a.learning_rate, micro_batches=2, group_by_length=2, share_prompts=False)))


def turn_lengths(median: float, cap: int):
  sigma = math.log(5.0) / P90_Z
  return lambda rng: int(np.clip(round(median * math.exp(sigma * rng.standard_normal())), 1, cap))


def run_mode(setup, mode: str, a) -> dict:
  b = a.episodes
  # A paged KV cache: with continuous batching, a contiguous cache's window follows the longest live
  # turn, so every short turn decoding beside a long one pays for its length.
  sampler = dict(eos_ids=(), kv_layout="paged")
  policies, engines = ma_build.build_policies(setup, {PROPOSER: 1, SOLVER: 4}, batch_episodes=b,
                                     sampler={PROPOSER: sampler, SOLVER: sampler})
  options = dict(sync=dict(max_staleness=0, lockstep=True, max_episodes_in_flight=b),
                 group=dict(max_staleness=1, emit_groups_of=4),
                 episode=dict(max_staleness=1, max_episodes_in_flight=2 * b))[mode]
  lengths = turn_lengths(a.median_tokens, a.max_tokens)
  runtime = ma_build.build_runtime(setup, policies, engines, lambda: ProposeSolveEnv(digits=2, attempts=4, turn_tokens=lengths),
                                   batch_episodes=b, max_turns=2, **options)
  marks, rewards, busy, train_s = [], [], [], []
  drivers = runtime.coordinator.drivers.values()

  def on_step(step, metrics):
    marks.append(time.monotonic())
    train_s.append(metrics["learner/step_s"])
    busy.append(sum(d.stats.busy_time_s for d in drivers))  # both samplers' device calls so far
    rewards.append((metrics.get(f"{SOLVER}/reward", float("nan")), metrics.get(f"{PROPOSER}/reward", float("nan"))))

  runtime.run(a.steps, on_step=on_step)
  timed = a.steps - 1 - a.skip_steps
  per_episode = (marks[-1] - marks[a.skip_steps]) / (timed * b)
  walls = np.array(runtime.episode_wall_s)
  last = np.array(rewards[-5:])
  turn_tokens = {name: dict(median=float(np.median(t)), p90_over_median=round(float(np.percentile(t, 90) / np.median(t)), 2))
                 for name, t in runtime.turn_tokens.items() if t}
  # Where a timed step's wall clock goes: both learners (train + sync), both samplers' device calls.
  step_s = (marks[-1] - marks[a.skip_steps]) / timed
  learner_s = float(np.mean(train_s[a.skip_steps + 1:]))
  sampler_s = (busy[-1] - busy[a.skip_steps]) / timed
  return dict(s_per_episode=round(per_episode, 4), s_per_step=round(step_s, 4), learner_s_per_step=round(learner_s, 4),
              sampler_busy_s_per_step=round(sampler_s, 4), episode_wait_p90_over_median=round(float(
      np.percentile(walls, 90) / np.median(walls)), 2),
      final_reward=dict(solver=round(float(np.nanmean(last[:, 0])), 4),
                        solver_se=round(float(np.nanstd(last[:, 0]) / math.sqrt(len(last))), 4),
                        proposer=round(float(np.nanmean(last[:, 1])), 4),
                        proposer_se=round(float(np.nanstd(last[:, 1]) / math.sqrt(len(last))), 4)),
      reward_curve=dict(solver=[round(r[0], 3) for r in rewards], proposer=[round(r[1], 3) for r in rewards]),
      versions=runtime.versions(), turn_tokens=turn_tokens, coordinator=vars(runtime.coordinator.stats),
      trained_episode_tokens=round(float(np.mean(runtime.episode_tokens)), 1),
      valid_problems=round(len(runtime.turn_tokens[SOLVER]) / max(len(runtime.turn_tokens[PROPOSER]), 1) / 4, 3))


def main():
  a = ARGS
  if a.quick:
    a.steps, a.skip_steps, a.episodes, a.max_tokens = 5, 1, 8, 16
  t0 = time.monotonic()
  setup = _setup(a)
  out = {"modes": {}}
  for mode in a.modes.split(","):
    out["modes"][mode] = run_mode(setup, mode, a)
    print(mode, out["modes"][mode], file=sys.stderr, flush=True)
  m = out["modes"]
  if {"sync", "episode"} <= set(m):
    out["episode_async_vs_sync"] = round(m["sync"]["s_per_episode"] / m["episode"]["s_per_episode"], 3)
  if {"group", "episode"} <= set(m):
    out["episode_async_vs_group_async"] = round(m["group"]["s_per_episode"] / m["episode"]["s_per_episode"], 3)
  out["joint_p90_over_median"] = {k: v["episode_wait_p90_over_median"] for k, v in m.items()}
  if {"sync", "episode"} <= set(m):  # sync trains every episode it starts: the unbiased length
    out["short_episode_bias"] = round(m["episode"]["trained_episode_tokens"] / m["sync"]["trained_episode_tokens"], 3)
  out["final_reward"] = {k: v["final_reward"]["solver"] for k, v in m.items()}
  out["targets"] = dict(episode_async_vs_sync=2.0, episode_async_vs_group_async=1.3,
                        final_reward="episode >= sync - 2 standard errors")
  out["setup"] = dict(seed=a.seed, learning_rate=a.learning_rate, steps=a.steps, skip_steps=a.skip_steps,
                      episodes_per_step=a.episodes, median_tokens=a.median_tokens, max_tokens=a.max_tokens,
                      sampler_devices=a.sampler_devices, learner_devices=a.learner_devices)
  out["wall_s"] = round(time.monotonic() - t0, 1)
  harness.report(out, a, indent=2)


if __name__ == "__main__":
  main()
