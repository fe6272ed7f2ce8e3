"""Rerun a recorded run step by step and check it against its record.

  python -m tunixlike.replay --workdir runs/addition [--until STEP] [--from-checkpoint]

A run writes WORKDIR/schedule.jsonl as it trains (log.schedule, on by default): per learner step
the batch it took, the sampler's weight swaps and admissions before it, the rewards as scored and
a checksum of the weights after it (`tunixlike/rl/schedule.py`). The replay builds the run from its
checkpoint's config, starts where the record's first segment starts (the step-0 checkpoint, kept for
it) and does exactly what the record says in one thread: no thread timing is left to decide
anything, and the rewards are the recorded ones (a reward that called an outside service is not
called again). After each step it compares the step's metrics (timings aside) and the weights'
checksum with the record, and stops at the first step that differs, naming it and what differs
(exit status 1). A changed config, code or backend shows there.

`--from-checkpoint` starts from the latest replay point (log.replay_every: a checkpoint saved with
the sampler drained) or checkpoint the run started a segment from (its first start or a resume; with
--until, the latest before STEP), so checking step N costs the steps since then, not N. A free-running run's other checkpoints were written while sequences
were half decoded: they keep the tokens (rl/in_flight.py), not the KV the run went on from (part of it
computed by older weights), so the run that went on from there is not the one a resume makes. A
deterministic run (rl.deterministic) resumes from any checkpoint to the same run, so rerunning it
from there with `tunixlike.train` is its replay.
The JSON summary goes to stdout; bad input prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

PROG = "tunixlike.replay"


def _parse(argv):
  p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True, help="the run's --workdir (its schedule.jsonl and checkpoints)")
  p.add_argument("--until", type=int, default=None, help="stop before this step (default: every recorded step)")
  p.add_argument("--from-checkpoint", action="store_true",
                 help="start from the latest checkpoint a segment of the run started from, before --until")
  return p.parse_args(argv)


def replay_segment(ckpt, header: dict, steps: list[dict], until: int | None, say) -> dict:
  """Builds the run as it stood at the segment's start and replays its steps (`schedule.replay`)."""
  from tunixlike import config as config_lib
  from tunixlike.rl import build, in_flight, schedule
  from tunixlike.rl.trainer import IN_MEMORY
  from tunixlike.rl.prompts import PromptStream
  from tunixlike.rl.runtime import AsyncRuntime

  start = header["segment"]
  meta = ckpt.read_meta(start)
  cfg = config_lib.from_saved(meta["config"])
  saved = meta["config"]
  in_memory = [f"data.{k}" for k, v in saved.get("data", {}).items() if str(v).startswith(IN_MEMORY)]
  in_memory += [f"rewards[{i}]" for i, r in enumerate(saved.get("rewards") or ()) if str(r.get("fn")).startswith(IN_MEMORY)]
  if in_memory:
    raise ValueError(f"the run was given {', '.join(in_memory)} in memory (tunixlike.train): a replay builds the run "
                     "from its config, so it needs them as files or import paths")
  setup = build.build(cfg, None)
  rl = build.build_rl(setup)
  policy = rl.policy
  policy.restore(ckpt, start)
  # The rollouts in flight the checkpoint kept, as the resumed run continued them (rl/in_flight.py).
  kept = in_flight.from_json(ckpt.read_item(start, "rollouts")["processes"][0]) if header.get("kept") else None
  stream = PromptStream(setup.train_pipe, header["stream"]["position"], replay=header["stream"]["outstanding"],
                        kept=kept.stream_indices if kept is not None else ())
  sampler = schedule.ReplaySampler()
  run_cfg = build.runtime_config(cfg, policy)
  queue = schedule.ReplayQueue(run_cfg.prompts_per_step, cfg.rl.max_staleness, start_version=start,
                               counts=header["queue"], sampler=sampler)
  groups = {group.seq: group for group in (kept.scored if kept is not None else ())}
  recorded = {int(seq): r for record in steps for seq, r in record.get("rewards", {}).items()}
  sink = schedule.sink_for(groups, rl.scorer, recorded.get)
  synced = build.first_weights(setup, rl)  # what the run's sampler started with
  admission = types.SimpleNamespace(try_admit=sampler.may_start_group, first_seq=header["first_seq"])
  sampler.driver = build.make_driver(setup, rl.engine, rl.scorer, stream, admission, sink, synced,
                                     resume=kept.in_flight if kept is not None else ())
  runtime = AsyncRuntime(run_cfg, queue=queue, rewards=None, driver=sampler, policy=policy,
                         collapse=build.collapse_detector(cfg, policy))
  try:
    return schedule.replay(runtime, sampler, queue, steps, groups, until=until, say=say)
  finally:
    setup.tracer.close()
    rl.close()


def run(workdir: str, until: int | None = None, from_checkpoint: bool = False, say=print) -> dict:
  """Replays the run in `workdir`; returns {"steps", "first_difference", "detail", "from_step"}."""
  from tunixlike import checkpoint as checkpoint_lib
  from tunixlike.rl import schedule

  path = os.path.join(workdir, schedule.FILE)
  if not os.path.exists(path):
    raise ValueError(f"{path} does not exist: the run was not recorded (log.schedule=true records single-turn runs)")
  records = schedule.read(path)
  segments = schedule.segments(records)
  ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.workdir_checkpoints(workdir), read_only=True)
  saved = set(ckpt.all_steps())
  starts = [(h, steps) for h, steps in schedule.starts(records)
            if h["segment"] in saved and (until is None or h["segment"] < until)]
  if not starts or (not from_checkpoint and starts[0][0] is not segments[0][0]):
    raise ValueError(f"{workdir}: no checkpoint left where the record starts (step {segments[0][0]['segment']})"
                     + ("" if from_checkpoint else "; --from-checkpoint starts from a later one"))
  if from_checkpoint:  # the latest start, then the segments after it
    header, steps = starts[-1]
    later = [s for s in segments if s[0]["segment"] > header["segment"]]
    plan = [(header, steps), *later]
  else:
    plan = segments
  total = {"steps": 0, "first_difference": None, "detail": None, "from_step": plan[0][0]["segment"]}
  for header, steps in plan:
    if until is not None and header["segment"] >= until:
      break
    if header["segment"] not in saved:
      say(f"the run resumed at step {header['segment']} from a checkpoint deleted since: the replay stops there")
      break
    say(f"replaying from the checkpoint at step {header['segment']} ({sum('step' in r for r in steps)} recorded steps)")
    out = replay_segment(ckpt, header, steps, until, say)
    total["steps"] += out["steps"]
    if out["first_difference"] is not None:
      total.update(first_difference=out["first_difference"], detail=out["detail"])
      break
  ckpt.close()
  return total


def main(argv=None):
  args = _parse(sys.argv[1:] if argv is None else argv)
  from tunixlike import compilation_cache
  compilation_cache.enable()
  say = lambda line: print(line, file=sys.stderr, flush=True)
  try:
    out = run(args.workdir, args.until, args.from_checkpoint, say=say)
  except ValueError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps(out))
  if out["first_difference"] is not None:
    say(f"differs from the record at {out['detail']}")
    sys.exit(1)
  say(f"{out['steps']} steps replayed from step {out['from_step']}: every one equal to the record")


if __name__ == "__main__":
  main()
