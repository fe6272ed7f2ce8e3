"""The RL step of the main job: seconds per step, both sides' busy fractions and weight sync, per
layout and against an earlier commit, side by side in one run.

  python benchmarks/rl_step.py [--steps 100] [--skip-steps 10] [--layouts split] [--baseline REV]
      [--repeats 1] [--out FILE] [--quick]
  python benchmarks/rl_step.py --grid [--layouts split,colocated]    # how the cost grows
  python benchmarks/rl_step.py --seeds 0,1,2 [--layouts colocated]   # the whole main job per seed

Prints one JSON object (and writes it to --out). Each run is the main job itself, through the CLI:
`python -m tunixlike.train --config configs/addition_grpo.py` with `rl.num_steps=--steps`, on 8
virtual CPU devices (4 sampler + 4 learner), seed 0, warm start included (so the completions have
the main job's lengths), evals only at the start and the end. `--layouts` lists the values of
`mesh.layout` to run (the runs use the key only when it is not `split`, the layout every commit has).
`--baseline REV` runs the same workload from a git worktree of REV (its own CLI, configs and
code, the same interpreter and packages), so a speed-up over earlier code is a ratio measured in the
same invocation on the same machine; the baseline is driven only with config keys every commit has.
`--repeats N` runs every layout and the baseline N times in interleaved rounds: each figure is the
median round's (the faster of the middle two for an even N), `speedup_vs_baseline` the median of
the rounds' ratios (`speedup_runs`), and `rounds` has every run (one round's ratio moves by about
±0.15 with the machine's load).

From each run's metrics.jsonl: `s_per_step` is the median time between consecutive RL steps after
`--skip-steps` (compilation); the busy fractions are the runtime's cumulative `learner/busy_frac`
and `sampler/busy_frac` turned into busy seconds and taken over the same window; `sync_ms` the
median `sync/ms` over it; `overhead_s` the step time minus the busier side's busy time per step
(what neither side's compute explains: waits, bubbles, host work on the critical path). The machine
may be shared: the load average is recorded (`harness.py`).

`--grid`: the same measurements (warm start off, `--steps` default 14, 8 held-out prompts) as one
setting at a time grows from the main job's: completion length (`sampler.max_new_tokens` 8, 64,
256; an untrained model rarely stops early), prompts per step (8, 32, 128) and the model (the base
model, hidden 128 and 256: about 4x and 16x its parameters), in each layout. JSON key `grid`: one
row per run. `--seeds`: the whole main job (warm start, all its RL steps, evals) once per seed
(`seed = data.shuffle_seed = N`) in each layout, with its held-out gain and wall clock (the run's
own `time_s` at its last eval). JSON key `seeds`.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

import harness
from tunixlike.metrics import read_jsonl

REPO = pathlib.Path(__file__).resolve().parent.parent


def _flags(p):
  p.add_argument("--steps", type=int, default=None, help="RL steps per run (default 100; quick 6)")
  p.add_argument("--skip-steps", type=int, default=None, help="steps left out of the timing (default 10; quick 2)")
  p.add_argument("--layouts", default="split", help="comma-separated values of mesh.layout to run")
  p.add_argument("--baseline", default=None, help="a git revision to run the same workload from")
  p.add_argument("--repeats", type=int, default=1,
                 help="rounds of every layout (and the baseline), interleaved; the medians are reported")
  p.add_argument("--grid", action="store_true", help="s/step as completion length, prompts and model grow")
  p.add_argument("--seeds", default=None, help="comma-separated seeds: the whole main job once per seed")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="a config key for every run of this checkout (not the baseline's), e.g. rl.max_staleness=2")


def _run(root: pathlib.Path, workdir: pathlib.Path, steps: int | None, quick: bool, extra: list[str],
         seed: int = 0) -> list[dict]:
  """Runs the main job from the checkout at `root` (`steps` None: all of it); returns its metrics records."""
  config = f"{root / 'configs' / 'addition_grpo.py'}{':size=tiny' if quick else ''}"
  env = {**os.environ, "PYTHONPATH": str(root), "XLA_FLAGS": harness.xla_flags(8)}
  # `steps` None: the whole main job, with its own steps and evals (and `extra`'s seed and settings)
  timed = [] if steps is None else [f"--config.rl.num_steps={steps}", "--config.eval.every_steps=0",
                                    f"--config.seed={seed}"]
  cmd = [sys.executable, "-m", "tunixlike.train", "--config", config, "--workdir", str(workdir), *timed,
         "--config.log.progress_bar=false", *extra]
  done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
  return read_jsonl(str(workdir / "metrics.jsonl"))


def _summary(records: list[dict], skip: int) -> dict:
  steps = [r for r in records if "learner/busy_frac" in r]
  if len(steps) < skip + 3:
    raise RuntimeError(f"{len(steps)} RL steps recorded: need more than --skip-steps + 2 = {skip + 2}")
  first = steps[0]  # the RL loop's clock started one step (wait + train + sync) before its first record
  start = first["time_s"] - first["learner/wait_s"] - first["learner/step_s"] - first["sync/ms"] / 1e3
  window = steps[skip:]
  wall = [r["time_s"] - start for r in window]
  busy = {side: [r[f"{side}/busy_frac"] * w for r, w in zip(window, wall)] for side in ("learner", "sampler")}
  span = wall[-1] - wall[0]
  frac = {side: (b[-1] - b[0]) / span for side, b in busy.items()}
  s_per_step = statistics.median(b["time_s"] - a["time_s"] for a, b in zip(window, window[1:]))
  return {
      "s_per_step": round(s_per_step, 4),
      "learner_busy": round(frac["learner"], 3), "sampler_busy": round(frac["sampler"], 3),
      "sync_ms": round(statistics.median(r["sync/ms"] for r in window), 2),
      "learner_step_s": round(statistics.median(r["learner/step_s"] for r in window), 4),
      # Busy time counts when a call ends, so a fraction may pass 1 by a call at the window's edge.
      "overhead_s": round(s_per_step * max(0.0, 1 - max(frac.values())), 4),
      "timed_steps": len(window) - 1,
      "final_reward": round(statistics.mean(r["reward/mean"] for r in steps[-10:]), 3),
  }


# One setting at a time, from the main job's (the first value of each axis).
GRID = {
    "completion_tokens": [(8, []), (64, ["--config.sampler.max_new_tokens=64"]),
                          (256, ["--config.sampler.max_new_tokens=256"])],
    "prompts_per_step": [(32, []), (8, ["--config.rl.prompts_per_step=8"]),
                         (128, ["--config.rl.prompts_per_step=128"])],
    "model_params": [("1x", []),
                     ("4x", ["--config.model.hidden_size=128", "--config.model.intermediate_size=512",
                             "--config.model.head_dim=32"]),
                     ("16x", ["--config.model.hidden_size=256", "--config.model.intermediate_size=1024",
                              "--config.model.head_dim=64"])],
}
GRID_COMMON = ["--config.warm_start.max_steps=0", "--config.data.num_eval_examples=8"]


SETTINGS: list[str] = []  # --set, as CLI flags


def _layout_flags(layout: str) -> list[str]:
  return SETTINGS + ([] if layout == "split" else [f"--config.mesh.layout={layout}"])


def _grid(tmp: pathlib.Path, layouts: list[str], steps: int, skip: int) -> list[dict]:
  rows, done = [], {}
  for axis, points in GRID.items():
    for value, flags in points:
      for layout in layouts:
        key = (tuple(flags), layout)
        if key not in done:  # the main job's point is shared by the three axes
          records = _run(REPO, tmp / f"grid{len(done)}", steps, False, GRID_COMMON + flags + _layout_flags(layout))
          summary = _summary(records, skip)
          rl = [r for r in records if "num_tokens" in r][skip:]
          rows_per_step = _rows_per_step(flags)
          summary["completion_tokens_mean"] = round(statistics.mean(r["num_tokens"] for r in rl) / rows_per_step, 1)
          done[key] = summary
        row = {"axis": axis, "value": value, "layout": layout}
        row.update({k: done[key][k] for k in ("s_per_step", "learner_busy", "sampler_busy", "sync_ms",
                                              "learner_step_s", "completion_tokens_mean")})
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
  return rows


def _rows_per_step(flags: list[str]) -> int:
  prompts = next((int(f.split("=")[1]) for f in flags if f.startswith("--config.rl.prompts_per_step=")), 32)
  return prompts * 8  # algo.group_size of the main job


def _seed_run(tmp: pathlib.Path, seed: int, layout: str) -> dict:
  flags = [f"--config.seed={seed}", f"--config.data.shuffle_seed={seed}", *_layout_flags(layout)]
  records = _run(REPO, tmp / f"seed{seed}-{layout}", None, False, flags)
  evals = [r for r in records if "eval/accuracy" in r]
  gain = 100 * (evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"])
  return {"seed": seed, "layout": layout, "gain_points": round(gain, 1), "wall_s": round(evals[-1]["time_s"], 1),
          "accuracy": [round(r["eval/accuracy"], 3) for r in evals], "eval_steps": [r["step"] for r in evals]}


def main(argv=None):
  args = harness.parse(__doc__, _flags, argv, quick="the tiny variant, few steps",
                       seed="config.seed of the timed runs (--grid and --seeds set their own)")
  SETTINGS[:] = [f"--config.{kv}" for kv in args.set]
  layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
  if args.grid or args.seeds:
    out = {}
    with tempfile.TemporaryDirectory(prefix="rl_step_") as tmp:
      if args.grid:
        out["grid"] = _grid(pathlib.Path(tmp), layouts, args.steps or 14, 4 if args.skip_steps is None else args.skip_steps)
      if args.seeds:
        out["seeds"] = [_seed_run(pathlib.Path(tmp), int(s), layout) for s in args.seeds.split(",") for layout in layouts]
        out["seeds_all_pass"] = all(r["gain_points"] >= 55 and r["wall_s"] <= 90 for r in out["seeds"])
    out["settings"] = args.set
    harness.report(out, args, indent=2)
    return
  steps = args.steps or (6 if args.quick else 100)
  skip = args.skip_steps if args.skip_steps is not None else (2 if args.quick else 10)
  rounds = []  # per round: {layout or "baseline": summary}
  with tempfile.TemporaryDirectory(prefix="rl_step_") as tmp:
    tmp = pathlib.Path(tmp)
    tree = rev = None
    if args.baseline:
      rev = subprocess.run(["git", "rev-parse", args.baseline], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.strip()
      tree = tmp / "baseline-tree"
      subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=REPO, capture_output=True,
                     check=True)
    try:
      # Interleaved rounds: a load change on the shared machine falls on every run of a round alike.
      for i in range(args.repeats):
        runs = {layout: _summary(_run(REPO, tmp / f"{layout}-{i}", steps, args.quick, _layout_flags(layout),
                                      args.seed), skip)
                for layout in layouts}
        if tree is not None:
          runs["baseline"] = {"rev": rev, **_summary(_run(tree, tmp / f"baseline-{i}", steps, args.quick, [],
                                                          args.seed), skip)}
        rounds.append(runs)
    finally:
      if tree is not None:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
  median_run = lambda name: sorted((r[name] for r in rounds), key=lambda s: s["s_per_step"])[(len(rounds) - 1) // 2]
  out = {"layouts": {layout: median_run(layout) for layout in layouts}}
  out["s_per_step"] = {layout: s["s_per_step"] for layout, s in out["layouts"].items()}
  fastest = min(out["s_per_step"], key=out["s_per_step"].get)
  out["fastest_layout"] = fastest
  if args.baseline:
    out["baseline"] = median_run("baseline")
    # Per round: the baseline's s/step over that round's faster layout's.
    out["speedup_runs"] = [round(r["baseline"]["s_per_step"] / min(r[x]["s_per_step"] for x in layouts), 3)
                           for r in rounds]
    out["speedup_vs_baseline"] = round(statistics.median(out["speedup_runs"]), 3)
  if args.repeats > 1:
    out["rounds"] = rounds
  if "split" in out["layouts"]:
    split = out["layouts"]["split"]
    out["split_busy_max"] = max(split["learner_busy"], split["sampler_busy"])
  out["sync_ms"] = out["layouts"][fastest]["sync_ms"]
  out["workload"] = {"config": "configs/addition_grpo.py" + (":size=tiny" if args.quick else ""), "settings": args.set,
                     "steps": steps, "repeats": args.repeats,
                     "skip_steps": skip, "devices": "4 sampler + 4 learner (virtual CPU)"}
  harness.report(out, args, indent=2)


if __name__ == "__main__":
  main()
