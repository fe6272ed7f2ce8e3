"""What rl.deterministic costs the main job, and what it buys.

  python benchmarks/determinism.py [--repeats 2] [--skip-steps 10] [--out FILE] [--quick]

Prints one JSON object (and writes it to --out). The main job as shipped (`python -m tunixlike.train
--config configs/addition_grpo.py`, rl.max_staleness 1, seed 0; run by rl_step.py's `_run`) free-running
and with `--config.rl.deterministic=true`, alternated (free, deterministic, free, ... `--repeats` of
each, at least 2), one at a time: the machine has 2 cores. Per mode, `modes` holds the median run by
s/step (the faster of the middle two for an even count) and `runs` every run:
  s_per_step          the RL stage's wall clock over its steps (metrics.jsonl's `time_s`), the first
                      `--skip-steps` (compilation) and the steps that ran an eval left out
  s_per_step_median   rl_step.py's figure (median time between steps), with its busy fractions, sync
                      and learner step
  accuracy_before / accuracy_after   held-out accuracy at the first and the last eval
  wall_s              the whole command: start-up, warm start, evals and RL
  slot_occupancy      the sampler's live slots over all its slots, over every decode step of the run
                      (the last step's cumulative figure); learner_wait_s: median wait for a batch
`ratio_s_per_step`: deterministic over free-running s_per_step (target <= 1.15, `target_met`).
What determinism buys: `deterministic_runs_equal` (and `free_running_runs_equal`) say whether the
mode's first two runs wrote the same metrics.jsonl, every record and key but the timings (TIMING);
`first_difference` names the first record that differs. The price is the end of each round, where
the last completions decode at a small batch size: slot_occupancy and learner_wait_s show it.
--quick: the tiny variant, 8 RL steps, skip 2 (a smoke test).
"""

from __future__ import annotations

import itertools
import pathlib
import statistics
import tempfile
import time

import harness
import rl_step
from tunixlike.rl import schedule

# What thread timing changes even in a deterministic run: how long things took and how full the
# queue was when a step read it (the library's one list).
TIMING = schedule.TIMING_METRICS
MODES = {"free_running": [], "deterministic": ["--config.rl.deterministic=true"]}
TARGET = 1.15


def _flags(p):
  p.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternated (at least 2)")
  p.add_argument("--steps", type=int, default=None, help="RL steps per run (default the main job's own; quick 8)")
  p.add_argument("--skip-steps", type=int, default=None, help="steps left out of the timing (default 10; quick 2)")


without_timing = schedule.without_timing


def first_difference(a: list[dict], b: list[dict]) -> dict | None:
  """None when two metrics logs hold the same records, timings left out; else where they first differ."""
  for i, (x, y) in enumerate(itertools.zip_longest(a, b, fillvalue={})):
    x, y = without_timing(x), without_timing(y)
    if x != y:
      keys = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
      return {"record": i, "step": (x or y).get("step"), "keys": keys[:8]}
  return None


def rl_s_per_step(records: list[dict], skip: int) -> float:
  """Mean seconds between step records after `skip` steps, leaving out the intervals an eval ran in."""
  spans, prev, evaled, seen = [], None, False, 0
  for r in records:
    if "eval/accuracy" in r:
      evaled = True
    elif "learner/busy_frac" in r:
      seen += 1
      if prev is not None and seen > skip + 1 and not evaled:
        spans.append(r["time_s"] - prev)
      prev, evaled = r["time_s"], False
  return statistics.mean(spans)


def summary(records: list[dict], wall_s: float, skip: int) -> dict:
  steps = [r for r in records if "learner/busy_frac" in r]
  evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
  median = rl_step._summary(records, skip)
  return {"s_per_step": round(rl_s_per_step(records, skip), 4), "s_per_step_median": median.pop("s_per_step"),
          "accuracy_before": evals[0], "accuracy_after": evals[-1], "wall_s": round(wall_s, 1),
          "slot_occupancy": round(steps[-1]["sampler/slot_occupancy"], 3),
          "learner_wait_s": round(statistics.median(r["learner/wait_s"] for r in steps[skip:]), 4), **median}


def main(argv=None):
  args = harness.parse(__doc__, _flags, argv, quick="the tiny variant, 8 RL steps",
                       seed="config.seed of --quick or --steps runs (the whole main job runs as shipped: seed 0)")
  if args.repeats < 2:
    raise SystemExit("determinism: --repeats must be at least 2 (two runs of each mode are compared)")
  steps = args.steps or (8 if args.quick else None)  # None: the whole main job, its own steps and evals
  skip = args.skip_steps if args.skip_steps is not None else (2 if args.quick else 10)
  runs = {mode: [] for mode in MODES}
  logs = {mode: [] for mode in MODES}
  with tempfile.TemporaryDirectory(prefix="determinism_") as tmp:
    for i in range(args.repeats):
      for mode, flags in MODES.items():  # alternated: a load change falls on both modes alike
        t0 = time.monotonic()
        records = rl_step._run(rl_step.REPO, pathlib.Path(tmp) / f"{mode}-{i}", steps, args.quick, flags, args.seed)
        logs[mode].append(records)
        runs[mode].append(summary(records, time.monotonic() - t0, skip))
  modes = {mode: sorted(r, key=lambda s: s["s_per_step"])[(len(r) - 1) // 2] for mode, r in runs.items()}
  ratio = round(modes["deterministic"]["s_per_step"] / modes["free_running"]["s_per_step"], 3)
  diffs = {mode: first_difference(*logs[mode][:2]) for mode in MODES}
  out = {"ratio_s_per_step": ratio, "target": TARGET, "target_met": ratio <= TARGET,
         "deterministic_runs_equal": diffs["deterministic"] is None,
         "free_running_runs_equal": diffs["free_running"] is None, "first_difference": diffs,
         "modes": modes, "runs": runs,
         "workload": {"config": "configs/addition_grpo.py" + (":size=tiny" if args.quick else ""),
                      "steps": steps or "the config's", "skip_steps": skip, "repeats": args.repeats,
                      "timing_keys_left_out": list(TIMING)}}
  harness.report(out, args, indent=2)


if __name__ == "__main__":
  main()
